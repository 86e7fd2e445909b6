"""Figures and the report page over HTTP (``/figures/{name}``, ``/report``).

A real Redis on a free port, a real worker (on a thread) running the packaged MiniLM on
BBC paragraphs, and the real app in this process. Every figure comes back as a valid PNG
(signature, decodes to its documented size) or SVG (parses, ``<svg>`` root); bad
requests are 4xx with a stable type; a second request is served from the render cache,
and a new checkpoint makes the next one draw again.
"""

from __future__ import annotations

import io
import re
import xml.etree.ElementTree as ET
from typing import Iterator

import pytest
from fastapi.testclient import TestClient
from matplotlib.image import imread

from embgeom import figures, renders, reports
from embgeom.corpora import bbc_texts
from embgeom.store.keys import PairKeys
from embgeom.store.reader import Reader, run_sync
from embgeom.store.server import RedisServer
from embgeom.worker import redis_client
from service.app import create_app
from tests.conftest import WorkerThread, wait_for_jobs
from tests.conftest import test_settings as settings_for

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SVG_ROOT = "{http://www.w3.org/2000/svg}svg"
BASE = "/v1/collections/figs/models/minilm"
LAYER = 3
TEXTS = [p for p in bbc_texts("paragraphs") if 40 <= len(p) <= 200]


def post(client: TestClient, collection: str, texts: list[str]) -> dict:
    r = client.post("/v1/jobs", json={"collection": collection, "model": "minilm", "texts": texts})
    assert r.status_code == 202, r.text
    (status,) = wait_for_jobs(client, [r.json()["job_id"]], timeout=300)
    assert status["status"] == "done", status
    return status


@pytest.fixture(scope="module")
def service(tmp_path_factory) -> Iterator[tuple[TestClient, str]]:
    tmp = tmp_path_factory.mktemp("figures-api")
    server = RedisServer(tmp / "redis").start()
    settings = settings_for(server.url, checkpoint_seconds=0.2)
    try:
        with WorkerThread(settings), TestClient(create_app(settings)) as client:
            # cross_layer: the page's CKA section and the cka figure have data (figs-sub has not)
            r = client.put("/v1/collections/figs", json={"cross_layer": True})
            assert r.status_code == 201, r.text
            post(client, "figs", TEXTS[:60])
            yield client, server.url
    finally:
        server.kill()


def check_image(response, fmt: str, name: str) -> None:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == renders.MEDIA_TYPES[fmt]
    body = response.content
    if fmt == "png":
        assert body.startswith(PNG_SIGNATURE)
        pixels = imread(io.BytesIO(body), format="png")
        width, height = figures.SIZES[name]
        assert pixels.shape[:2] == (round(height * figures.DPI), round(width * figures.DPI))
    else:
        root = ET.fromstring(body)
        assert root.tag == SVG_ROOT
        assert len(root) > 0


def figure_url(name: str, fmt: str, **params) -> tuple[str, dict]:
    query = {"format": fmt, **params}
    if name in renders.LAYER_FIGURES:
        query.setdefault("layer", LAYER)
    return f"{BASE}/figures/{name}", query


@pytest.mark.parametrize("fmt", ["png", "svg"])
def test_every_figure_is_a_valid_image(service, fmt):
    client, _ = service
    for name in figures.FIGURES:
        url, query = figure_url(name, fmt)
        check_image(client.get(url, params=query), fmt, name)


