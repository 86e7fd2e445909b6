"""``embgeom ingest`` of JSONL, CSV and Parquet files, and ``embgeom report``.

Unit tests pin how each file format is read; one integration test runs the real console
entry point against a real ``embgeom serve`` (embedded Redis and worker): the three
formats count the same texts, a second run counts nothing twice, and ``embgeom report``
writes the page and every figure.
"""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
import xml.etree.ElementTree as ET

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from embgeom.inputs import InputError, input_format, read_input_texts
from embgeom.figures import FIGURES
from embgeom.testing.serve import REPO


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "embgeom.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def _parquet(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


# ------------------------------------------------------------------ formats
def test_the_format_comes_from_the_extension_unless_given():
    assert input_format("a.jsonl") == input_format("b.NDJSON") == "jsonl"
    assert input_format("c.csv") == "csv"
    assert input_format("d.parquet") == input_format("e.pq") == "parquet"
    assert input_format("f.txt") == input_format("g") == input_format("-") == "lines"
    assert input_format("h.txt", "csv") == "csv"
    with pytest.raises(ValueError):
        input_format("i.txt", "xml")


def test_jsonl_takes_the_field_and_skips_blank_lines_and_null_or_blank_values():
    data = ('{"text": "first", "id": 1}\n\n{"text": "multi\\nline"}\r\n'
            '{"text": null}\n{"text": "  "}\n{"other": 1, "text": "last"}\n').encode()
    assert read_input_texts(data, "jsonl") == ["first", "multi\nline", "last"]
    assert read_input_texts(b'{"body": "x", "text": "y"}', "jsonl", "body") == ["x"]
    for bad, where in ((b'{"text": "ok"}\n{"body": "x"}', "line 2 has no field 'text'"),
                       (b'{"text": 3}', "line 1: field 'text' is a int"),
                       (b'["text"]', "line 1 is not a JSON object"),
                       (b'{"text": "ok"}\n{oops', "line 2 is not JSON")):
        with pytest.raises(InputError, match=where):
            read_input_texts(bad, "jsonl")


def test_csv_reads_quoted_newlines_and_names_a_missing_column():
    data = '\ufeffid,text\n1,"one, with a comma"\n2,"two\nlines"\n3,\n4,"say ""hi"""\n'.encode()
    assert read_input_texts(data, "csv") == ["one, with a comma", "two\nlines", 'say "hi"']
    with pytest.raises(InputError, match="no column 'body'; columns: id, text"):
        read_input_texts(data, "csv", "body")
    assert read_input_texts(b"", "csv") == []


def test_parquet_reads_a_string_column():
    data = _parquet(pa.table({"text": ["a", None, " ", "b"], "n": [1, 2, 3, 4]}))
    assert read_input_texts(data, "parquet") == ["a", "b"]
    with pytest.raises(InputError, match="no column 'body'"):
        read_input_texts(data, "parquet", "body")
    with pytest.raises(InputError, match="column 'n' is int64, not strings"):
        read_input_texts(data, "parquet", "n")
    with pytest.raises(InputError, match="not a Parquet file"):
        read_input_texts(b"not parquet at all", "parquet")


# ------------------------------------------------------------------ integration
def _summary(stdout: str) -> dict:
    words = stdout.split()
    return {words[i].rstrip(":"): int(words[i + 1]) for i in range(0, 8, 2)}


def test_ingest_jsonl_csv_parquet_and_write_a_report(embedded_service, tmp_path):
    from transformers import AutoTokenizer

    from embgeom.corpora import bbc_texts
    from embgeom.sources import minilm_path

    url, _ = embedded_service
    texts = [p for p in bbc_texts("paragraphs") if 40 <= len(p) <= 200][300:330]
    texts[3] = texts[3] + "\n" + texts[4]  # records may hold newlines
    tokenizer = AutoTokenizer.from_pretrained(str(minilm_path()))
    expected = sum(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])

    (tmp_path / "corpus.jsonl").write_text(
        "".join(json.dumps({"id": i, "body": t}) + "\n" for i, t in enumerate(texts)), encoding="utf-8")
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(["id", "body"])
    writer.writerows(enumerate(texts))
    (tmp_path / "corpus.csv").write_text(buf.getvalue(), encoding="utf-8")
    (tmp_path / "corpus.parquet").write_bytes(_parquet(pa.table({"body": texts})))

    with httpx.Client(base_url=url, timeout=120) as client:
        for ext in ("jsonl", "csv", "parquet"):
            command = ["ingest", str(tmp_path / f"corpus.{ext}"), "--url", url, "--collection", f"f-{ext}",
                       "--field", "body", "--texts-per-job", "12", "--quiet"]
            run = _cli(*command)
            assert run.returncode == 0, run.stderr
            assert _summary(run.stdout) == {"jobs": 3, "texts": 30, "tokens": expected, "failed": 0}
            layers = client.get(f"/v1/collections/f-{ext}/models/minilm/layers").json()["layers"]
            assert [row["n"] for row in layers] == [expected] * 7
            if ext == "jsonl":  # a second run resumes: nothing is counted twice
                again = _cli(*command)
                assert again.returncode == 0, again.stderr
                assert _summary(again.stdout) == _summary(run.stdout)
                assert client.get(f"/v1/collections/f-{ext}/models/minilm/layers").json()["layers"] == layers
        tokens = {ext: client.get(f"/v1/collections/f-{ext}/models/minilm/layers/3/tokens",
                                  params={"limit": 10000}).json()["tokens"]
                  for ext in ("jsonl", "csv", "parquet")}
        # The same tokens, counts and (up to the float32 forward pass's batching) values.
        for ext in ("csv", "parquet"):
            assert [(t["token_id"], t["n"]) for t in tokens[ext]] == \
                [(t["token_id"], t["n"]) for t in tokens["jsonl"]]
            assert [t["Q"] for t in tokens[ext]] == pytest.approx([t["Q"] for t in tokens["jsonl"]], rel=1e-6)

    missing = _cli("ingest", str(tmp_path / "corpus.csv"), "--url", url, "--field", "text", "--quiet")
    assert missing.returncode == 2 and "no column 'text'; columns: id, body" in missing.stderr

    out = tmp_path / "report"
    run = _cli("report", "--url", url, "--collection", "f-jsonl", "--model", "minilm", "--out", str(out),
               "--format", "svg", "--min-count", "2")
    assert run.returncode == 0, run.stderr
    written = sorted(p.name for p in out.iterdir())
    # Every figure but cka: the collection was made without cross_layer (its figure is a 409).
    shown = [name for name in FIGURES if name != "cka"]
    assert written == sorted(["report.html", *(f"{name}.svg" for name in shown)])
    assert run.stdout.split() == [str(out / "report.html"), *(str(out / f"{n}.svg") for n in shown)]
    for name in shown:
        assert ET.parse(out / f"{name}.svg").getroot().tag == "{http://www.w3.org/2000/svg}svg"
    page = (out / "report.html").read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and page.count("<img data-figure=") == len(shown)
    assert page.count('src="data:image/svg+xml;base64,') == len(shown)

    refused = _cli("report", "--url", url, "--collection", "never-made", "--out", str(tmp_path / "x"))
    assert refused.returncode == 1 and "collection_not_found" in refused.stderr
