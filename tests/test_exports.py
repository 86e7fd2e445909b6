"""Per-token exports (``.../layers/{l}/export``): the round trip through pandas.

A real Redis, a real worker (thread) running MiniLM on BBC paragraphs, the real app. The
Parquet and CSV files read back with one line of pandas equal, value for value, the JSON
token endpoint walked page by page; the mean vectors equal a scan of the store's means;
CSV and Parquet agree; a small chunk size gives several row groups and the same rows.
"""

from __future__ import annotations

import contextlib
import io
import json
from typing import Iterator

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from fastapi.testclient import TestClient

from embgeom import exports, reports
from embgeom.compute.catalogue import ModelRegistry
from embgeom.corpora import bbc_texts
from embgeom.store.keys import PairKeys
from embgeom.store.reader import Reader, run_sync
from embgeom.store.server import RedisServer
from embgeom.worker import redis_client
from service.app import create_app
from tests.conftest import WorkerThread, wait_for_jobs
from tests.conftest import test_settings as settings_for

BASE = "/v1/collections/exp/models/minilm"
LAYER = 2
TEXTS = [p for p in bbc_texts("paragraphs") if 40 <= len(p) <= 200][200:260]
FIELDS = ("token_id", "token", "n", "Q", "M", "V", "self_similarity")


# Each test runs on a pair whose token records are one layer group (the default for
# MiniLM) and on one cut into a group per layer (record_bytes=4096): every read path of
# an export (scalars joined across groups, one group's means) on both layouts.
LAYOUTS = {"one_group": {}, "group_per_layer": {"record_bytes": 4096}}
SEEN: dict = {}  # layout -> the JSON token endpoint's rows, to compare the layouts


@contextlib.contextmanager
def serve_layout(layout: str, tmp) -> Iterator[tuple[TestClient, str]]:
    """A Redis, a worker thread and the app, with TEXTS ingested into a pair of ``layout``;
    records that layout's token rows in SEEN."""
    server = RedisServer(tmp / "redis").start()
    settings = settings_for(server.url, checkpoint_seconds=0.2, **LAYOUTS[layout])
    try:
        with WorkerThread(settings), TestClient(create_app(settings)) as client:
            r = client.post("/v1/jobs", json={"collection": "exp", "model": "minilm", "texts": TEXTS})
            assert r.status_code == 202, r.text
            (status,) = wait_for_jobs(client, [r.json()["job_id"]], timeout=300)
            assert status["status"] == "done", status
            conf = run_sync(redis_client(server.url), Reader().pair_state(PairKeys("exp", "minilm"))).conf
            assert len(conf.groups) == (1 if layout == "one_group" else conf.L)
            SEEN[layout] = walk_tokens(client)
            yield client, server.url
    finally:
        server.kill()


@pytest.fixture(scope="module", params=list(LAYOUTS))
def service(request, tmp_path_factory) -> Iterator[tuple[TestClient, str]]:
    with serve_layout(request.param, tmp_path_factory.mktemp("exports")) as served:
        yield served


def walk_tokens(client: TestClient, **params) -> dict[int, dict]:
    """Every token of the layer through the JSON endpoint, following its cursor."""
    out: dict[int, dict] = {}
    query = {"limit": 97, "order_by": "n", **params}
    while True:
        page = client.get(f"{BASE}/layers/{LAYER}/tokens", params=query).json()
        for t in page["tokens"]:
            assert t["token_id"] not in out
            out[t["token_id"]] = t
        if not page["next_cursor"]:
            return out
        query["cursor"] = page["next_cursor"]


def as_json_values(frame: pd.DataFrame) -> dict[int, dict]:
    rows = {}
    for rec in frame.to_dict("records"):
        ss = rec["self_similarity"]
        rows[int(rec["token_id"])] = {
            "token_id": int(rec["token_id"]), "token": rec["token"], "n": int(rec["n"]),
            "Q": float(rec["Q"]), "M": float(rec["M"]), "V": float(rec["V"]),
            "self_similarity": None if ss is None or np.isnan(ss) else float(ss)}
    return rows


def read_csv(body: bytes) -> pd.DataFrame:
    """The documented one line: token strings such as "nan" or "null" stay strings."""
    return pd.read_csv(io.BytesIO(body), keep_default_na=False, na_values={"self_similarity": [""]})


def get_export(client: TestClient, **params):
    r = client.get(f"{BASE}/layers/{LAYER}/export", params=params)
    assert r.status_code == 200, r.text
    return r


def test_parquet_and_csv_equal_the_json_token_endpoint(service):
    client, _ = service
    want = {k: {f: t[f] for f in FIELDS} for k, t in walk_tokens(client).items()}
    parquet = get_export(client)
    assert parquet.headers["content-type"] == exports.MEDIA_TYPES["parquet"]
    assert parquet.headers["content-disposition"] == 'attachment; filename="exp-minilm-layer2.parquet"'
    frame = pd.read_parquet(io.BytesIO(parquet.content))
    assert list(frame.columns) == list(FIELDS)
    assert str(frame["n"].dtype) == "int64" and str(frame["Q"].dtype) == "float64"
    assert frame["token_id"].is_monotonic_increasing
    assert int(parquet.headers["x-embgeom-rows"]) == len(frame) == len(want)
    assert as_json_values(frame) == want
    assert any(v["self_similarity"] is not None for v in want.values())
    meta = json.loads(pq.read_schema(io.BytesIO(parquet.content)).metadata[b"embgeom"])
    assert (meta["collection"], meta["model"], meta["layer"], meta["min_count"]) == ("exp", "minilm", LAYER, 1)
    assert meta["as_of"]["version"] == int(parquet.headers["x-embgeom-version"])

    csv = get_export(client, format="csv")
    assert csv.headers["content-type"] == exports.MEDIA_TYPES["csv"]
    from_csv = read_csv(csv.content)
    assert list(from_csv.columns) == list(FIELDS)
    assert as_json_values(from_csv) == want
    # pandas' defaults read the same rows (only a token such as "nan" would become NaN).
    assert len(pd.read_csv(io.BytesIO(csv.content))) == len(want)