def test_figures_draw_the_numbers_of_the_json_endpoints(service):
    """The snapshot behind vm_scatter and frequency holds the /tokens values and the
    /layers regression of the same layer and filter; layer_summary, decomposition and
    within_ratio hold the /layers rows."""
    client, url = service
    f = reports.CountFilter(2)
    snap = run_sync(redis_client(url), renders._snapshot(Reader(), PairKeys("figs", "minilm"),
                                                         {"tokens", "rows"}, f, LAYER))
    row = client.get(f"{BASE}/layers", params={"min_count": 2}).json()["layers"][LAYER]
    assert {k: snap["tokens"]["summary"][k] for k in ("slope", "r2", "cv_Q")} == \
        {k: row[k] for k in ("slope", "r2", "cv_Q")}
    page = client.get(f"{BASE}/layers/{LAYER}/tokens", params={"min_count": 2, "limit": 10000}).json()
    by_id = {t["token_id"]: t for t in page["tokens"]}
    assert len(by_id) == len(snap["tokens"]["n"]) == row["num_types"]
    got = sorted(zip(snap["tokens"]["n"].tolist(), snap["tokens"]["Q"].tolist(),
                     snap["tokens"]["M"].tolist(), snap["tokens"]["V"].tolist()))
    assert got == sorted((t["n"], t["Q"], t["M"], t["V"]) for t in by_id.values())
    layers = client.get(f"{BASE}/layers", params={"min_count": 2}).json()["layers"]
    assert [{k: r[k] for k in ("layer", "Q", "M", "V_W", "V_B", "cv_Q", "slope", "r2")} for r in snap["rows"]] \
        == [{k: r[k] for k in ("layer", "Q", "M", "V_W", "V_B", "cv_Q", "slope", "r2")} for r in layers]


