"""Figures and the report page over HTTP (``/figures/{name}``, ``/report``).

A real Redis on a free port, a real worker (on a thread) running the packaged MiniLM on
BBC paragraphs, and the real app in this process. Every figure comes back as a valid PNG
(signature, decodes to its documented size) or SVG (parses, ``<svg>`` root); bad
requests are 4xx with a stable type; a second request is served from the render cache,
and a new checkpoint makes the next one draw again.
"""

from __future__ import annotations

import io
import os
import re
import signal
import threading
import time
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
    # Every request waits for the current drawing (no stale answers) in this module's app,
    # so each cache header is decided; the stale answer has its own test below.
    api_settings = settings_for(server.url, checkpoint_seconds=0.2, render_max_stale_seconds=0)
    try:
        with WorkerThread(settings), TestClient(create_app(api_settings)) as client:
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


# ------------------------------------------------------------------ drawn off the API

def renderer_of(client: TestClient) -> renders.Renderer:
    return client.app.state.runtime.renderer


def test_a_second_request_of_the_same_version_draws_nothing(service):
    """A hit is answered from the cache: the renderer runs no job for it, for a figure
    or a page; a new checkpoint (a new version) runs one again."""
    client, _ = service
    renderer = renderer_of(client)
    url, query = figure_url("outliers", "png")
    client.get(url, params=query)
    client.get(f"{BASE}/report", params={"format": "svg"})
    drawn = renderer.drawn
    assert client.get(url, params=query).headers["x-embgeom-cache"] == "hit"
    assert client.get(f"{BASE}/report", params={"format": "svg"}).headers["x-embgeom-cache"] == "hit"
    assert renderer.drawn == drawn
    post(client, "figs", TEXTS[80:84])
    assert client.get(url, params=query).headers["x-embgeom-cache"] == "miss"
    assert renderer.drawn == drawn + 1


def test_while_the_collection_changes_the_newest_drawn_page_is_answered_at_once(service):
    """render_wait_seconds=0: a page of a version not drawn yet is answered with the newest
    drawn (stale, with that drawing's version), the current one is drawn in the background
    and answers the next request; ``fresh=true`` waits for the current one."""
    client, url = service
    params = {"format": "svg", "min_count": 2}
    with TestClient(create_app(settings_for(url, render_wait_seconds=0))) as app:
        def page(**extra):
            r = app.get(f"{BASE}/report", params={**params, **extra})
            assert r.status_code == 200, r.text
            return r.headers["x-embgeom-cache"], int(r.headers["x-embgeom-version"]), r.content

        cache, v1, first = page()
        assert cache == "miss"  # nothing drawn before: it waits
        post(client, "figs", TEXTS[88:92])
        cache, version, content = page()
        assert (cache, version, content) == ("stale", v1, first)
        deadline = time.monotonic() + 120
        while (answer := page())[0] == "stale":
            assert time.monotonic() < deadline, "the background drawing never arrived"
            time.sleep(0.2)
        cache, v2, second = answer
        assert cache == "hit" and v2 > v1 and second != first
        post(client, "figs", TEXTS[92:96])
        cache, v3, _ = page(fresh="true")
        assert cache == "miss" and v3 > v2