def test_the_count_filter_selects_the_same_rows_as_the_json_endpoint(service):
    client, _ = service
    want = walk_tokens(client, min_count=2, max_count=20)
    for fmt in ("parquet", "csv"):
        body = get_export(client, format=fmt, min_count=2, max_count=20).content
        frame = (pd.read_parquet(io.BytesIO(body)) if fmt == "parquet" else
                 read_csv(body))
        assert set(frame["token_id"]) == set(want)
        assert frame["n"].between(2, 20).all()
        assert as_json_values(frame) == {k: {f: t[f] for f in FIELDS} for k, t in want.items()}


def test_means_equal_a_scan_of_the_store_and_csv_agrees_with_parquet(service):
    client, url = service
    reader = Reader()
    r = redis_client(url)
    state = run_sync(r, reader.pair_state(PairKeys("exp", "minilm")))
    pos = state.conf.layer_position(LAYER)
    ids, n, _, means = run_sync(r, reader.means(state, [pos]))
    scanned = {int(i): means[j, 0] for j, i in enumerate(ids)}

    frame = pd.read_parquet(io.BytesIO(get_export(client, means="true").content))
    assert list(frame.columns) == [*FIELDS, "mean"]
    assert len(frame) == len(scanned)
    for token_id, mean in zip(frame["token_id"], frame["mean"]):
        assert np.array_equal(np.asarray(mean, dtype=np.float64), scanned[int(token_id)])

    text = get_export(client, format="csv", means="true").content
    from_csv = read_csv(text)
    assert as_json_values(from_csv) == as_json_values(frame)
    for token_id, mean in zip(from_csv["token_id"], from_csv["mean"]):
        assert np.array_equal(np.array(json.loads(mean), dtype=np.float64), scanned[int(token_id)])


def test_small_chunks_stream_several_row_groups_with_the_same_rows(service):
    _, url = service
    registry = ModelRegistry.from_settings(settings_for(url))
    reader = Reader()
    r = redis_client(url)
    plan = exports.prepare(reader, PairKeys("exp", "minilm"), LAYER, reports.CountFilter(), True,
                           registry.tokenizer("minilm"))
    ex = run_sync(r, plan)
    read = lambda p: run_sync(r, p)  # noqa: E731
    pieces = list(exports.write_parquet(ex, exports.chunks(ex, read, rows=50)))
    assert len(pieces) > 3  # the row groups went out one by one, before the footer
    small = pq.ParquetFile(io.BytesIO(b"".join(pieces)))
    assert small.metadata.num_row_groups == -(-ex.rows // 50)
    whole = pq.read_table(io.BytesIO(b"".join(exports.stream(ex, read, "parquet"))))
    assert small.read().equals(whole)
    lines = b"".join(exports.write_csv(ex, exports.chunks(ex, read, rows=7))).decode().splitlines()
    assert len(lines) == ex.rows + 1


def test_bad_export_requests_are_4xx(service):
    client, _ = service
    def check(path, status, type_, **params):
        r = client.get(path, params=params)
        assert r.status_code == status, r.text
        assert r.json()["type"] == type_
    path = f"{BASE}/layers/{LAYER}/export"
    check(path, 422, "invalid_format", format="xlsx")
    check(path, 422, "invalid_filter", min_count=3, max_count=2)
    check(path, 422, "validation_error", min_count=0)
    check(path, 422, "validation_error", means="perhaps")
    check(f"{BASE}/layers/9/export", 404, "layer_not_found")
    check("/v1/collections/nowhere/models/minilm/layers/1/export", 404, "collection_not_found")
    check("/v1/collections/exp/models/mpnet/layers/1/export", 404, "model_not_in_collection")
    check("/v1/collections/exp/models/no-such/layers/1/export", 404, "unknown_model")


@pytest.mark.parametrize("service", ["group_per_layer"], indirect=True)
def test_the_layouts_serve_the_same_tokens(service, tmp_path):
    """The same texts into a one-group pair and a pair with a group per layer: the same
    tokens and counts, and Q, M, V, self-similarity equal up to the merge order of the
    windows (float64 rounding). The one-group rows come from its earlier fixture, or
    from a service of its own when this test runs alone."""
    if "one_group" not in SEEN:
        with serve_layout("one_group", tmp_path):
            pass
    one, grouped = SEEN["one_group"], SEEN["group_per_layer"]
    assert one.keys() == grouped.keys()
    for k, a in one.items():
        b = grouped[k]
        assert (a["n"], a["token"]) == (b["n"], b["token"])
        for f in ("Q", "M", "V", "self_similarity"):
            if a[f] is None:  # self-similarity of a token seen once
                assert b[f] is None, (k, f)
            else:
                assert b[f] == pytest.approx(a[f], rel=1e-9, abs=1e-12), (k, f)
