"""Job submission semantics: idempotency keys, batch status, pair existence."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from tests.conftest import WorkerThread, test_settings, wait_for_jobs

TEXTS = ["The committee approved the budget on Tuesday.", "Shares fell sharply after the report."]


@pytest.fixture
def api(redis_server):
    settings = test_settings(redis_server.url)
    with WorkerThread(settings), TestClient(create_app(settings)) as client:
        yield client


def _n(api, collection):
    return api.get(f"/v1/collections/{collection}/models/minilm/layers/0/decomposition").json()["n"]


def test_idempotency_key_replays_the_first_job(api):
    body = {"collection": "idem", "texts": TEXTS}
    first = api.post("/v1/jobs", json=body, headers={"Idempotency-Key": "k1"})
    second = api.post("/v1/jobs", json=body, headers={"Idempotency-Key": "k1"})
    assert first.status_code == second.status_code == 202
    assert first.json()["job_id"] == second.json()["job_id"]
    assert first.json()["created"] is True and second.json()["created"] is False
    wait_for_jobs(api, [first.json()["job_id"]])
    n = _n(api, "idem")
    third = api.post("/v1/jobs", json=body, headers={"Idempotency-Key": "k1"})
    assert third.json()["job_id"] == first.json()["job_id"]
    assert _n(api, "idem") == n > 0


def test_idempotency_key_with_another_request_is_refused(api):
    api.post("/v1/jobs", json={"collection": "idem2", "texts": TEXTS}, headers={"Idempotency-Key": "k2"})
    r = api.post("/v1/jobs", json={"collection": "idem2", "texts": TEXTS[:1]}, headers={"Idempotency-Key": "k2"})
    assert r.status_code == 422 and r.json()["type"] == "idempotency_key_reused"


def test_idempotency_key_after_delete_counts_again(api):
    body = {"collection": "idem3", "texts": TEXTS}
    job = api.post("/v1/jobs", json=body, headers={"Idempotency-Key": "k3"}).json()["job_id"]
    wait_for_jobs(api, [job])
    n = _n(api, "idem3")
    assert api.delete("/v1/collections/idem3").status_code == 200
    again = api.post("/v1/jobs", json=body, headers={"Idempotency-Key": "k3"}).json()
    assert again["created"] is True and again["job_id"] != job
    assert wait_for_jobs(api, [again["job_id"]])[0]["status"] == "done"
    assert _n(api, "idem3") == n


def test_batch_status_in_order(api):
    ids = [api.post("/v1/jobs", json={"collection": "batch", "texts": [t]}).json()["job_id"] for t in TEXTS]
    wait_for_jobs(api, ids)
    got = api.get("/v1/jobs", params={"ids": ",".join(reversed(ids))}).json()
    assert [g["job_id"] for g in got] == list(reversed(ids))
    assert all(g["status"] == "done" for g in got)
    assert api.get("/v1/jobs", params={"ids": "nope"}).json()["type"] == "job_not_found"


def test_model_never_sent_to_collection_is_404(api):
    job = api.post("/v1/jobs", json={"collection": "pairs", "texts": TEXTS}).json()["job_id"]
    wait_for_jobs(api, [job])
    r = api.get("/v1/collections/pairs/models/mpnet/layers/0/decomposition")
    assert r.status_code == 404 and r.json()["type"] == "model_not_in_collection"
    r = api.get("/v1/collections/nothere/models/minilm/layers/0/decomposition")
    assert r.status_code == 404 and r.json()["type"] == "collection_not_found"
