"""The HTTP client and the ``ingest`` / ``table`` commands.

Unit tests pin the chunking and the retry logic (``httpx.MockTransport``); one
integration test runs the real console entry point against a real ``embgeom serve``.
"""

from __future__ import annotations

import asyncio
import csv
import hashlib
import io
import json
import re
import subprocess
import sys

import httpx
import pytest

from embgeom.client import ApiError, EmbgeomClient
from embgeom.inputs import MAX_JOB_BYTES, chunk_texts, idempotency_key, read_texts
from embgeom.tables import TABLE_COLUMNS, format_table
from embgeom.testing.serve import REPO
from tests.conftest import wait_for_jobs


# --------------------------------------------------------------------- chunking
def test_read_texts_skips_blank_and_whitespace_lines_and_keeps_other_separators():
    data = "first\r\n\n   \n\t\nsecond line \nthird\x0cstill third\u2028and still\n\n"
    assert read_texts(data) == ["first", "second line ", "third\x0cstill third\u2028and still"]
    assert read_texts("") == []
    assert read_texts("\n \n") == []
    assert read_texts("no newline at the end") == ["no newline at the end"]


def test_chunks_respect_the_text_count():
    texts = [f"text {i}" for i in range(10)]
    chunks = chunk_texts(texts, max_texts=4)
    assert [len(c) for c in chunks] == [4, 4, 2]
    assert sum(chunks, []) == texts
    assert chunk_texts(texts, max_texts=10) == [texts]
    assert chunk_texts([], max_texts=3) == []
    with pytest.raises(ValueError):
        chunk_texts(texts, max_texts=0)


def test_chunks_respect_the_utf8_byte_limit_not_the_character_count():
    # "£" is 2 bytes in UTF-8: 100 texts of 50 characters are 100 bytes each.
    texts = ["£" * 50] * 100
    chunks = chunk_texts(texts, max_texts=1000, max_bytes=1000)
    assert [len(c) for c in chunks] == [10] * 10
    assert all(sum(len(t.encode()) for t in c) <= 1000 for c in chunks)
    # Default limit: jobs every service accepts (its smallest max_job_bytes is 1 MB).
    big = ["x" * 300_000] * 7
    chunks = chunk_texts(big, max_texts=1000)
    assert [len(c) for c in chunks] == [3, 3, 1]
    assert all(sum(len(t.encode()) for t in c) <= MAX_JOB_BYTES for c in chunks)


def test_a_text_over_the_byte_limit_goes_alone_and_uncut():
    texts = ["a", "b" * 50, "c", "d"]
    assert chunk_texts(texts, max_texts=10, max_bytes=10) == [["a"], ["b" * 50], ["c", "d"]]


def test_idempotency_keys_are_deterministic_and_distinguish_what_they_send():
    base = ("col", "minilm", False, "f" * 64, 0, ["a", "b"])
    key = idempotency_key(*base)
    assert key == idempotency_key(*base)
    assert len(key) <= 200  # the service's header limit
    variants = [
        ("col2", "minilm", False, "f" * 64, 0, ["a", "b"]),
        ("col", "mpnet", False, "f" * 64, 0, ["a", "b"]),
        ("col", "minilm", True, "f" * 64, 0, ["a", "b"]),
        ("col", "minilm", False, "e" * 64, 0, ["a", "b"]),
        ("col", "minilm", False, "f" * 64, 1, ["a", "b"]),
        ("col", "minilm", False, "f" * 64, 0, ["a"]),       # another --texts-per-job
        ("col", "minilm", False, "f" * 64, 0, ["ab"]),      # texts are not concatenated
    ]
    keys = {idempotency_key(*v) for v in variants}
    assert len(keys) == len(variants) and key not in keys


# ------------------------------------------------------------------ retry, errors
def _client(handler, **kwargs) -> tuple[EmbgeomClient, list[float]]:
    slept: list[float] = []
    client = EmbgeomClient("http://embgeom.test", transport=httpx.MockTransport(handler),
                           sleep=slept.append, **kwargs)
    return client, slept


def _overloaded(headers=None) -> httpx.Response:
    return httpx.Response(429, headers=headers or {},
                          json={"type": "overloaded", "message": "10000 jobs are pending", "detail": {}})


def test_429_is_retried_after_retry_after_with_the_same_request():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if len(seen) <= 2:
            return _overloaded({"Retry-After": "2"})
        return httpx.Response(202, json={"job_id": "j1", "status": "queued"})

    client, slept = _client(handler, api_key="secret")
    assert client.submit(["a text"], "c", "minilm", idempotency_key="k1") == "j1"
    assert slept == [2.0, 2.0]
    assert len(seen) == 3
    assert len({r.content for r in seen}) == 1
    assert {r.headers["Idempotency-Key"] for r in seen} == {"k1"}
    assert {r.headers["Authorization"] for r in seen} == {"Bearer secret"}
    # include_special left out: the collection's settings decide (a paper-preset
    # collection would refuse an explicit false with 409)
    assert json.loads(seen[0].content) == {"collection": "c", "model": "minilm", "texts": ["a text"]}


