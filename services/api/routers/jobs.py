"""`/v1/jobs`: start tuning a model on a device class, follow it, cancel it, fetch the
tuned model archive and the records."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path
from fastapi.responses import FileResponse, StreamingResponse

from services.api import crud
from services.api.deps import IntakeDep, PageDep, SessionsDep, SettingsDep, TeamDep
from services.api.downloads import artifact_download
from services.api.intake import IntakeLimits, ModelVariant, take_in_variant
from services.api.routers.responses import AUTH, errors
from services.api.schemas import JobCreate, JobPage, JobPublic
from services.db.session import transaction
from tunefarm.models.precision import FP32

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=AUTH)

JobId = Annotated[int, Path(ge=1, description="the job's id")]


@router.post("", status_code=201, responses=errors(400, 404, 413, 429), summary="Tune a model on a device class")
def create_job(
    body: JobCreate, team: TeamDep, sessions: SessionsDep, settings: SettingsDep, intake: IntakeDep
) -> JobPublic:
    """Queue a job; the scheduler picks it up. 404 for a model that is not your team's;
    422 for an unknown device class, a budget beyond the farm's limit, or a reduced
    `precision` on a class that cannot compute in it (a CPU class); 429 when your
    team's jobs in progress, or the trials they have still to run, are at the farm's
    quota (it frees up as they end). A job in reduced precision imports the model again
    in that precision first (one of the model importers, as an upload: its tasks are the
    converted model's)."""
    quota = crud.TeamQuota(
        max_active_jobs=settings.team_max_active_jobs, max_active_trials=settings.team_max_active_trials
    )
    variant = _converted_model(body, team.id, sessions, settings, intake) if body.precision != FP32 else None
    with transaction(sessions) as db:
        job = crud.create_job(
            db, team_id=team.id, body=body, max_trial_budget=settings.max_trial_budget, quota=quota, variant=variant
        )
        return crud.job_public(db, team_id=team.id, job_id=job.id, fresh_secs=settings.agent_fresh_secs, stall_secs=settings.batch_stall_secs)


def _converted_model(body: JobCreate, team_id: int, sessions, settings, intake) -> ModelVariant:
    """The job's model imported again in the job's precision (the request checked first,
    so a request the farm refuses imports nothing)."""
    with transaction(sessions) as db:
        model, _ = crud.check_job_request(db, team_id=team_id, body=body, max_trial_budget=settings.max_trial_budget)
        source = (settings.artifact_root / model.onnx_path, dict(model.input_shapes), model.name)
    limits = IntakeLimits(
        max_bytes=settings.max_upload_bytes,
        timeout_secs=settings.intake_timeout_secs,
        max_tensor_elements=settings.max_tensor_elements,
        max_model_elements=settings.max_model_elements,
    )
    with intake.admit(team_id):
        return take_in_variant(intake, onnx_path=source[0], input_shapes=source[1], name=source[2],
                               root=settings.artifact_root, limits=limits, precision=body.precision)  # fmt: skip


@router.get("", summary="List your team's jobs, newest first")
def list_jobs(team: TeamDep, sessions: SessionsDep, page: PageDep) -> JobPage:
    with transaction(sessions) as db:
        items, next_cursor = crud.list_jobs(db, team_id=team.id, limit=page.limit, cursor=page.cursor)
    return JobPage(items=items, next_cursor=next_cursor)


@router.get("/{job_id}", responses=errors(404), summary="A job's state and progress")
def get_job(job_id: JobId, team: TeamDep, sessions: SessionsDep, settings: SettingsDep) -> JobPublic:
    """State, trials used of the budget, per-task best, the estimated latency at the start
    and now, and its curve; read from precomputed rows (constant cost per request).
    `waiting` says when no agent of the job's class is online."""
    with transaction(sessions) as db:
        return crud.job_public(db, team_id=team.id, job_id=job_id, fresh_secs=settings.agent_fresh_secs, stall_secs=settings.batch_stall_secs)


@router.post("/{job_id}/cancel", responses=errors(404, 409), summary="Cancel a job")
def cancel_job(job_id: JobId, team: TeamDep, sessions: SessionsDep, settings: SettingsDep) -> JobPublic:
    """A queued job is cancelled at once; a running one when the scheduler next looks
    (`cancel_requested` is true until then). 409 for a finished job."""
    with transaction(sessions) as db:
        crud.request_cancel(db, team_id=team.id, job_id=job_id)
        return crud.job_public(db, team_id=team.id, job_id=job_id, fresh_secs=settings.agent_fresh_secs, stall_secs=settings.batch_stall_secs)


@router.get(
    "/{job_id}/artifact",
    response_class=FileResponse,
    responses={
        200: {
            "content": {"application/gzip": {"schema": {"type": "string", "format": "binary"}}},
            "description": "tuned/{model.so (model.cuda.tar for a CUDA class), manifest.json, records.jsonl, "
            "report.json} as a .tar.gz",
        },
        **errors(404, 409),
    },
    summary="The tuned model, as one archive",
)
def get_artifact(job_id: JobId, team: TeamDep, sessions: SessionsDep, settings: SettingsDep) -> FileResponse:
    """The same files `tunefarm tune --out DIR` writes. 409 until the job has succeeded."""
    return artifact_download(sessions, settings, team_id=team.id, job_id=job_id)


@router.get(
    "/{job_id}/records",
    response_class=StreamingResponse,
    responses={
        200: {
            "content": {"application/x-ndjson": {"schema": {"type": "string"}}},
            "description": "one MeasureRecord JSON line per measurement, oldest first (a records file)",
        },
        **errors(404),
    },
    summary="Every measurement of a job, as JSON lines",
)
def get_records(job_id: JobId, team: TeamDep, sessions: SessionsDep) -> StreamingResponse:
    with transaction(sessions) as db:
        crud.check_job(db, team_id=team.id, job_id=job_id)
    return StreamingResponse(crud.record_lines(sessions, job_id=job_id), media_type="application/x-ndjson")
