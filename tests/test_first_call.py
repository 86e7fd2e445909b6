"""A first call just works: every endpoint that runs a model in the API process (the
isotropy sample, the outlier probe, an ``input`` space of a comparison or its figure,
steering texts) answers 200 on a fresh app, the model loaded on that first use while the
request waits (``model_load_wait_seconds``), not a 503 to retry.

One real ``redis-server`` and a worker (in a thread) ingest BBC paragraphs with the
packaged MiniLM once; each endpoint then gets an app of its own, fresh, whose model pool
has loaded nothing.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from embgeom.corpora import bbc_texts
from embgeom.store.server import RedisServer
from service.app import create_app
from tests.conftest import WorkerThread, wait_for_jobs
from tests.conftest import test_settings as settings_for

PARAS = [p for p in bbc_texts("paragraphs") if 60 <= len(p) <= 200][:80]
LAYER = {"collection": "fc", "model": "minilm", "layer": 2}
INPUT = {"collection": "fc", "model": "minilm", "layer": "input"}
SPORT = ["The striker scored twice in the second half.", "The club won the league title."]
MONEY = ["Shares fell after the bank reported losses.", "The firm raised its profit forecast."]

FIRST_CALLS = {
    "isotropy_sample": ("POST", "/v1/collections/fc/models/minilm/layers/2/isotropy/sample",
                        {"json": {"texts": SPORT + MONEY, "reference": "identity"}}),
    "outlier_probe": ("POST", "/v1/probes/outlier-dimension",
                      {"json": {"model": "minilm", "layer": 1, "texts": SPORT + MONEY,
                                "labels": [1, 1, 0, 0], "test_fraction": 0.5}}),
    "compare_global_input": ("POST", "/v1/compare/global",
                             {"json": {"a": LAYER, "b": INPUT, "min_count": 2}}),
    "compare_lle_input": ("POST", "/v1/compare/lle",
                          {"json": {"a": LAYER, "b": INPUT, "min_count": 2, "k": 5}}),
    "compare_figure_input": ("GET", "/v1/compare/figures/global",
                             {"params": {"a": "fc:minilm:2", "b": "fc:minilm:input", "min_count": 2}}),
    "steering_texts": ("POST", "/v1/steering/transfer",
                       {"json": {"a": LAYER, "b": {**LAYER, "layer": 4}, "min_count": 2,
                                 "positive_texts": SPORT, "negative_texts": MONEY}}),
}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A Redis whose collection ``fc`` holds MiniLM over PARAS."""
    server = RedisServer(tmp_path_factory.mktemp("first-call") / "redis").start()
    settings = settings_for(server.url)
    try:
        with WorkerThread(settings), TestClient(create_app(settings)) as client:
            r = client.post("/v1/jobs", json={"collection": "fc", "model": "minilm", "texts": PARAS})
            assert r.status_code == 202, r.text
            assert [s["status"] for s in wait_for_jobs(client, [r.json()["job_id"]], timeout=600)] == ["done"]
        yield settings
    finally:
        server.kill()


@pytest.mark.parametrize("endpoint", list(FIRST_CALLS))
def test_the_first_call_of_a_model_running_endpoint_answers_200(store, endpoint):
    method, url, kwargs = FIRST_CALLS[endpoint]
    with TestClient(create_app(store)) as client:
        rt = client.app.state.runtime
        assert rt._sync_pool is None or rt.sync_pool.loaded() == []  # a fresh app
        r = client.request(method, url, **kwargs)
        assert r.status_code == 200, (endpoint, r.status_code, r.text[:300])
        assert rt.sync_pool.loaded() == ["minilm"]  # loaded by that first call
        assert rt.sync_models.loading() == []
