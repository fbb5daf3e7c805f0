"""The API's operations on a team's resources: each reads or writes through `services.db`
over one session (the request's transaction, `deps.SessionsDep`), raises the API's errors
(`NotFound`, `InvalidRequest`, `Conflict`, `QuotaExceeded`) and builds the response
schemas; none commits.

Every read of a team's resource filters by the team: another team's id is `NotFound`,
exactly like an id that does not exist.

A job's progress (`job_public`) reads precomputed rows only (`services.db.jobs.job_overview`):
its cost does not depend on how many measurements the job has.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from services.api.exceptions import Conflict, InvalidRequest, NotFound, QuotaExceeded
from services.api.intake import ModelVariant
from services.api.job_tasks import job_task_rows
from services.api.schemas import (
    ArtifactPublic,
    CostModelPublic,
    DeviceClassPublic,
    DevicePublic,
    JobCreate,
    JobPublic,
    JobSummary,
    ModelPublic,
    ModelSummary,
    ModelTaskPublic,
    PretrainedPublic,
    ProgressPoint,
    TensorPublic,
    TransferPublic,
)
from services.db import device_classes, devices, jobs, liveness, teams, trust, uploads
from services.db.jobs import ACTIVE_JOB_STATES, TaskDetail
from services.db.models import Agent, DeviceClass, Job, Model
from services.db.session import Session, SessionFactory, transaction
from services.db.states import JobState
from tunefarm.errors import UsageError
from tunefarm.models.alternatives import ALGORITHMS
from tunefarm.models.peers import ONNXRUNTIME, OPENVINO, latency_key
from tunefarm.models.precision import FP32, check_precision
from tunefarm.models.timing import speedup
from tunefarm.search.config import batch_size_for
from tunefarm.search.task import target_key

# -- models -----------------------------------------------------------------------------------


def get_model(session: Session, *, team_id: int, model_id: int) -> Model:
    model = uploads.get_model(session, team_id=team_id, model_id=model_id)
    if model is None:
        raise NotFound(f"model {model_id} not found")
    return model


def model_public(model: Model) -> ModelPublic:
    return ModelPublic(
        id=model.id,
        name=model.name,
        input_shapes=model.input_shapes,
        inputs=[TensorPublic(**t) for t in model.inputs],
        outputs=[TensorPublic(**t) for t in model.outputs],
        onnx_sha256=model.onnx_sha256,
        onnx_size=model.onnx_size,
        tasks=[ModelTaskPublic(**row) for row in model.task_table],
        warnings=list(model.warnings),
        created_at=model.created_at,
    )


def list_models(session: Session, *, team_id: int, limit: int, cursor: int | None) -> tuple[list[ModelSummary], int | None]:
    rows, next_cursor = uploads.list_models(session, team_id=team_id, limit=limit, cursor=cursor)
    items = [
        ModelSummary(id=m.id, name=m.name, tasks=len(m.task_table), onnx_size=m.onnx_size, created_at=m.created_at)
        for m in rows
    ]
    return items, next_cursor


# -- jobs -------------------------------------------------------------------------------------


def device_class_by_name(session: Session, *, name: str) -> DeviceClass:
    found = device_classes.find_device_class(session, name=name)
    if found is None:
        known = device_classes.device_class_names(session)
        listing = ", ".join(repr(n) for n in known) if known else "none yet"
        raise InvalidRequest(f"unknown device class {name!r} (known classes: {listing})")
    return found


@dataclass(frozen=True)
class TeamQuota:
    """What one team may have in progress (jobs queued, running or finishing)."""

    max_active_jobs: int
    max_active_trials: int  # trials those jobs have still to run, together


def check_team_quota(session: Session, *, team_id: int, trial_budget: int, quota: TeamQuota) -> None:
    """`QuotaExceeded` unless the team may start one more job of `trial_budget` trials.
    Locks the team's row until the transaction ends, so two jobs created at once are
    counted one after the other (`teams.lock_active_work`)."""
    work = teams.lock_active_work(session, team_id=team_id)
    if work.jobs >= quota.max_active_jobs:
        raise QuotaExceeded(
            f"your team has {work.jobs} jobs queued or running, the most this farm allows a team at once "
            f"({quota.max_active_jobs}); start this one when one of them has ended (or cancel one)"
        )
    if work.trials + trial_budget > quota.max_active_trials:
        raise QuotaExceeded(
            f"this job's {trial_budget} trials and the {work.trials} your team's jobs in progress have still to run "
            f"would be more than this farm allows a team at once ({quota.max_active_trials} trials); ask for fewer "
            "or wait for a job to end"
        )


def check_job_request(session: Session, *, team_id: int, body: JobCreate, max_trial_budget: int) -> tuple[Model, DeviceClass]:
    """The job's model and class, once the request is one the farm can do: a budget within
    its limit, a model of the team, a known class, a precision the class computes in
    (`tunefarm.models.precision.check_precision`). Raises `InvalidRequest`, `NotFound`."""
    if body.trial_budget > max_trial_budget:
        raise InvalidRequest(
            f"trial_budget {body.trial_budget} is larger than this farm allows ({max_trial_budget})"
        )
    model = get_model(session, team_id=team_id, model_id=body.model_id)
    device_class = device_class_by_name(session, name=body.device_class)
    try:
        check_precision(body.precision, device_class.target, option="precision")
    except UsageError as exc:
        raise InvalidRequest(f"{exc} (device class {device_class.name!r})") from None
    return model, device_class


def create_job(
    session: Session,
    *,
    team_id: int,
    body: JobCreate,
    max_trial_budget: int,
    quota: TeamQuota | None = None,
    variant: ModelVariant | None = None,
) -> Job:
    """A queued job and its tasks (the model's, keyed for the class's target), within the
    team's quota (the API always gives one; None: an operator's tool, unchecked). A job
    in reduced precision tunes `variant`'s tasks (the model converted, `take_in_variant`),
    and its config names the precision and the variant's fused module; a float32 job's
    config is as it always was."""
    model, device_class = check_job_request(session, team_id=team_id, body=body, max_trial_budget=max_trial_budget)
    if (variant.precision if variant else FP32) != body.precision:
        raise ValueError(f"a job in {body.precision} needs the model converted to it")
    if quota is not None:
        check_team_quota(session, team_id=team_id, trial_budget=body.trial_budget, quota=quota)
    tasks = uploads.model_tasks(session, model_id=model.id) if variant is None else uploads.store_variant_tasks(
        session, variant.tasks
    )
    reduced = {"precision": variant.precision, "fused_path": variant.fused.path} if variant is not None else {}
    return jobs.create_job(
        session,
        team_id=team_id,
        model_id=model.id,
        device_class_id=device_class.id,
        trial_budget=body.trial_budget,
        latency_target_secs=body.latency_target_secs,
        config={
            "strategy": body.strategy,
            "seed": body.seed,
            "batch_size": batch_size_for(body.trial_budget, len(tasks)),
            "algorithms": list(ALGORITHMS) if body.winograd else [],
            **reduced,
        },
        tasks=tasks,
        task_key_suffix=target_key(device_class.target),
    )


def _owned_job(session: Session, *, team_id: int, job_id: int, lock: bool = False) -> Job:
    job = jobs.find_job(session, team_id=team_id, job_id=job_id, lock=lock)
    if job is None:
        raise NotFound(f"job {job_id} not found")
    return job


def job_public(
    session: Session, *, team_id: int, job_id: int, fresh_secs: float, stall_secs: float = math.inf
) -> JobPublic:
    """A job's progress from its precomputed rows (`jobs.job_overview`, one statement); and,
    for a job not yet over, what it waits on (`waiting`: no live agent of its class, or a
    batch stalled for `stall_secs`; it would wait without a word otherwise)."""
    seen = jobs.job_overview(session, team_id=team_id, job_id=job_id, fresh_secs=fresh_secs)
    if seen is None:
        raise NotFound(f"job {job_id} not found")
    job = seen.job
    waiting = waiting_message(seen, stall_secs) if job.state in ACTIVE_JOB_STATES else None
    return JobPublic(
        waiting=waiting,
        id=job.id,
        state=job.state.value,
        model_id=job.model_id,
        model_name=seen.model_name,
        device_class=seen.class_name,
        trial_budget=job.trial_budget,
        trials_used=job.trials_used,
        latency_target_secs=job.latency_target_secs,
        est_latency_start_secs=job.est_latency_start_secs,
        est_latency_secs=job.est_latency_secs,
        cancel_requested=job.cancel_requested,
        error=job.error,
        config=job.config,
        tasks=job_task_rows(seen.tasks),  # a task with its alternatives as one row
        curve=[ProgressPoint(trials=p[0], elapsed_secs=p[1], est_latency_secs=p[2]) for p in seen.curve],
        cost_model=_cost_model_public(seen),
        artifact=ArtifactPublic(
            available=job.state is JobState.SUCCEEDED and job.artifact_path is not None,
            sha256=job.artifact_sha256,
            size=job.artifact_size,
        ),
        result=job.result,
        speedup_vs_onnxruntime=measured_speedup(job.result, ONNXRUNTIME),
        speedup_vs_openvino=measured_speedup(job.result, OPENVINO),
        created_at=job.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
    )


def measured_speedup(result: dict[str, Any] | None, peer: str) -> float | None:
    """A finished job's tuned model measured against a peer (`ONNXRUNTIME`, `OPENVINO`;
    `timing.speedup`: the median of the rounds' p50 ratios, as `tunefarm report` states it); None until both
    were measured."""
    if not result:
        return None
    return speedup(result.get(latency_key(peer)), result.get("latency"))


def _cost_model_public(seen: jobs.JobOverview) -> CostModelPublic:
    """The cost model a job's search uses, and the class it was transferred from."""
    version, source_class = seen.cost_model_version, seen.source_class
    return CostModelPublic(
        version_id=seen.job.cost_model_version_id,
        version=version,
        trained_on=seen.trained_on,
        trained_on_at_first_batch=seen.job.start_model_trained_on,
        device_class=None if version is None else seen.class_name if seen.own_class_model else source_class,
        transferred_from=(
            TransferPublic(device_class=source_class, version=seen.source_version) if source_class is not None else None
        ),
        pretrained=_pretrained_public(seen.job.cost_model_pretrained),
    )