def test_429_without_retry_after_backs_off_exponentially_then_gives_up():
    calls = []

    def handler(request):
        calls.append(request)
        return _overloaded()

    client, slept = _client(handler, max_retries=4, max_backoff=3.0)
    with pytest.raises(ApiError) as err:
        client.job("j1")
    assert (err.value.status, err.value.type) == (429, "overloaded")
    assert err.value.message == "10000 jobs are pending"
    assert len(calls) == 5 and len(slept) == 4
    assert all(0 <= d <= min(3.0, 0.5 * 2 ** i) for i, d in enumerate(slept))


def test_retry_after_as_an_http_date_and_capped_by_max_backoff():
    answers = iter([_overloaded({"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"}),  # past: now
                    _overloaded({"Retry-After": "3600"}),
                    httpx.Response(200, json={"job_id": "j1"})])
    client, slept = _client(lambda request: next(answers), max_backoff=5.0)
    assert client.job("j1") == {"job_id": "j1"}
    assert slept == [0.0, 5.0]


def _loading(headers=None) -> httpx.Response:
    return httpx.Response(503, headers=headers or {},
                          json={"type": "model_loading", "message": "model 'minilm' is loading in this "
                                "process; retry in 2 s", "detail": {"model": "minilm", "retry_after": 2}})


def test_503_with_retry_after_is_retried_like_429():
    seen = []

    def handler(request):
        seen.append(request)
        if len(seen) == 1:
            return _loading({"Retry-After": "2"})
        if len(seen) == 2:
            return _overloaded({"Retry-After": "1"})
        return httpx.Response(200, json={"pearson_cosine": 0.5})

    client, slept = _client(handler)
    assert client.compare_global("c:minilm:3", "c:minilm:input") == {"pearson_cosine": 0.5}
    assert slept == [2.0, 1.0]
    assert len({r.content for r in seen}) == 1 and len(seen) == 3


def test_503_with_retry_after_gives_up_past_the_retry_budget():
    calls = []

    def handler(request):
        calls.append(request)
        return _loading({"Retry-After": "2"})

    client, slept = _client(handler, max_retries=3, max_backoff=1.5)
    with pytest.raises(ApiError) as err:
        client.compare_global("c:minilm:3", "c:minilm:input")
    assert (err.value.status, err.value.type) == (503, "model_loading")
    assert err.value.detail == {"model": "minilm", "retry_after": 2}
    assert len(calls) == 4 and slept == [1.5, 1.5, 1.5]  # capped by max_backoff


def test_503_without_retry_after_is_not_retried():
    calls = []

    def handler(request):
        calls.append(request)
        return httpx.Response(503, json={"status": "unavailable", "redis": True, "workers": 0,
                                         "embedded": False})

    client, slept = _client(handler)
    with pytest.raises(ApiError) as err:
        client.readyz()
    assert err.value.status == 503
    assert len(calls) == 1 and slept == []


def test_the_async_client_retries_503_with_retry_after_within_its_budget():
    from embgeom.client import AsyncEmbgeomClient

    def run(answers: int, max_retries: int):
        calls, slept = [], []

        def handler(request):
            calls.append(request)
            if len(calls) <= answers:
                return _loading({"Retry-After": "0.5"})
            return httpx.Response(200, json={"pearson_cosine": 0.5})

        async def sleep(seconds):
            slept.append(seconds)

        async def main():
            async with AsyncEmbgeomClient("http://embgeom.test", transport=httpx.MockTransport(handler),
                                          max_retries=max_retries, sleep=sleep) as client:
                return await client.compare_global("c:minilm:3", "c:minilm:input")

        try:
            return asyncio.run(main()), calls, slept
        except ApiError as exc:
            return exc, calls, slept

    got, calls, slept = run(answers=2, max_retries=2)
    assert got == {"pearson_cosine": 0.5} and len(calls) == 3 and slept == [0.5, 0.5]
    got, calls, slept = run(answers=3, max_retries=2)
    assert isinstance(got, ApiError) and (got.status, got.type) == (503, "model_loading")
    assert len(calls) == 3 and slept == [0.5, 0.5]


