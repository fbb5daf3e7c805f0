"""The API's database work: small keyword-only functions over one session (the request's
transaction, `deps.DbDep`). Each raises the API's errors (`NotFound`, `InvalidRequest`,
`Conflict`) and returns rows or response schemas; none commits.

Every read of a team's resource filters by the team: another team's id is `NotFound`,
exactly like an id that does not exist.

The job progress (`job_public`) reads precomputed rows only: the job, its `job_tasks`
(kept up to date with each measurement by `services.db.measurements.record_measurement`) and
its `job_progress` curve (a point per change of the estimate, at most ~50 more, written
by the scheduler): one statement over indexed rows, whose cost does not depend on how
many measurements the job has.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Float, bindparam, case, func, select, text, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session, aliased, sessionmaker

from services.api.exceptions import Conflict, InvalidRequest, NotFound, QuotaExceeded
from services.api.schemas import (
    ArtifactPublic,
    CostModelPublic,
    DeviceClassPublic,
    DevicePublic,
    JobCreate,
    JobPublic,
    JobSummary,
    JobTaskPublic,
    ModelPublic,
    ModelSummary,
    ModelTaskPublic,
    ProgressPoint,
    TensorPublic,
    TransferPublic,
)
from services.api.storage import StoredFile
from services.db import liveness, trust
from services.db.codec import record_from_json
from services.db.models import (
    Agent,
    CostModelVersion,
    DeviceClass,
    Job,
    JobProgress,
    JobState,
    JobTask,
    Measurement,
    Model,
    ModelTask,
    Team,
    Workload,
)
from services.db.session import transaction
from tunefarm.models.finish import batch_size_for
from tunefarm.records import ErrorKind
from tunefarm.search.task import target_key

RECORDS_FETCH = 500
"""Measurements fetched per round trip while streaming a job's records."""


# -- models -----------------------------------------------------------------------------------


def store_model(
    session: Session,
    *,
    team_id: int,
    name: str,
    input_shapes: dict[str, list[int]],
    onnx: StoredFile,
    fused: StoredFile,
    intake: dict[str, Any],
) -> Model:
    """Insert a taken-in model, its task table and its workloads (shared by key with
    every other model that has them)."""
    tasks = intake["tasks"]
    for t in tasks:
        session.execute(
            pg_insert(Workload)
            .values(
                key=t["key"],
                name=t["name"],
                module_json=t["module_json"],
                flops=t["flops"],
                n_inputs=t["n_inputs"],
                n_outputs=t["n_outputs"],
            )
            .on_conflict_do_nothing(index_elements=[Workload.key])
        )
    keys = [t["key"] for t in tasks]
    ids = {key: wid for key, wid in session.execute(select(Workload.key, Workload.id).where(Workload.key.in_(keys)))}
    table = [
        {k: t[k] for k in ("position", "name", "key", "shapes", "weight", "flops", "share")} for t in tasks
    ]
    model = Model(
        team_id=team_id,
        name=name,
        input_shapes=input_shapes,
        onnx_path=onnx.path,
        onnx_sha256=onnx.sha256,
        onnx_size=onnx.size,
        fused_path=fused.path,
        fused_sha256=fused.sha256,
        fused_size=fused.size,
        task_table=table,
        inputs=intake["inputs"],
        outputs=intake["outputs"],
        warnings=intake["warnings"],
    )
    session.add(model)
    session.flush()
    session.add_all(
        ModelTask(
            model_id=model.id,
            workload_id=ids[t["key"]],
            position=t["position"],
            weight=t["weight"],
            const_inputs=t["const_inputs"],
            global_vars=t["global_vars"],
        )
        for t in tasks
    )
    session.flush()
    session.refresh(model)
    return model


def get_model(session: Session, *, team_id: int, model_id: int) -> Model:
    model = session.scalars(select(Model).where(Model.id == model_id, Model.team_id == team_id)).one_or_none()
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
    query = select(Model).where(Model.team_id == team_id)
    if cursor is not None:
        query = query.where(Model.id < cursor)
    rows = list(session.scalars(query.order_by(Model.id.desc()).limit(limit + 1)))
    items = [
        ModelSummary(id=m.id, name=m.name, tasks=len(m.task_table), onnx_size=m.onnx_size, created_at=m.created_at)
        for m in rows[:limit]
    ]
    return items, (rows[limit - 1].id if len(rows) > limit else None)


# -- jobs -------------------------------------------------------------------------------------


def device_class_by_name(session: Session, *, name: str) -> DeviceClass:
    found = session.scalars(select(DeviceClass).where(DeviceClass.name == name)).one_or_none()
    if found is None:
        known = list(session.scalars(select(DeviceClass.name).order_by(DeviceClass.name)))
        listing = ", ".join(repr(n) for n in known) if known else "none yet"
        raise InvalidRequest(f"unknown device class {name!r} (known classes: {listing})")
    return found