def _pretrained_public(summary: dict[str, Any] | None) -> PretrainedPublic | None:
    """The pretrained base a job recorded (`shared_model.pretrained_summary`)."""
    if not summary:
        return None
    return PretrainedPublic(
        family=summary.get("family"), objective=summary.get("objective"), programs=summary.get("programs"),
        tasks=summary.get("tasks"), classes=int(summary.get("classes") or 0), written=summary.get("written"),
    )  # fmt: skip


def waiting_message(seen: jobs.JobOverview, stall_secs: float) -> str | None:
    """What a job not yet over waits on, if anything: no live agent of its class, else
    its open batch that has waited at least `stall_secs` in its phase."""
    if not seen.live_agents:
        return no_agent_message(seen.class_name)
    stalled = seen.stalled
    if stalled is None or stalled.waited_secs < stall_secs:
        return None
    waited = f"{stalled.waited_secs / 60:.0f} min"
    if stalled.state in jobs.UNBUILT_STATES:
        return (f"waiting: batch {stalled.batch_id} has waited {waited} for its build (is a build worker of class "
                f"{seen.class_name} running? tunefarm worker --device-class {seen.class_name})")
    return (f"waiting: batch {stalled.batch_id} has been ready for {waited} and no agent of class {seen.class_name} "
            "has taken it (all busy with other jobs, or withheld: tunefarm devices)")