def test_errors_are_raised_with_the_service_type_and_other_bodies_as_http_error():
    def handler(request):
        if request.url.path.endswith("/missing"):
            return httpx.Response(404, json={"type": "job_not_found", "message": "no job 'missing'",
                                             "detail": {"job_id": "missing"}})
        return httpx.Response(502, text="<html>bad gateway</html>")

    client, slept = _client(handler)
    with pytest.raises(ApiError) as err:
        client.job("missing")
    assert (err.value.status, err.value.type, err.value.detail) == (404, "job_not_found", {"job_id": "missing"})
    with pytest.raises(ApiError) as err:
        client.job("other")
    assert (err.value.status, err.value.type) == (502, "http_error")
    assert slept == []  # only 429, and 503 with Retry-After, are retried


def test_tokens_follows_the_cursor_to_the_last_page():
    pages = {None: ([1, 2], "c1"), "c1": ([3, 4], "c2"), "c2": ([5], None)}
    queries = []

    def handler(request):
        queries.append(dict(request.url.params))
        ids, cursor = pages[request.url.params.get("cursor")]
        return httpx.Response(200, json={"layer": 3, "tokens": [{"token_id": i} for i in ids],
                                         "next_cursor": cursor, "total": 5})

    client, _ = _client(handler)
    got = [t["token_id"] for t in client.tokens("c", "minilm", 3, order_by="Q", desc=False,
                                                min_count=2, page_size=2)]
    assert got == [1, 2, 3, 4, 5]
    assert [q.get("cursor") for q in queries] == [None, "c1", "c2"]
    assert all(q["order_by"] == "Q" and q["desc"] == "false" and q["min_count"] == "2"
               and q["limit"] == "2" and "max_count" not in q for q in queries)


def test_wait_polls_the_oldest_unfinished_jobs_and_reports_progress():
    polls: dict[str, int] = {}

    def handler(request):
        assert request.url.path == "/v1/jobs"  # one request per round: GET /v1/jobs?ids=
        statuses = []
        for job_id in request.url.params["ids"].split(","):
            polls[job_id] = polls.get(job_id, 0) + 1
            done = polls[job_id] >= 2
            statuses.append({"job_id": job_id, "status": "done" if done else "running",
                             "progress": 1.0 if done else 0.5, "tokens": 7})
        return httpx.Response(200, json=statuses)

    client, slept = _client(handler)
    seen = []
    final = client.wait(["a", "b", "c"], on_progress=lambda s: seen.append([x and x["status"] for x in s]),
                        window=2)
    assert [s["status"] for s in final] == ["done"] * 3
    assert seen[0] == ["running", "running", None]  # "c" waits outside the window
    assert seen[-1] == ["done", "done", "done"]
    assert polls == {"a": 2, "b": 2, "c": 2}

    client, _ = _client(lambda r: httpx.Response(200, json=[{"job_id": "x", "status": "queued", "progress": 0}]))
    with pytest.raises(TimeoutError):
        client.wait(["x"], timeout=0)


def test_format_table_leaves_nulls_empty_and_keeps_floats_exact():
    rows = [{"layer": 0, "n": 3, "num_types": 2, "Q": 0.1 + 0.2, "M": 1e-17, "V": 2.5, "V_W": 1.0,
             "V_B": 1.5, "cv_Q": None, "slope": None, "r2": None, "extra": "ignored"}]
    parsed = list(csv.DictReader(io.StringIO(format_table(rows, "csv"))))
    assert list(parsed[0]) == list(TABLE_COLUMNS)
    assert float(parsed[0]["Q"]) == 0.1 + 0.2 and parsed[0]["cv_Q"] == ""
    assert json.loads(format_table(rows, "json"))[0]["slope"] is None
    md = format_table(rows, "markdown").splitlines()
    assert len(md) == 3 and md[0].split("|")[1].strip() == "layer"
    with pytest.raises(ValueError):
        format_table(rows, "html")


# ------------------------------------------------------------------ integration
def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "embgeom.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def _summary(stdout: str) -> dict:
    m = re.search(r"jobs: (\d+)\s+texts: (\d+)\s+tokens: (\d+)\s+failed: (\d+)", stdout)
    assert m, stdout
    return dict(zip(("jobs", "texts", "tokens", "failed"), map(int, m.groups())))


def _markdown_rows(text: str) -> list[dict]:
    lines = [l for l in text.splitlines() if l.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(header, (c.strip() for c in l.strip("|").split("|")))) for l in lines[2:]]


def _close(a, b) -> bool:
    return (a is None and b in ("", None)) or float(b) == pytest.approx(a, rel=1e-5, abs=1e-12)