def test_concurrent_identical_requests_are_drawn_once(service):
    """Eight clients asking at once for a page no one has drawn: one job, eight equal
    answers (the others waited for it, single flight)."""
    client, _ = service
    renderer = renderer_of(client)
    drawn, shared = renderer.drawn, renderer.flights.shared
    params = {"format": "svg", "min_count": 3}
    barrier = threading.Barrier(8)
    answers = [None] * 8

    def ask(i):
        barrier.wait()
        answers[i] = client.get(f"{BASE}/report", params=params)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(a.status_code == 200 for a in answers)
    assert len({a.content for a in answers}) == 1
    assert renderer.drawn == drawn + 1
    assert renderer.flights.shared - shared + [a.headers["x-embgeom-cache"] for a in answers].count("hit") == 7


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds a process has used (``/proc/<pid>/stat``)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_figures_are_drawn_in_child_processes_and_the_api_stays_free(service):
    """A cold page is drawn in a render process: those processes spend more CPU on it
    than the API process (which also answers /healthz every 20 ms meanwhile, at once)."""
    client, _ = service
    pool = renderer_of(client).pool
    client.get(f"{BASE}/figures/isotropy")  # the render processes started
    post(client, "figs", TEXTS[84:88])  # nothing drawn for this version
    answer, pauses = {}, []

    def page():
        answer["r"] = client.get(f"{BASE}/report", params={"format": "png"})

    pids = pool.pids()
    assert pids and os.getpid() not in pids
    api, children = cpu_seconds(os.getpid()), sum(cpu_seconds(p) for p in pids)
    thread = threading.Thread(target=page)
    thread.start()
    while thread.is_alive():
        t = time.perf_counter()
        assert client.get("/healthz").status_code == 200
        pauses.append(time.perf_counter() - t)
        time.sleep(0.02)
    api, children = cpu_seconds(os.getpid()) - api, sum(cpu_seconds(p) for p in pids) - children
    assert answer["r"].status_code == 200 and answer["r"].headers["x-embgeom-cache"] == "miss"
    assert len(pauses) >= 5, "the page was drawn too fast to watch /healthz meanwhile"
    assert max(pauses) < 0.5, max(pauses)
    assert children > api, f"drawing: {children:.2f} s of CPU in the render processes, {api:.2f} s in the API"


def test_a_render_process_that_dies_is_replaced(service):
    """SIGKILL of every render process (the OOM killer): the next request is drawn by a
    new pool, 200, never a 500."""
    client, _ = service
    pool = renderer_of(client).pool
    client.get(f"{BASE}/figures/isotropy")
    for pid in pool.pids():
        os.kill(pid, signal.SIGKILL)
    time.sleep(0.5)
    check_image(client.get(f"{BASE}/figures/decomposition", params={"min_count": 5}), "png", "decomposition")
    assert pool.pids()


def test_errors_raised_while_drawing_keep_their_json_shape(service):
    """cka of a collection without cross_layer fails in the render process: the same 409
    as the JSON endpoint, with its detail."""
    client, _ = service
    post(client, "figs-plain", TEXTS[:4])
    r = client.get("/v1/collections/figs-plain/models/minilm/figures/cka")
    error(r, 409, "cross_layer_not_kept")
    assert r.json()["detail"] == client.get(
        "/v1/collections/figs-plain/models/minilm/similarity", params={"metric": "linear_cka"}).json()["detail"]


def test_the_render_cache_stays_within_its_byte_bound(service):
    """An API whose cache holds 1 MiB: after every page and figure, the cache's bytes are
    within it, and it holds something (the bound evicts, it does not disable)."""
    _, url = service
    with TestClient(create_app(settings_for(url, render_cache_mb=1))) as small:
        cache = renderer_of(small).cache
        for fmt in ("svg", "png"):
            for name in figures.FIGURES:
                u, q = figure_url(name, fmt)
                assert small.get(u, params=q).status_code == 200
                assert 0 < cache.size <= 1 << 20, cache.size
            assert small.get(f"{BASE}/report", params={"format": fmt}).status_code == 200
            assert 0 < cache.size <= 1 << 20, cache.size


def test_errors_survive_the_trip_from_a_child_process():
    """Errors pickle with their type, message and detail (they come back from a render
    process through a pipe)."""
    import pickle

    from embgeom.errors import Conflict, InvalidInput, NotFound

    for e in (NotFound("layer_not_kept", "m", layer=3), InvalidInput("m", type="invalid_format", format="x"),
              Conflict("cross_layer_not_kept", "m", collection="c")):
        back = pickle.loads(pickle.dumps(e))
        assert (type(back), back.type, back.message, back.detail) == (type(e), e.type, e.message, e.detail)