def no_agent_message(class_name: str) -> str:
    """What a job not yet over says while no agent of its class is live (none idle or
    busy that heartbeated within the freshness window)."""
    return f"waiting: no agent of class {class_name} is online (start one: tunefarm agent --device-class {class_name})"


def list_jobs(session: Session, *, team_id: int, limit: int, cursor: int | None) -> tuple[list[JobSummary], int | None]:
    rows, next_cursor = jobs.list_jobs(session, team_id=team_id, limit=limit, cursor=cursor)
    items = [
        JobSummary(
            id=r.id,
            state=r.state.value,
            model_id=r.model_id,
            model_name=r.model_name,
            device_class=r.device_class,
            trial_budget=r.trial_budget,
            trials_used=r.trials_used,
            est_latency_start_secs=r.est_latency_start_secs,
            est_latency_secs=r.est_latency_secs,
            speedup_vs_onnxruntime=measured_speedup(r.result, ONNXRUNTIME),
            speedup_vs_openvino=measured_speedup(r.result, OPENVINO),
            created_at=r.created_at,
            finished_at=r.finished_at,
        )
        for r in rows
    ]
    return items, next_cursor


def job_task_details(session: Session, *, team_id: int, job_id: int) -> dict[int, TaskDetail]:
    """Per task position of the team's job: its FLOPs and error counts (`jobs.task_details`:
    for the dashboard's job page, not for pollers)."""
    _owned_job(session, team_id=team_id, job_id=job_id)
    return jobs.task_details(session, job_id=job_id)