def test_ingest_counts_every_token_once_even_when_resumed_and_table_matches_layers(embedded_service, tmp_path):
    from transformers import AutoTokenizer

    from embgeom.corpora import bbc_texts
    from embgeom.sources import minilm_path

    url, _ = embedded_service
    texts = bbc_texts("paragraphs")[:120]
    # Blank and whitespace-only lines between texts are skipped, not sent.
    path = tmp_path / "bbc.txt"
    path.write_text("\n\n".join(texts) + "\n \n", encoding="utf-8")
    tokenizer = AutoTokenizer.from_pretrained(str(minilm_path()))
    expected = sum(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])
    command = ["ingest", str(path), "--url", url, "--collection", "bbc", "--texts-per-job", "40", "--quiet"]

    with EmbgeomClient(url) as client, httpx.Client(base_url=url) as raw:
        # A run interrupted after its first job: that job was submitted and counted.
        chunks = chunk_texts(read_texts(path.read_text(encoding="utf-8")), 40)
        assert [len(c) for c in chunks] == [40, 40, 40]
        key = idempotency_key("bbc", "minilm", False, hashlib.sha256(path.read_bytes()).hexdigest(), 0,
                              chunks[0])
        first = client.submit(chunks[0], "bbc", "minilm", idempotency_key=key)
        client.wait([first], timeout=300)

        # The same command resumes: the first job is not sent again.
        run = _cli(*command)
        assert run.returncode == 0, run.stderr
        assert _summary(run.stdout) == {"jobs": 3, "texts": 120, "tokens": expected, "failed": 0}
        layers = client.layers("bbc", "minilm")["layers"]
        assert [row["n"] for row in layers] == [expected] * len(layers)

        # Again, then without waiting: the same three jobs, all done, nothing counted twice.
        again = _cli(*command)
        assert again.returncode == 0, again.stderr
        assert _summary(again.stdout) == _summary(run.stdout)
        listed = _cli(*command, "--no-wait")
        assert listed.returncode == 0, listed.stderr
        job_ids = listed.stdout.split()
        assert len(set(job_ids)) == 3 and job_ids[0] == first
        jobs = wait_for_jobs(raw, job_ids, timeout=10)
        assert [(j["status"], j["texts"], j["collection"]) for j in jobs] == [("done", 40, "bbc")] * 3
        assert sum(j["tokens"] for j in jobs) == expected
        assert client.layers("bbc", "minilm")["layers"] == layers

        # The table is /layers, in every format.
        filtered = client.layers("bbc", "minilm", min_count=2)["layers"]
        want = [{col: row[field] for col, field in TABLE_COLUMNS.items()} for row in filtered]
        table = ["table", "--url", url, "--collection", "bbc", "--model", "minilm", "--min-count", "2"]
        as_json = _cli(*table, "--format", "json")
        assert as_json.returncode == 0, as_json.stderr
        assert json.loads(as_json.stdout) == want
        as_csv = list(csv.DictReader(io.StringIO(_cli(*table, "--format", "csv").stdout)))
        assert [{c: (float(v) if v else None) for c, v in r.items()} for r in as_csv] == want
        as_md = _markdown_rows(_cli(*table).stdout)
        assert [list(r) for r in as_md] == [list(TABLE_COLUMNS)] * len(want)
        assert all(_close(w[c], r[c]) for w, r in zip(want, as_md) for c in TABLE_COLUMNS)
        assert filtered[0]["num_types"] < layers[0]["num_types"]  # the filter reached the service

        # The other reports, through the client.
        seen = list(client.tokens("bbc", "minilm", 0, page_size=500))
        assert len({t["token_id"] for t in seen}) == len(seen) == layers[0]["num_types"]
        assert sum(t["n"] for t in seen) == expected
        assert [t["n"] for t in seen] == sorted((t["n"] for t in seen), reverse=True)
        top = seen[0]
        detail = client.token("bbc", "minilm", 0, top["token_id"])
        assert (detail["token"], detail["n"]) == (top["token"], top["n"])
        assert detail["Q"] == pytest.approx(top["Q"], rel=1e-12)
        decomposition = client.decomposition("bbc", "minilm", 3)
        assert {k: decomposition[k] for k in ("n", "num_types", "Q", "M", "V", "V_W", "V_B")} == \
            {k: layers[3][k] for k in ("n", "num_types", "Q", "M", "V", "V_W", "V_B")}
        with pytest.raises(ApiError) as err:
            client.layers("never-created", "minilm")
        assert (err.value.status, err.value.type) == (404, "collection_not_found")

        # After a DELETE, the same command either counts the file afresh or says that it
        # did not: it never reports success over an empty collection.
        client.delete_collection("bbc")
        after = _cli(*command)
        if after.returncode == 0:
            assert [row["n"] for row in client.layers("bbc", "minilm")["layers"]] == [expected] * len(layers)
        else:
            assert after.returncode == 1 and "was deleted after these jobs ran" in after.stderr, after.stderr

    missing = _cli("table", "--url", url, "--collection", "never-created")
    assert missing.returncode == 1 and "collection_not_found" in missing.stderr
