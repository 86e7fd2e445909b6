"""The client as a notebook uses it, against a real ``embgeom serve`` (embedded Redis and
worker, MiniLM): DataFrames equal to the JSON, figures that display, the async client,
errors with the service's type, message and detail.

Each answer of the client is compared with the same request sent by plain ``httpx``
(written out here, not built by the client), so a wrong path, parameter or body in the
client's description of a call fails.
"""

from __future__ import annotations

import asyncio
import io
import json
import math
import re
import struct
import xml.etree.ElementTree as ET
import zlib

import httpx
import numpy as np
import pandas as pd
import pytest
from PIL import Image

from embgeom import api_types
from embgeom.client import ApiError, AsyncEmbgeomClient, Call, Calls, EmbgeomClient, Figure, Report
from embgeom.tables import isotropy_rows
from service.openapi_export import PATH as OPENAPI_PATH, TYPES_PATH, api_types as render_api_types
from embgeom.testing.serve import ServiceProcess

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _same(got, want) -> bool:
    """A DataFrame cell equals its JSON value: a null is None or NaN (a column with numbers),
    numbers exactly (the frame holds the parsed JSON floats themselves; nothing is computed)."""
    if want is None:
        return got is None or (isinstance(got, float) and math.isnan(got))
    return got == want


def assert_frame_is_json(frame: pd.DataFrame, rows: list[dict]) -> None:
    assert isinstance(frame, pd.DataFrame)
    assert len(frame) == len(rows) > 0
    assert list(frame.columns) == list(rows[0])
    for i, row in enumerate(rows):
        for column, value in row.items():
            got = frame[column].iloc[i]
            assert _same(got.item() if isinstance(got, np.generic) else got, value), (i, column, got, value)