def error(response, status: int, type_: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == type_, body
    assert set(body) == {"type", "message", "detail"}


def test_bad_requests_are_4xx_with_a_stable_type(service):
    client, _ = service
    fig = f"{BASE}/figures"
    error(client.get(f"{fig}/pie_chart"), 404, "unknown_figure")
    error(client.get(f"{fig}/isotropy", params={"format": "gif"}), 422, "invalid_format")
    error(client.get(f"{BASE}/report", params={"format": "jpeg"}), 422, "invalid_format")
    for name in renders.LAYER_FIGURES:
        error(client.get(f"{fig}/{name}"), 422, "layer_required")
    error(client.get(f"{fig}/vm_scatter", params={"layer": 99}), 404, "layer_not_found")
    error(client.get(f"{fig}/spectrum", params={"layer": -1}), 404, "layer_not_found")
    error(client.get(f"{fig}/vm_scatter", params={"layer": "three"}), 422, "validation_error")
    error(client.get(f"{BASE}/report", params={"layer": 7}), 404, "layer_not_found")
    error(client.get(f"{fig}/decomposition", params={"min_count": 0}), 422, "validation_error")
    error(client.get(f"{fig}/decomposition", params={"min_count": 5, "max_count": 2}), 422,
          "invalid_filter")
    error(client.get(f"{BASE}/report", params={"min_count": 5, "max_count": 2}), 422, "invalid_filter")
    error(client.get(f"{fig}/layer_summary", params={"models": "minilm,,"}), 422, "invalid_models")
    error(client.get(f"{fig}/layer_summary", params={"models": "minilm,no-such-model"}), 404,
          "unknown_model")
    error(client.get(f"{fig}/layer_summary", params={"models": "minilm,mpnet"}), 404,
          "model_not_in_collection")
    error(client.get("/v1/collections/nowhere/models/minilm/figures/isotropy"), 404,
          "collection_not_found")
    error(client.get("/v1/collections/nowhere/models/minilm/report"), 404, "collection_not_found")
    error(client.get("/v1/collections/figs/models/no-such-model/figures/isotropy"), 404, "unknown_model")
    error(client.get("/v1/collections/figs/models/mpnet/figures/isotropy"), 404, "model_not_in_collection")
    error(client.get("/v1/collections/bad name!/models/minilm/figures/isotropy"), 422,
          "invalid_collection_name")


def test_a_layer_the_collection_does_not_keep_is_404(service):
    client, _ = service
    r = client.put("/v1/collections/figs-sub", json={"key": "id", "unit": "token", "include_special": False,
                                                     "layers": [0, 3], "self_similarity": False})
    assert r.status_code in (200, 201), r.text
    post(client, "figs-sub", TEXTS[60:64])
    base = "/v1/collections/figs-sub/models/minilm"
    error(client.get(f"{base}/figures/vm_scatter", params={"layer": 2}), 404, "layer_not_kept")
    error(client.get(f"{base}/report", params={"layer": 2}), 404, "layer_not_kept")
    check_image(client.get(f"{base}/figures/spectrum", params={"layer": 3}), "png", "spectrum")
    page = client.get(f"{base}/report")
    assert page.status_code == 200 and page.headers["x-embgeom-layer"] == "3"  # the middle kept layer
    # Without cross_layer: the cka figure is the JSON endpoint's 409, and the page has no CKA
    # section, no cka image and no link that would answer 409.
    error(client.get(f"{base}/figures/cka"), 409, "cross_layer_not_kept")
    error(client.get(f"{base}/similarity"), 409, "cross_layer_not_kept")
    assert b'data-figure="cka"' not in page.content and b'id="cka-section"' not in page.content
    assert b"/similarity" not in page.content and b"/figures/cka" not in page.content
    assert page.content.count(b"<img data-figure=") == len(figures.FIGURES) - 1


def test_the_report_page_has_a_cka_section_with_the_json_matrix(service):
    """A cross_layer collection's page: the heatmap and the matrix of .../similarity, exactly
    (each cell's data-value is the JSON number's repr)."""
    client, _ = service
    sim = client.get(f"{BASE}/similarity").json()
    page = client.get(f"{BASE}/report").text
    section = page[page.index('id="cka-section"'):page.index('id="links-section"')]
    assert 'data-figure="cka"' in section and 'src="data:image/png;base64,' in section
    assert f'data-field="cka_n"><span data-value="{sim["n"]}">' in section and sim["n"] > 0
    cells = [float(v) for v in re.findall(r'data-column="\d+" data-value="([^"]*)"', section)]
    assert cells == [v for row in sim["matrix"] for v in row] and len(cells) == len(sim["layers"]) ** 2 == 49
    assert page.count('data-figure="cka"') == 1  # in its section, not again among the figures
    assert f"{BASE}/similarity?metric=linear_cka" in page and f"{BASE}/figures/cka?format=svg" in page


def test_a_second_request_is_a_cache_hit_and_a_checkpoint_draws_again(service):
    client, _ = service
    url, query = figure_url("vm_scatter", "png", min_count=1)
    first = client.get(url, params=query)
    second = client.get(url, params=query)
    assert first.status_code == second.status_code == 200
    assert second.headers["x-embgeom-cache"] == "hit"
    assert second.content == first.content
    assert second.headers["x-embgeom-version"] == first.headers["x-embgeom-version"]
    # A parameter the figure does not use shares the entry; one it uses does not.
    client.get(f"{BASE}/figures/isotropy")
    for layer in (1, 2):
        assert client.get(f"{BASE}/figures/isotropy", params={"layer": layer}).headers["x-embgeom-cache"] == "hit"
    assert client.get(url, params={**query, "min_count": 2}).headers["x-embgeom-cache"] == "miss"
    report = client.get(f"{BASE}/report")
    assert report.status_code == 200 and report.headers["content-type"].startswith("text/html")
    assert report.content.count(b"<img data-figure=") == len(figures.FIGURES)
    assert client.get(f"{BASE}/report").headers["x-embgeom-cache"] == "hit"

    post(client, "figs", TEXTS[64:80])  # a new checkpoint
    third = client.get(url, params=query)
    assert third.headers["x-embgeom-cache"] == "miss"
    assert int(third.headers["x-embgeom-version"]) > int(first.headers["x-embgeom-version"])
    assert third.content != first.content
    assert client.get(url, params=query).headers["x-embgeom-cache"] == "hit"
    assert client.get(f"{BASE}/report").headers["x-embgeom-cache"] == "miss"


def test_render_cache_is_a_byte_bounded_lru_that_drops_older_versions():
    cache = renders.RenderCache(100)
    scope = ("c", ("m",))
    cache.put((scope, ((0, 1),), "a"), ("A",), 40)
    cache.put((scope, ((0, 1),), "b"), ("B",), 40)
    assert cache.get((scope, ((0, 1),), "a")) == ("A",)
    cache.put((scope, ((0, 1),), "c"), ("C",), 40)  # evicts b, the least recently used
    assert cache.get((scope, ((0, 1),), "b")) is None and len(cache) == 2 and cache.size == 80
    cache.put((scope, ((0, 2),), "a"), ("A2",), 10)  # a new version: the old entries go
    assert len(cache) == 1 and cache.size == 10
    cache.put((("c", ("other",)), ((0, 1),), "a"), ("X",), 500)  # larger than the bound
    assert len(cache) == 1
    off = renders.RenderCache(0)
    off.put((scope, ((0, 1),), "a"), ("A",), 1)
    assert off.get((scope, ((0, 1),), "a")) is None
