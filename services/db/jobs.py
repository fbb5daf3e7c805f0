"""A team's jobs: `create_job`, `find_job`, `list_jobs`, `job_overview` (its progress),
`task_details`, `task_best_curves`, `request_cancel`, `job_records`.

Every read takes the team: another team's job is not found, exactly like one that does
not exist (None). Every function works inside the caller's transaction and commits
nothing itself.

A job's progress (`job_overview`) reads precomputed rows only: the job, its `job_tasks`
(kept up to date with each measurement by `measurements.record_measurement`) and its
`job_progress` curve (a point per change of the estimate, at most ~50 more, written by the
scheduler): one statement over indexed rows, whose cost does not depend on how many
measurements the job has.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Float, Select, and_, bindparam, case, func, or_, select, text, update
from sqlalchemy.orm import Session, aliased

from services.db import liveness
from services.db.codec import record_from_json
from services.db.confirmations import counted_clause
from services.db.models import (
    Agent,
    Batch,
    CostModelVersion,
    DeviceClass,
    Job,
    JobProgress,
    JobTask,
    Measurement,
    Model,
    WorkloadRow,
)
from services.db.statements import db_now
from services.db.states import BatchState, JobState
from services.db.uploads import StoredTask
from tunefarm.records import ErrorKind, MeasureRecord

ACTIVE_JOB_STATES = (JobState.QUEUED, JobState.RUNNING, JobState.FINISHING)
"""A job in progress: it counts against its team's quota, and waits for a live agent."""

RECORDS_FETCH = 500
"""Measurements fetched per round trip while streaming a job's records."""


def create_job(
    session: Session,
    *,
    team_id: int,
    model_id: int,
    device_class_id: int,
    trial_budget: int,
    latency_target_secs: float | None,
    config: dict[str, Any],
    tasks: Sequence[StoredTask],
    task_key_suffix: str,
) -> Job:
    """A queued job and its tasks: the model's `tasks`, keyed `<workload key>@<suffix>`
    (the suffix names the class's target)."""
    job = Job(
        team_id=team_id,
        model_id=model_id,
        device_class_id=device_class_id,
        trial_budget=trial_budget,
        latency_target_secs=latency_target_secs,
        config=config,
    )
    session.add(job)
    session.flush()
    session.add_all(
        JobTask(
            job_id=job.id,
            workload_id=t.workload_id,
            task_key=f"{t.key}@{task_key_suffix}",
            position=t.position,
            weight=t.weight,
        )
        for t in tasks
    )
    session.flush()
    return job


def find_job(session: Session, *, team_id: int, job_id: int, lock: bool = False) -> Job | None:
    """The team's job (None: none of the team's), locked FOR UPDATE with `lock`."""
    query = select(Job).where(Job.id == job_id, Job.team_id == team_id)
    if lock:
        query = query.with_for_update()
    return session.scalars(query).one_or_none()


def list_jobs(session: Session, *, team_id: int, limit: int, cursor: int | None) -> tuple[list[Any], int | None]:
    """A page of the team's jobs, newest first (ids below `cursor`), and the cursor of the
    next page (None: the last). Rows with the job's columns (its `result` too) and
    `model_name`, `device_class`."""
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
            Job.result,
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
    return rows[:limit], (rows[limit - 1].id if len(rows) > limit else None)


# -- progress ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobOverview:
    """A job's progress, from its precomputed rows (`job_overview`)."""

    job: Job
    model_name: str
    class_name: str
    cost_model_version: int | None  # the job's cost model version, if any
    trained_on: int | None
    tasks: list[list[Any]]  # per task: position, name, key, weight, trials, best cost, dead reason,
    #                         best emulated, best confirmed, confirmed cost, and the position of
    #                         the task it is an alternative of (None: a task of the model)
    curve: list[list[Any]]  # per point: trials, elapsed secs, estimated latency secs
    source_class: str | None  # the class a transferred cost model came from
    source_version: int | None
    own_class_model: bool | None  # the cost model version is the job's class's own
    live_agents: int  # of the job's class
    stalled: StalledBatch | None = None  # its open batch that has waited longest in its phase


@dataclass(frozen=True)
class StalledBatch:
    """A job's open batch and how long it has waited: for its build (proposed or
    building: since it was made) or, built, for an agent (ready: since it became ready)."""

    batch_id: int
    state: BatchState
    waited_secs: float