@dataclass(frozen=True)
class TeamQuota:
    """What one team may have in progress (jobs queued, running or finishing)."""

    max_active_jobs: int
    max_active_trials: int  # trials those jobs have still to run, together


ACTIVE_JOB_STATES = (JobState.QUEUED, JobState.RUNNING, JobState.FINISHING)


def check_team_quota(session: Session, *, team_id: int, trial_budget: int, quota: TeamQuota) -> None:
    """`QuotaExceeded` unless the team may start one more job of `trial_budget` trials.
    Locks the team's row until the transaction ends, so two jobs created at once are
    counted one after the other."""
    session.execute(select(Team.id).where(Team.id == team_id).with_for_update())
    jobs, trials = session.execute(
        select(func.count(), func.coalesce(func.sum(func.greatest(Job.trial_budget - Job.trials_used, 0)), 0)).where(
            Job.team_id == team_id, Job.state.in_(ACTIVE_JOB_STATES)
        )
    ).one()
    if jobs >= quota.max_active_jobs:
        raise QuotaExceeded(
            f"your team has {jobs} jobs queued or running, the most this farm allows a team at once "
            f"({quota.max_active_jobs}); start this one when one of them has ended (or cancel one)"
        )
    if trials + trial_budget > quota.max_active_trials:
        raise QuotaExceeded(
            f"this job's {trial_budget} trials and the {trials} your team's jobs in progress have still to run "
            f"would be more than this farm allows a team at once ({quota.max_active_trials} trials); ask for fewer "
            "or wait for a job to end"
        )


def create_job(
    session: Session, *, team_id: int, body: JobCreate, max_trial_budget: int, quota: TeamQuota | None = None
) -> Job:
    """A queued job and its tasks (the model's, keyed for the class's target), within the
    team's quota (the API always gives one; None: an operator's tool, unchecked)."""
    if body.trial_budget > max_trial_budget:
        raise InvalidRequest(
            f"trial_budget {body.trial_budget} is larger than this farm allows ({max_trial_budget})"
        )
    model = get_model(session, team_id=team_id, model_id=body.model_id)
    device_class = device_class_by_name(session, name=body.device_class)
    if quota is not None:
        check_team_quota(session, team_id=team_id, trial_budget=body.trial_budget, quota=quota)
    tasks = session.execute(
        select(ModelTask.workload_id, ModelTask.position, ModelTask.weight, Workload.key)
        .join(Workload, Workload.id == ModelTask.workload_id)
        .where(ModelTask.model_id == model.id)
        .order_by(ModelTask.position)
    ).all()
    job = Job(
        team_id=team_id,
        model_id=model.id,
        device_class_id=device_class.id,
        trial_budget=body.trial_budget,
        latency_target_secs=body.latency_target_secs,
        config={
            "strategy": body.strategy,
            "seed": body.seed,
            "batch_size": batch_size_for(body.trial_budget, len(tasks)),
        },
    )
    session.add(job)
    session.flush()
    suffix = target_key(device_class.target)
    session.add_all(
        JobTask(
            job_id=job.id,
            workload_id=t.workload_id,
            task_key=f"{t.key}@{suffix}",
            position=t.position,
            weight=t.weight,
        )
        for t in tasks
    )
    session.flush()
    return job


def _owned_job(session: Session, *, team_id: int, job_id: int, lock: bool = False) -> Job:
    query = select(Job).where(Job.id == job_id, Job.team_id == team_id)
    if lock:
        query = query.with_for_update()
    job = session.scalars(query).one_or_none()
    if job is None:
        raise NotFound(f"job {job_id} not found")
    return job