def png_size(data: bytes) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk, its CRC checked (the PNG specification)."""
    assert data[:8] == PNG_SIGNATURE
    length, kind = struct.unpack(">I4s", data[8:16])
    assert (length, kind) == (13, b"IHDR")
    chunk = data[12:16 + length]
    assert struct.unpack(">I", data[16 + length:20 + length])[0] == zlib.crc32(chunk)
    return struct.unpack(">II", data[16:24])


# ---------------------------------------------------------------- the contract
def test_api_types_are_generated_from_the_committed_openapi_document():
    doc = json.loads(OPENAPI_PATH.read_text())
    assert TYPES_PATH.read_text() == render_api_types(doc), "run `make openapi`"
    # Every JSON object a 2xx answer names has its TypedDict, with the schema's fields.
    for name in api_types.__all__:
        props = doc["components"]["schemas"][name]["properties"]
        assert list(getattr(api_types, name).__annotations__) == list(props)


def _operations(doc: dict) -> set[tuple[str, str]]:
    return {(method.upper(), path) for path, item in doc["paths"].items() for method in item}


def _template(call: Call, doc: dict) -> tuple[str, str]:
    """The documented operation a concrete request falls under."""
    matches = [(m, p) for m, p in _operations(doc) if m == call.method
               and re.fullmatch(re.sub(r"\{[^}]+\}", "[^/]+", p), call.path)]
    assert len(matches) == 1, (call, matches)
    return matches[0]


def test_every_documented_operation_has_a_client_method():
    doc = json.loads(OPENAPI_PATH.read_text())
    calls = Calls()
    space = "c:minilm:2"
    made = [
        calls.healthz(), calls.readyz(), calls.metrics(),
        calls.submit(["x"], "c"), calls.job("j"), calls.jobs(["j", "k"]),
        calls.models(), calls.collections(), calls.collection("c"),
        calls.create_collection("c", preset="paper"), calls.delete_collection("c"),
        calls.layers("c", "m"), calls.decomposition("c", "m", 1), calls.token("c", "m", 1, 7),
        next(calls.tokens("c", "m", 1)), calls.neighbors("c", "m", 1, 7),
        calls.isotropy("c", "m", 1), calls.isotropy_sample("c", "m", 1, ["x"]),
        calls.outliers("c", "m", 1), calls.model_outliers("c", "m"),
        calls.intrinsic_dimension("c", "m", 1), calls.similarity("c", "m"), calls.outlier_probe("m", 1, ["x", "y"], [0, 1]),
        calls.compare_global(space, ("c", "minilm", "input")), calls.compare_lle(space, space),
        calls.steering_transfer(space, space, vector=[1.0]),
        calls.figure("c", "m", "layer_summary"), calls.layer_figure("c", "m", 1),
        calls.compare_figure("global", space, space), calls.report("c", "m"),
        calls.export("c", "m", 1),
    ]
    assert all(isinstance(c, Call) for c in made)
    assert {_template(c, doc) for c in made} == _operations(doc)
    # Spaces in every form are the same body; None parameters are not sent.
    body = calls.compare_global("c:minilm:input", {"collection": "c", "model": "minilm", "layer": "input"}).json
    assert body == {"a": {"collection": "c", "model": "minilm", "layer": "input"},
                    "b": {"collection": "c", "model": "minilm", "layer": "input"}}
    assert calls.compare_figure("lle", ("c", "m", 3), "c:m:4").params == {"a": "c:m:3", "b": "c:m:4",
                                                                          "format": "png"}


# ------------------------------------------------------------------ the service
TEXTS_PER_JOB = 25


@pytest.fixture(scope="module")
def ingested(tmp_path_factory):
    """One ``embgeom serve`` (embedded Redis and worker) for this module's tests, with 50
    BBC paragraphs in collection "nb" (two jobs, counted)."""
    from embgeom.corpora import bbc_texts

    tmp = tmp_path_factory.mktemp("notebook")
    proc = ServiceProcess.serve(data_dir=tmp / "data", log_path=tmp / "serve.log").start()
    url = proc.url
    try:
        proc.wait_ready()
        texts = bbc_texts("paragraphs")[:2 * TEXTS_PER_JOB]
        with EmbgeomClient(url) as client:
            ids = [client.submit(texts[i:i + TEXTS_PER_JOB], "nb", "minilm")
                   for i in range(0, len(texts), TEXTS_PER_JOB)]
            final = client.wait(ids, timeout=300)
        assert [s["status"] for s in final] == ["done", "done"]
        yield url, texts
    finally:
        proc.terminate()


def test_notebook_session_frames_figures_and_errors(ingested):
    url, texts = ingested
    base = "/v1/collections/nb/models/minilm"
    with EmbgeomClient(url) as client, httpx.Client(base_url=url, timeout=120) as raw:
        # layers: the DataFrame is the JSON's rows, its other fields in attrs
        body = raw.get(f"{base}/layers", params={"min_count": 2}).json()
        frame = client.layers("nb", "minilm", min_count=2, as_frame=True)
        assert_frame_is_json(frame, body["layers"])
        assert frame.attrs == {k: v for k, v in body.items() if k != "layers"}
        assert client.layers("nb", "minilm", min_count=2) == body
        # The typed rows name exactly the fields the service answers.
        assert set(api_types.LayerRow.__annotations__) == set(body["layers"][0])
        assert set(api_types.LayersOut.__annotations__) == set(body)

        # tokens: every page, as one frame
        layer = 3
        listed = raw.get(f"{base}/layers/{layer}/tokens", params={"limit": 10000}).json()
        tokens = client.tokens("nb", "minilm", layer, page_size=100, as_frame=True)
        assert listed["next_cursor"] is None and len(listed["tokens"]) > 100  # several pages of 100
        assert_frame_is_json(tokens, listed["tokens"])
        assert tokens["n"].sum() == raw.get(f"{base}/layers").json()["layers"][layer]["n"]

        # the other tables
        outliers = raw.get(f"{base}/layers/{layer}/outliers", params={"threshold": 3}).json()
        assert_frame_is_json(client.outliers("nb", "minilm", layer, threshold=3, as_frame=True),
                             outliers["dimensions"])
        everywhere = raw.get(f"{base}/outliers", params={"threshold": 3}).json()
        assert client.model_outliers("nb", "minilm", threshold=3) == everywhere
        flat = client.model_outliers("nb", "minilm", threshold=3, as_frame=True)
        assert len(flat) == sum(len(l["dimensions"]) for l in everywhere["layers"])
        top = listed["tokens"][0]
        near = raw.get(f"{base}/layers/{layer}/tokens/{top['token_id']}/neighbors",
                       params={"k": 5, "min_count": 2}).json()
        assert_frame_is_json(client.neighbors("nb", "minilm", layer, top["token_id"], k=5, min_count=2,
                                              as_frame=True), near["neighbors"])
        dims = raw.get(f"{base}/layers/{layer}/intrinsic-dimension",
                       params={"method": "twonn", "min_count": 2, "limit": 3}).json()
        got = client.intrinsic_dimension("nb", "minilm", layer, method="twonn", min_count=2, limit=3)
        assert got == dims
        ends = client.intrinsic_dimension("nb", "minilm", layer, method="twonn", min_count=2, limit=3,
                                          as_frame=True)
        assert list(ends["end"]) == ["highest"] * len(dims["highest"]) + ["lowest"] * len(dims["lowest"])
        assert list(ends["token_id"]) == [t["token_id"] for t in dims["highest"] + dims["lowest"]]
        assert client.isotropy("nb", "minilm", layer, spectrum=True) == \
            raw.get(f"{base}/layers/{layer}/isotropy", params={"spectrum": "true"}).json()
        assert client.collection("nb") == raw.get("/v1/collections/nb").json()
        assert_frame_is_json(client.collections(as_frame=True), raw.get("/v1/collections").json())

        # comparisons between two layers of the collection (seeded: the same answer twice)
        pair = {"a": {"collection": "nb", "model": "minilm", "layer": 2},
                "b": {"collection": "nb", "model": "minilm", "layer": 4}, "min_count": 2}
        assert client.compare_global("nb:minilm:2", ("nb", "minilm", 4), min_count=2) == \
            raw.post("/v1/compare/global", json=pair).json()
        near5 = client.compare_global("nb:minilm:2", ("nb", "minilm", 4), min_count=2, k=5)
        assert near5 == raw.post("/v1/compare/global", json={**pair, "k": 5}).json() and near5["k"] == 5
        assert client.compare_lle("nb:minilm:2", "nb:minilm:4", min_count=2, k=5) == \
            raw.post("/v1/compare/lle", json={**pair, "k": 5}).json()
        vector = [1.0] + [0.0] * 383
        assert client.steering_transfer("nb:minilm:2", "nb:minilm:4", vector=vector, min_count=2) == \
            raw.post("/v1/steering/transfer", json={**pair, "vector": vector}).json()

        # layer-by-layer CKA: a cross_layer collection's matrix as a frame indexed by layer;
        # "nb" keeps no cross-layer moments (409 with the service's type)
        made = client.create_collection("nb-cka", cross_layer=True)
        assert made["settings"]["cross_layer"] is True and made["created"] is True
        client.wait([client.submit(texts[:5], "nb-cka", "minilm")], timeout=300)
        sim = raw.get("/v1/collections/nb-cka/models/minilm/similarity").json()
        assert client.similarity("nb-cka", "minilm") == sim and sim["n"] > 0
        square = client.similarity("nb-cka", "minilm", metric="rv", as_frame=True)
        assert list(square.index) == list(square.columns) == sim["layers"] == list(range(7))
        assert square.index.name == "layer" and square.attrs["metric"] == "rv"
        assert square.to_numpy().tolist() == sim["matrix"]  # rv is linear CKA, the same numbers
        assert square.attrs["n"] == sim["n"] and square.attrs["as_of"] == sim["as_of"]
        with pytest.raises(ApiError) as refused:
            client.similarity("nb", "minilm")
        assert (refused.value.status, refused.value.type) == (409, "cross_layer_not_kept")

        # figures display inline: a PNG that decodes, an SVG that parses
        figure = client.figure("nb", "minilm", "layer_summary")
        png = figure._repr_png_()
        assert isinstance(figure, Figure) and figure._repr_svg_() is None
        width, height = png_size(png)
        with Image.open(io.BytesIO(png)) as image:
            image.load()  # decodes every pixel: a truncated or corrupt stream raises
            assert image.format == "PNG" and image.size == (width, height) and width > 100 and height > 100
        svg = client.layer_figure("nb", "minilm", layer, fmt="svg", method="twonn", min_count=2)
        assert svg._repr_png_() is None
        assert ET.fromstring(svg._repr_svg_()).tag == "{http://www.w3.org/2000/svg}svg"
        compared = client.compare_figure("global", "nb:minilm:2", "nb:minilm:4", min_count=2)
        assert png_size(compared._repr_png_())[0] > 100
        report = client.report("nb", "minilm")
        assert isinstance(report, Report) and report.html.startswith("<!DOCTYPE html>")
        assert report.layer == int(raw.get(f"{base}/report").headers["x-embgeom-layer"])
        assert report._repr_html_().startswith("<iframe srcdoc=\"&lt;!DOCTYPE html&gt;")

        # an export read back as a frame is the token listing's counts
        export = client.export("nb", "minilm", layer, as_frame=True)
        assert dict(zip(export["token_id"], export["n"])) == {t["token_id"]: t["n"] for t in listed["tokens"]}

        # `embgeom table --kind isotropy`: each layer's isotropy and outlier dimensions
        rows = isotropy_rows(client, "nb", "minilm", threshold=3, min_count=2)
        assert [r["layer"] for r in rows] == [r["layer"] for r in body["layers"]]
        for row in rows:
            iso = raw.get(f"{base}/layers/{row['layer']}/isotropy", params={"min_count": 2}).json()
            out = raw.get(f"{base}/layers/{row['layer']}/outliers", params={"threshold": 3, "top": 3}).json()
            assert (row["isoscore"], row["mean_cosine"]) == (iso["isoscore"], iso["mean_cosine"])
            assert row["outliers"].split()[:5] == [f"{d['dim']}({d['ratio']:.1f})" for d in out["dimensions"]][:5] \
                or (row["outliers"] == "-" and not out["dimensions"])

        # errors: the service's type, message and detail, for a 404 and a 422
        errors = []
        for path, params, call in (
                ("/v1/collections/missing/models/minilm/layers", {}, lambda: client.layers("missing", "minilm")),
                (f"{base}/layers/{layer}/tokens", {"order_by": "size"},
                 lambda: client.tokens("nb", "minilm", layer, order_by="size")),
                (f"{base}/layers/{layer}/outliers", {"transform": "abtt:x"},
                 lambda: client.outliers("nb", "minilm", layer, transform="abtt:x"))):
            answer = raw.get(path, params=params)
            with pytest.raises(ApiError) as err:
                call()
            want = answer.json()
            assert (err.value.status, err.value.type, err.value.message, err.value.detail) == \
                (answer.status_code, want["type"], want["message"], want["detail"])
            errors.append(err.value)
        assert [(e.status, e.type) for e in errors[:2]] == [(404, "collection_not_found"), (422, "validation_error")]
        assert errors[1].detail["errors"][0]["loc"] == ["query", "order_by"] and errors[2].status == 422


def test_async_client_answers_as_the_blocking_one(ingested):
    url, texts = ingested

    async def session():
        async with AsyncEmbgeomClient(url) as client:
            # concurrent requests on one client
            layers, frame, tokens, models = await asyncio.gather(
                client.layers("nb", "minilm"), client.layers("nb", "minilm", as_frame=True),
                client.tokens("nb", "minilm", 2, page_size=50), client.models())
            job = await client.submit(texts[:3], "nb-async", "minilm")
            final = await client.wait([job], timeout=120, poll_interval=0.1)
            figure = await client.figure("nb", "minilm", "decomposition")
            with pytest.raises(ApiError) as err:
                await client.collection("never-made")
            return layers, frame, tokens, models, final, figure, err.value

    layers, frame, tokens, models, final, figure, error = asyncio.run(session())
    with EmbgeomClient(url) as client:
        assert layers == client.layers("nb", "minilm")
        assert_frame_is_json(frame, layers["layers"])
        assert tokens == client.tokens("nb", "minilm", 2, page_size=1000)
        assert len(tokens) > 50  # more than one page was followed
        assert models == client.models()
        assert [s["status"] for s in final] == ["done"]
        assert client.layers("nb-async", "minilm")["layers"][0]["n"] == final[0]["tokens"]
    assert png_size(figure)[0] > 100
    want = httpx.get(f"{url}/v1/collections/never-made").json()
    assert (error.status, error.type, error.message, error.detail) == \
        (404, "collection_not_found", want["message"], want["detail"])


def test_async_client_retries_429_and_streams_an_export_into_a_file(tmp_path):
    """The async transport keeps the blocking one's 429 policy and streaming (MockTransport)."""
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if len(seen) == 1:
            return httpx.Response(429, headers={"Retry-After": "1.5"},
                                  json={"type": "overloaded", "message": "full", "detail": {}})
        return httpx.Response(200, content=b"parquet bytes" * 1000)

    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    async def session():
        async with AsyncEmbgeomClient("http://embgeom.test", transport=httpx.MockTransport(handler),
                                      sleep=sleep) as client:
            with open(tmp_path / "x.parquet", "wb") as out:
                return await client.export("c", "m", 2, out, means=True)

    written = asyncio.run(session())
    assert written == len(b"parquet bytes" * 1000) == (tmp_path / "x.parquet").stat().st_size
    assert slept == [1.5] and len(seen) == 2
    assert seen[1].url.path == "/v1/collections/c/models/m/layers/2/export"
    assert dict(seen[1].url.params) == {"format": "parquet", "means": "true", "min_count": "1"}