def _json_rows(*columns: Any, order_by: Any) -> Any:
    """SQL: the rows' `columns` as a JSON array of arrays, in `order_by` order ([] for none)."""
    return func.coalesce(func.json_agg(func.json_build_array(*columns).op("ORDER BY")(order_by)), text("'[]'::json"))


def _tasks_json() -> Any:
    """The job's tasks as JSON (a scalar subquery correlated with `Job`)."""
    task = aliased(JobTask)  # the task a row is an alternative of
    columns = (
        JobTask.position, WorkloadRow.name, JobTask.task_key, JobTask.weight, JobTask.trials, JobTask.best_cost,
        JobTask.dead_reason, JobTask.best_emulated, JobTask.best_confirmed, JobTask.confirmed_cost, task.position,
    )  # fmt: skip
    return (
        select(_json_rows(*columns, order_by=JobTask.position))
        .join(WorkloadRow, WorkloadRow.id == JobTask.workload_id)
        .outerjoin(task, task.id == JobTask.alternative_of)
        .where(JobTask.job_id == Job.id)
        .scalar_subquery()
    )


def _curve_json() -> Any:
    """The job's progress curve as JSON (a scalar subquery correlated with `Job`)."""
    columns = (JobProgress.trials, JobProgress.elapsed_secs, JobProgress.est_latency_secs)
    return (
        select(_json_rows(*columns, order_by=JobProgress.trials))
        .where(JobProgress.job_id == Job.id)
        .scalar_subquery()
    )


def _live_agents() -> Any:
    """Live agents of the job's class (`liveness`; the window is the `fresh_secs` parameter)."""
    return (
        select(func.count())
        .where(Agent.device_class_id == Job.device_class_id, liveness.live_clause(bindparam("fresh_secs", type_=Float)))
        .scalar_subquery()
    )


UNBUILT_STATES = (BatchState.PROPOSED, BatchState.BUILDING)


def _longest_waiting_batch() -> Any:
    """The job's open batch (unbuilt, or ready and unleased) that has waited longest in its
    phase, as JSON [id, state, seconds] (a scalar subquery correlated with `Job`)."""
    since = case((Batch.state.in_(UNBUILT_STATES), Batch.created_at), else_=Batch.ready_at)
    waited = func.extract("epoch", func.now() - since)
    return (
        select(func.json_build_array(Batch.id, Batch.state, waited))
        .where(Batch.job_id == Job.id, Batch.state.in_((*UNBUILT_STATES, BatchState.READY)), since.is_not(None))
        .order_by(waited.desc())
        .limit(1)
        .scalar_subquery()
    )


def _progress_statement() -> Select[Any]:
    """The job progress statement (built once: constructing it costs more CPU than running it)."""
    # The class a transferred model came from: the job's version itself when it is another
    # class's (the job's class had none yet), or the version that one descends from.
    source, source_class = aliased(CostModelVersion), aliased(DeviceClass)
    source_id = case(
        (CostModelVersion.device_class_id != Job.device_class_id, CostModelVersion.id),
        else_=CostModelVersion.transferred_from_id,
    )
    return (
        select(
            Job, Model.name, DeviceClass.name, CostModelVersion.version, CostModelVersion.trained_on, _tasks_json(),
            _curve_json(), source_class.name, source.version, CostModelVersion.device_class_id == Job.device_class_id,
            _live_agents(), _longest_waiting_batch(),
        )  # fmt: skip
        .join(Model, Model.id == Job.model_id)
        .join(DeviceClass, DeviceClass.id == Job.device_class_id)
        .outerjoin(CostModelVersion, CostModelVersion.id == Job.cost_model_version_id)
        .outerjoin(source, source.id == source_id)
        .outerjoin(source_class, source_class.id == source.device_class_id)
        .where(Job.id == bindparam("job_id"), Job.team_id == bindparam("team_id"))
    )


_PROGRESS = _progress_statement()


