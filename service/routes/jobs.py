from __future__ import annotations

from typing import Annotated, Optional

from fastapi import APIRouter, Header, Query

from embgeom.errors import InvalidInput
from embgeom.store.jobs import JobRequest
from service.deps import RuntimeDep
from service.schemas import ErrorBody, JobCreate, JobCreated, JobStatus, documented

router = APIRouter(prefix="/v1", tags=["jobs"])


@router.post("/jobs", status_code=202, response_model=JobCreated,
             responses={404: {"model": ErrorBody}, 409: {"model": ErrorBody},
                        413: {"model": ErrorBody}, 422: {"model": ErrorBody},
                        429: {"model": ErrorBody}})
def create_job(
    body: JobCreate,
    rt: RuntimeDep,
    idempotency_key: Annotated[Optional[str], Header(max_length=200)] = None,
) -> dict:
    """Queue texts for ingestion into a collection. The same ``Idempotency-Key`` returns
    the first job and is counted once. A collection that does not exist yet is created with
    the default settings (and the job's ``include_special`` when it gives one)."""
    rt.registry.source(body.model)  # unknown alias -> 404 unknown_model
    limits = rt.settings
    if len(body.texts) > limits.max_job_texts:
        raise InvalidInput(f"{len(body.texts)} texts exceed the limit of {limits.max_job_texts} per job",
                           type="payload_too_large", limit=limits.max_job_texts)
    size = sum(len(t.encode()) for t in body.texts)
    if size > limits.max_job_bytes:
        raise InvalidInput(f"{size} bytes of text exceed the limit of {limits.max_job_bytes} per job",
                           type="payload_too_large", limit=limits.max_job_bytes)
    rt.collections.ensure(body.collection, body.include_special)
    job_id, created = rt.queue.submit(JobRequest(body.collection, body.model, body.texts),
                                      rt.registry.names(), idempotency_key)
    return {"job_id": job_id, "status": rt.queue.status(job_id)["status"], "created": created}


@router.get("/jobs", response_model=list[JobStatus], responses={404: {"model": ErrorBody}})
def get_jobs(rt: RuntimeDep,
             ids: Annotated[str, Query(description="Comma-separated job ids (at most 1000)",
                                       **documented(pattern="[^,]"))]) -> list[dict]:
    """Status of many jobs in one request, in the order asked."""
    wanted = [i for i in ids.split(",") if i]
    if not wanted or len(wanted) > 1000:
        raise InvalidInput("ids must name 1 to 1000 jobs", type="invalid_ids")
    return [rt.queue.status(job_id) for job_id in wanted]


@router.get("/jobs/{job_id}", response_model=JobStatus, responses={404: {"model": ErrorBody}})
def get_job(job_id: str, rt: RuntimeDep) -> dict:
    return rt.queue.status(job_id)