def _progress_statement():
    """The job progress statement (built once: constructing it costs more CPU than running it)."""
    tasks = (
        select(
            func.coalesce(
                func.json_agg(
                    func.json_build_array(
                        JobTask.position,
                        Workload.name,
                        JobTask.task_key,
                        JobTask.weight,
                        JobTask.trials,
                        JobTask.best_cost,
                        JobTask.dead_reason,
                        JobTask.best_emulated,
                        JobTask.best_confirmed,
                        JobTask.confirmed_cost,
                    ).op("ORDER BY")(JobTask.position)
                ),
                text("'[]'::json"),
            )
        )
        .join(Workload, Workload.id == JobTask.workload_id)
        .where(JobTask.job_id == Job.id)
        .scalar_subquery()
    )
    curve = (
        select(
            func.coalesce(
                func.json_agg(
                    func.json_build_array(
                        JobProgress.trials, JobProgress.elapsed_secs, JobProgress.est_latency_secs
                    ).op("ORDER BY")(JobProgress.trials)
                ),
                text("'[]'::json"),
            )
        )
        .where(JobProgress.job_id == Job.id)
        .scalar_subquery()
    )
    # The class a transferred model came from: the job's version itself when it is another
    # class's (the job's class had none yet), or the version that one descends from.
    source, source_class = aliased(CostModelVersion), aliased(DeviceClass)
    source_id = case(
        (CostModelVersion.device_class_id != Job.device_class_id, CostModelVersion.id),
        else_=CostModelVersion.transferred_from_id,
    )
    # Live agents of the job's class (services.db.liveness): none, and the job says so.
    live = (
        select(func.count())
        .where(Agent.device_class_id == Job.device_class_id, liveness.live_clause(bindparam("fresh_secs", type_=Float)))
        .scalar_subquery()
    )
    return (
        select(
            Job, Model.name, DeviceClass.name, CostModelVersion.version, CostModelVersion.trained_on, tasks, curve,
            source_class.name, source.version, CostModelVersion.device_class_id == Job.device_class_id, live,
        )  # fmt: skip
        .join(Model, Model.id == Job.model_id)
        .join(DeviceClass, DeviceClass.id == Job.device_class_id)
        .outerjoin(CostModelVersion, CostModelVersion.id == Job.cost_model_version_id)
        .outerjoin(source, source.id == source_id)
        .outerjoin(source_class, source_class.id == source.device_class_id)
        .where(Job.id == bindparam("job_id"), Job.team_id == bindparam("team_id"))
    )


_PROGRESS = _progress_statement()


def job_public(session: Session, *, team_id: int, job_id: int, fresh_secs: float) -> JobPublic:
    """A job's progress from its precomputed rows (see the module docstring), in one
    statement: the job row, its tasks and its curve aggregated as JSON by Postgres; and,
    for a job not yet over, whether no live agent serves its class (`waiting`: it would
    wait for one without a word otherwise)."""
    row = session.execute(_PROGRESS, {"job_id": job_id, "team_id": team_id, "fresh_secs": fresh_secs}).one_or_none()
    if row is None:
        raise NotFound(f"job {job_id} not found")
    job, model_name, class_name, version, trained_on, task_rows, points, source_class, source_version, own, live_agents = row
    waiting = no_agent_message(class_name) if job.state in ACTIVE_JOB_STATES and not live_agents else None
    return JobPublic(
        waiting=waiting,
        id=job.id,
        state=job.state.value,
        model_id=job.model_id,
        model_name=model_name,
        device_class=class_name,
        trial_budget=job.trial_budget,
        trials_used=job.trials_used,
        latency_target_secs=job.latency_target_secs,
        est_latency_start_secs=job.est_latency_start_secs,
        est_latency_secs=job.est_latency_secs,
        cancel_requested=job.cancel_requested,
        error=job.error,
        config=job.config,
        tasks=[
            JobTaskPublic(
                position=t[0], name=t[1], key=t[2], weight=t[3], trials=t[4], best_secs=t[5], dead_reason=t[6],
                best_emulated=t[7], best_confirmed=t[8], confirmed_best_secs=t[9],
            )
            for t in task_rows
        ],
        curve=[ProgressPoint(trials=p[0], elapsed_secs=p[1], est_latency_secs=p[2]) for p in points],
        cost_model=CostModelPublic(
            version_id=job.cost_model_version_id,
            version=version,
            trained_on=trained_on,
            trained_on_at_first_batch=job.start_model_trained_on,
            device_class=None if version is None else class_name if own else source_class,
            transferred_from=(
                TransferPublic(device_class=source_class, version=source_version) if source_class is not None else None
            ),
        ),
        artifact=ArtifactPublic(
            available=job.state is JobState.SUCCEEDED and job.artifact_path is not None,
            sha256=job.artifact_sha256,
            size=job.artifact_size,
        ),
        result=job.result,
        created_at=job.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
    )


ACTIVE_JOB_STATES = (JobState.QUEUED, JobState.RUNNING, JobState.FINISHING)


def no_agent_message(class_name: str) -> str:
    """What a job not yet over says while no agent of its class is live (none idle or
    busy that heartbeated within the freshness window)."""
    return f"waiting: no agent of class {class_name} is online (start one: tunefarm agent --device-class {class_name})"