def job_overview(session: Session, *, team_id: int, job_id: int, fresh_secs: float) -> JobOverview | None:
    """The team's job and its progress in one statement: the job row, its tasks and its
    curve aggregated as JSON by Postgres, and the live agents of its class (heartbeat
    within `fresh_secs`). None: none of the team's jobs."""
    row = session.execute(_PROGRESS, {"job_id": job_id, "team_id": team_id, "fresh_secs": fresh_secs}).one_or_none()
    if row is None:
        return None
    job, model_name, class_name, version, trained_on, tasks, curve, source_class, source_version, own, live, oldest = row
    stalled = StalledBatch(int(oldest[0]), BatchState(oldest[1]), float(oldest[2])) if oldest else None
    return JobOverview(
        job=job, model_name=model_name, class_name=class_name, cost_model_version=version, trained_on=trained_on,
        tasks=tasks, curve=curve, source_class=source_class, source_version=source_version, own_class_model=own,
        live_agents=live, stalled=stalled,
    )  # fmt: skip


@dataclass(frozen=True)
class TaskDetail:
    """What the dashboard's task table adds to a job's progress: the task's FLOPs per call
    and its measurements that are errors, by kind."""

    flops: float
    errors_by_kind: dict[str, int]


def task_details(session: Session, *, job_id: int) -> dict[int, TaskDetail]:
    """Per task position of the job. Unlike `job_overview` this counts the job's error
    measurements (one indexed pass over the job's measurements): for the dashboard's job
    page, not for pollers."""
    flops = dict(
        session.execute(
            select(JobTask.position, WorkloadRow.flops)
            .join(WorkloadRow, WorkloadRow.id == JobTask.workload_id)
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


def task_best_curves(session: Session, *, job_id: int) -> dict[int, list[tuple[int, float]]]:
    """Per task position of the job: its best latency over its trials, as (trial, best
    seconds) points: each trial where the best improved, and its last trial. A trial is
    one of the task's measurements, errors included (as `JobTask.trials` counts them); the
    best is the fastest valid one that counts (`confirmations.counted_clause`: not
    disputed). One statement, a window over the job's measurements (the pass
    `task_details` makes): for the dashboard's job page, not for pollers. A task without a
    valid measurement has no entry."""
    counted = and_(Measurement.error_kind == ErrorKind.NONE, Measurement.cost.is_not(None), counted_clause())
    per_task = {"partition_by": Measurement.job_task_id, "order_by": Measurement.id}
    running = (
        select(
            Measurement.job_task_id,
            func.row_number().over(**per_task).label("trial"),
            func.min(case((counted, Measurement.cost))).over(**per_task).label("best"),
            func.count().over(partition_by=Measurement.job_task_id).label("trials"),
        )
        .where(Measurement.job_id == job_id)
        .subquery()
    )
    before = func.lag(running.c.best).over(partition_by=running.c.job_task_id, order_by=running.c.trial)
    steps = select(running, before.label("before")).subquery()
    rows = session.execute(
        select(JobTask.position, steps.c.trial, steps.c.best)
        .join(JobTask, JobTask.id == steps.c.job_task_id)
        .where(
            steps.c.best.is_not(None),
            or_(steps.c.before.is_(None), steps.c.best < steps.c.before, steps.c.trial == steps.c.trials),
        )
        .order_by(JobTask.position, steps.c.trial)
    )
    curves: dict[int, list[tuple[int, float]]] = {}
    for position, trial, best in rows:
        curves.setdefault(position, []).append((int(trial), float(best)))
    return curves


# -- cancelling, records ----------------------------------------------------------------------


def request_cancel(session: Session, *, job_id: int, at_once: bool, now: datetime | None = None) -> None:
    """Ask the scheduler to stop the job; `at_once` (a job still queued): it is cancelled
    now (`now`, else the database's clock)."""
    values: dict[str, Any] = {"cancel_requested": True}
    if at_once:
        values.update(state=JobState.CANCELLED, finished_at=db_now(now))
    session.execute(update(Job).where(Job.id == job_id).values(**values), execution_options={"synchronize_session": False})


def job_records(session: Session, *, job_id: int) -> Iterator[MeasureRecord]:
    """The job's measurements, oldest first, fetched `RECORDS_FETCH` at a time (for as long
    as the caller iterates, in its transaction)."""
    rows = session.execute(
        select(Measurement.record)
        .where(Measurement.job_id == job_id)
        .order_by(Measurement.id)
        .execution_options(yield_per=RECORDS_FETCH)
    )
    for (record,) in rows:
        yield record_from_json(record)