def job_task_curves(session: Session, *, team_id: int, job_id: int) -> dict[int, list[tuple[int, float]]]:
    """Per task position of the team's job: its best latency over its trials
    (`jobs.task_best_curves`: for the dashboard's job page, not for pollers)."""
    _owned_job(session, team_id=team_id, job_id=job_id)
    return jobs.task_best_curves(session, job_id=job_id)


def request_cancel(session: Session, *, team_id: int, job_id: int) -> None:
    """Ask the scheduler to stop the job; a job still queued is cancelled at once."""
    job = _owned_job(session, team_id=team_id, job_id=job_id, lock=True)
    if job.state.is_terminal:
        raise Conflict(f"job {job_id} is already {job.state.value}")
    jobs.request_cancel(session, job_id=job_id, at_once=job.state is JobState.QUEUED)


def job_artifact(session: Session, *, team_id: int, job_id: int) -> Job:
    """The job, if its tuned model archive can be fetched (`Conflict` otherwise)."""
    job = _owned_job(session, team_id=team_id, job_id=job_id)
    if job.state is not JobState.SUCCEEDED or job.artifact_path is None:
        why = f"it is {job.state.value}" + (f": {job.error}" if job.error else "")
        raise Conflict(f"job {job_id} has no tuned model yet ({why})")
    return job


def check_job(session: Session, *, team_id: int, job_id: int) -> None:
    """`NotFound` unless the job exists and is the team's."""
    _owned_job(session, team_id=team_id, job_id=job_id)


def record_lines(sessions: SessionFactory, *, job_id: int) -> Iterator[bytes]:
    """The job's measurements as records-file lines (`MeasureRecord.to_json`), oldest
    first, fetched in chunks in one transaction of their own (the stream outlives the
    request's)."""
    with transaction(sessions) as session:
        for record in jobs.job_records(session, job_id=job_id):
            yield (record.to_json() + "\n").encode()


# -- devices ----------------------------------------------------------------------------------


def list_devices(session: Session, *, fresh_secs: float) -> list[DevicePublic]:
    """Every agent; one idle or busy in its row but silent for more than `fresh_secs` is
    shown offline (`services.db.liveness`: it stopped without a word)."""
    rows = devices.agents_with_classes(session)
    now = devices.database_now(session)
    return [_device(a, class_name, now=now, fresh_secs=fresh_secs) for a, class_name in rows]


def device(session: Session, *, agent_id: int, fresh_secs: float) -> DevicePublic:
    """One agent, as `list_devices` shows it (`NotFound`: no such agent)."""
    found = devices.agent_with_class(session, agent_id=agent_id)
    if found is None:
        raise NotFound(f"agent {agent_id} not found")
    agent, class_name = found
    return _device(agent, class_name, now=devices.database_now(session), fresh_secs=fresh_secs)


def device_history(session: Session, *, agent_id: int, hours: int) -> list[devices.MeasuredHour]:
    """The agent's measurements hour by hour over the last `hours` hours, newest first."""
    return devices.agent_history(session, agent_id=agent_id, hours=hours)


def _device(a: Agent, class_name: str, *, now: datetime, fresh_secs: float) -> DevicePublic:
    counts = trust.AgentCounts.of(a)
    return DevicePublic(
        id=a.id,
        name=a.name,
        device_class=class_name,
        state=liveness.shown_state(a.state, a.last_heartbeat_at, now=now, fresh_secs=fresh_secs).value,
        capabilities=a.capabilities,
        registered_at=a.registered_at,
        last_heartbeat_at=a.last_heartbeat_at,
        measurements_done=a.measurements_done,
        errors_by_kind={str(k): int(v) for k, v in a.errors_by_kind.items()},
        standing=trust.standing(counts).value,
        flag_reasons=trust.flag_reasons(counts),
        below_floor=counts.below_floor,
        confirmations_agreed=counts.confirmations_agreed,
        confirmations_disputed=counts.confirmations_disputed,
        quarantined_at=a.quarantined_at,
    )


def list_device_classes(session: Session, *, fresh_secs: float) -> list[DeviceClassPublic]:
    return [
        DeviceClassPublic(name=dc.name, target=dc.target, description=dc.description, agents_online=n)
        for dc, n in devices.classes_with_live_agents(session, fresh_secs=fresh_secs)
    ]


def device_class(session: Session, *, name: str, fresh_secs: float) -> DeviceClassPublic:
    """The device class `name`, as `list_device_classes` shows it (`NotFound`: none)."""
    for found in list_device_classes(session, fresh_secs=fresh_secs):
        if found.name == name:
            return found
    raise NotFound(f"device class {name!r} not found")