def list_jobs(session: Session, *, team_id: int, limit: int, cursor: int | None) -> tuple[list[JobSummary], int | None]:
    query = (
        select(
            Job.id,
            Job.state,
            Job.model_id,
            Model.name.label("model_name"),
            DeviceClass.name.label("device_class"),
            Job.trial_budget,
            Job.trials_used,
            Job.est_latency_start_secs,
            Job.est_latency_secs,
            Job.created_at,
            Job.finished_at,
        )
        .join(DeviceClass, DeviceClass.id == Job.device_class_id)
        .join(Model, Model.id == Job.model_id)
        .where(Job.team_id == team_id)
    )
    if cursor is not None:
        query = query.where(Job.id < cursor)
    rows = session.execute(query.order_by(Job.id.desc()).limit(limit + 1)).all()
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
            created_at=r.created_at,
            finished_at=r.finished_at,
        )
        for r in rows[:limit]
    ]
    return items, (rows[limit - 1].id if len(rows) > limit else None)


@dataclass(frozen=True)
class TaskDetail:
    """What the dashboard's task table adds to a job's progress: the task's FLOPs per call
    and its measurements that are errors, by kind."""

    flops: float
    errors_by_kind: dict[str, int]


def job_task_details(session: Session, *, team_id: int, job_id: int) -> dict[int, TaskDetail]:
    """Per task position of the team's job. Unlike `job_public` this counts the job's
    error measurements (one indexed pass over the job's measurements): for the dashboard's
    job page, not for pollers."""
    _owned_job(session, team_id=team_id, job_id=job_id)
    flops = dict(
        session.execute(
            select(JobTask.position, Workload.flops)
            .join(Workload, Workload.id == JobTask.workload_id)
            .where(JobTask.job_id == job_id)
        ).all()
    )
    errors: dict[int, dict[str, int]] = {}
    rows = session.execute(
        select(JobTask.position, Measurement.error_kind, func.count())
        .join(JobTask, JobTask.id == Measurement.job_task_id)
        .where(Measurement.job_id == job_id, Measurement.error_kind != ErrorKind.NONE)
        .group_by(JobTask.position, Measurement.error_kind)
    )
    for position, kind, n in rows:
        errors.setdefault(position, {})[str(kind)] = int(n)
    return {p: TaskDetail(flops=f, errors_by_kind=errors.get(p, {})) for p, f in flops.items()}


def request_cancel(session: Session, *, team_id: int, job_id: int) -> None:
    """Ask the scheduler to stop the job; a job still queued is cancelled at once."""
    job = _owned_job(session, team_id=team_id, job_id=job_id, lock=True)
    if job.state.is_terminal:
        raise Conflict(f"job {job_id} is already {job.state.value}")
    values: dict[str, Any] = {"cancel_requested": True}
    if job.state is JobState.QUEUED:
        values.update(state=JobState.CANCELLED, finished_at=func.now())
    session.execute(update(Job).where(Job.id == job_id).values(**values), execution_options={"synchronize_session": False})


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


def record_lines(sessions: sessionmaker[Session], *, job_id: int) -> Iterator[bytes]:
    """The job's measurements as records-file lines (`MeasureRecord.to_json`), oldest
    first, fetched in chunks in one transaction of their own (the stream outlives the
    request's)."""
    with transaction(sessions) as session:
        rows = session.execute(
            select(Measurement.record)
            .where(Measurement.job_id == job_id)
            .order_by(Measurement.id)
            .execution_options(yield_per=RECORDS_FETCH)
        )
        for (record,) in rows:
            yield (record_from_json(record).to_json() + "\n").encode()


# -- devices ----------------------------------------------------------------------------------


def list_devices(session: Session, *, fresh_secs: float) -> list[DevicePublic]:
    """Every agent; one idle or busy in its row but silent for more than `fresh_secs` is
    shown offline (`services.db.liveness`: it stopped without a word)."""
    rows = session.execute(
        select(Agent, DeviceClass.name).join(DeviceClass, DeviceClass.id == Agent.device_class_id).order_by(Agent.id)
    ).all()
    now = database_now(session)
    return [_device(a, class_name, now=now, fresh_secs=fresh_secs) for a, class_name in rows]


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
    online = (
        select(Agent.device_class_id, func.count().label("n"))
        .where(liveness.live_clause(fresh_secs))
        .group_by(Agent.device_class_id)
        .subquery()
    )
    rows = session.execute(
        select(DeviceClass, func.coalesce(online.c.n, 0))
        .outerjoin(online, online.c.device_class_id == DeviceClass.id)
        .order_by(DeviceClass.name)
    ).all()
    return [
        DeviceClassPublic(name=dc.name, target=dc.target, description=dc.description, agents_online=int(n))
        for dc, n in rows
    ]


def database_now(session: Session) -> datetime:
    """The database's clock (ages of heartbeats are measured against it, as they are written)."""
    return session.scalar(select(func.now()))


def schema_revision(session: Session) -> str:
    return str(session.execute(text("SELECT version_num FROM alembic_version")).scalar_one())
