"""A job's run (the scheduler's side of jobs): small keyword-only functions over the
caller's session (`services.db.session.transaction`), none of which commits.

- picking jobs: `runnable_jobs`, `claim_job` (queued -> running, with everything the
  job's session needs: `JobSetup`; None for a job no longer runnable);
- resuming: `last_measurement_id`, `job_records` (the job's measurements in id order);
- transfer: `best_records_of_class` (another class's best programs of the job's workloads);
- progress: `write_progress` (a curve point and the job's estimate), `set_dead_reasons`,
  `note_cost_model`;
- fairness: `live_agents_by_class`, `running_jobs`;
- ending: `cancel_requests`, `fail_open_batches`, `set_job_state`, `finish_job`;
  `open_confirmations` and `confirmed_keys` (the tuned model uses confirmed bests only,
  `services.db.confirmations`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

from services.db import batches, liveness, trust
from services.db.codec import record_from_json
from services.db.confirmations import believed_clause, counted_clause
from services.db.exceptions import InvalidTransition
from services.db.models import (
    Agent,
    Batch,
    DeviceClass,
    Job,
    JobProgress,
    JobTask,
    Measurement,
    Model,
    WorkloadRow,
)
from services.db.states import BatchState, ConfirmationState, JobState
from tunefarm.records import ErrorKind, MeasureRecord

RUNNABLE = (JobState.QUEUED, JobState.RUNNING, JobState.FINISHING)


@dataclass(frozen=True)
class JobTaskRow:
    id: int
    task_key: str
    workload_key: str
    position: int
    weight: int
    alternative_of: int | None = None  # the id of the task row this is an alternative of


@dataclass(frozen=True)
class JobSetup:
    """What a job's session is built from (a snapshot, read when the job is claimed)."""

    job_id: int
    state: JobState  # after claiming: running or finishing
    trial_budget: int
    latency_target_secs: float | None
    config: dict[str, Any]
    device_class_id: int
    device_class: str
    target: dict[str, Any]
    model_id: int
    model_name: str
    onnx_path: str
    fused_path: str
    inputs: list[dict[str, Any]]
    outputs: list[dict[str, Any]]
    warnings: list[str]
    tasks: tuple[JobTaskRow, ...]
    cost_model_version_id: int | None
    start_model_trained_on: int | None


@dataclass(frozen=True)
class RunnableJob:
    id: int
    state: JobState
    cancel_requested: bool
    device_class_id: int


def runnable_jobs(session: Session, *, limit: int) -> list[RunnableJob]:
    """Jobs a scheduler should be running (queued, running or finishing), oldest first."""
    rows = session.execute(
        select(Job.id, Job.state, Job.cancel_requested, Job.device_class_id)
        .where(Job.state.in_(RUNNABLE))
        .order_by(Job.id)
        .limit(limit)
    ).all()
    return [RunnableJob(r.id, r.state, r.cancel_requested, r.device_class_id) for r in rows]


def claim_job(session: Session, *, job_id: int) -> JobSetup | None:
    """Start (or take over after a restart) a job: queued becomes running with its start
    time; running and finishing stay as they are. None (nothing changed) if the job is
    gone or no longer runnable."""
    job = session.scalars(select(Job).where(Job.id == job_id).with_for_update()).one_or_none()
    if job is None or job.state not in RUNNABLE:
        return None
    if job.state is JobState.QUEUED:
        session.execute(
            update(Job)
            .where(Job.id == job_id)
            .values(state=JobState.RUNNING, started_at=func.coalesce(Job.started_at, func.now())),
            execution_options={"synchronize_session": False},
        )
        state = JobState.RUNNING
    else:
        state = job.state
    model = session.get_one(Model, job.model_id)
    device_class = session.get_one(DeviceClass, job.device_class_id)
    tasks = session.execute(
        select(JobTask.id, JobTask.task_key, WorkloadRow.key, JobTask.position, JobTask.weight, JobTask.alternative_of)
        .join(WorkloadRow, WorkloadRow.id == JobTask.workload_id)
        .where(JobTask.job_id == job_id)
        .order_by(JobTask.position)
    ).all()
    return JobSetup(
        job_id=job.id,
        state=state,
        trial_budget=job.trial_budget,
        latency_target_secs=job.latency_target_secs,
        config=dict(job.config),
        device_class_id=device_class.id,
        device_class=device_class.name,
        target=dict(device_class.target),
        model_id=model.id,
        model_name=model.name,
        onnx_path=model.onnx_path,
        fused_path=model.fused_path,
        inputs=list(model.inputs),
        outputs=list(model.outputs),
        warnings=[str(w) for w in model.warnings],
        tasks=tuple(JobTaskRow(*t) for t in tasks),
        cost_model_version_id=job.cost_model_version_id,
        start_model_trained_on=job.start_model_trained_on,
    )


def job_records(session: Session, *, job_id: int) -> list[MeasureRecord]:
    """Every measurement of the job, in the order they were stored."""
    rows = session.scalars(select(Measurement.record).where(Measurement.job_id == job_id).order_by(Measurement.id))
    return [record_from_json(r) for r in rows]


def best_records_of_class(
    session: Session, *, device_class: str, workload_keys: Iterable[str], per_workload: int
) -> list[MeasureRecord]:
    """The `per_workload` fastest valid measurements of each workload in `workload_keys`
    made on the class named `device_class`, from any job (the programs a class that
    starts from it tries first): measurements vouched for (their agent is in good
    standing, `services.db.trust`) that nothing discredited."""
    keys = list(workload_keys)
    if not keys or per_workload < 1:
        return []
    ranked = (
        select(
            Measurement.record,
            func.row_number()
            .over(partition_by=Measurement.workload_id, order_by=(Measurement.cost, Measurement.id))
            .label("rank"),
        )
        .join(WorkloadRow, WorkloadRow.id == Measurement.workload_id)
        .join(DeviceClass, DeviceClass.id == Measurement.device_class_id)
        .where(
            DeviceClass.name == device_class,
            WorkloadRow.key.in_(keys),
            Measurement.error_kind == ErrorKind.NONE,
            Measurement.cost.is_not(None),
            Measurement.vouched_seq.is_not(None),
            believed_clause(),
        )
        .subquery()
    )
    rows = session.scalars(select(ranked.c.record).where(ranked.c.rank <= per_workload))
    return [r for r in map(record_from_json, rows) if r.is_valid and not r.emulated]


def last_measurement_id(session: Session, *, job_id: int) -> int:
    """The job's newest measurement id (0: none yet)."""
    return int(session.scalar(select(func.coalesce(func.max(Measurement.id), 0)).where(Measurement.job_id == job_id)) or 0)


def note_cost_model(
    session: Session,
    *,
    job_id: int,
    version_id: int | None = None,
    trained_on: int | None = None,
    pretrained: dict[str, Any] | None = None,
) -> None:
    """Record the class model version the job starts from and the pretrained base under
    it (each once), and (once) how many programs the model had learnt from when its
    first batch was ranked."""
    if version_id is not None:
        session.execute(
            update(Job).where(Job.id == job_id, Job.cost_model_version_id.is_(None)).values(cost_model_version_id=version_id)
        )
    if pretrained is not None:
        session.execute(
            update(Job).where(Job.id == job_id, Job.cost_model_pretrained.is_(None)).values(cost_model_pretrained=pretrained)
        )
    if trained_on is not None:
        session.execute(
            update(Job).where(Job.id == job_id, Job.start_model_trained_on.is_(None)).values(start_model_trained_on=trained_on)
        )


def write_progress(session: Session, *, job_id: int, trials: int, est_latency_secs: float | None) -> None:
    """A point of the job's curve (replacing one at the same trial count), the job's
    current estimate, and its first complete estimate if it has none yet."""
    elapsed = select(func.coalesce(func.extract("epoch", func.now() - Job.started_at), 0.0)).where(
        Job.id == job_id
    ).scalar_subquery()
    point = pg_insert(JobProgress).values(
        job_id=job_id, trials=trials, elapsed_secs=elapsed, est_latency_secs=est_latency_secs
    )
    session.execute(
        point.on_conflict_do_update(
            index_elements=[JobProgress.job_id, JobProgress.trials],
            set_={"elapsed_secs": point.excluded.elapsed_secs, "est_latency_secs": point.excluded.est_latency_secs},
        )
    )
    values: dict[str, Any] = {"est_latency_secs": est_latency_secs}
    if est_latency_secs is not None:
        values["est_latency_start_secs"] = func.coalesce(Job.est_latency_start_secs, est_latency_secs)
    session.execute(update(Job).where(Job.id == job_id).values(**values))


def set_dead_reasons(session: Session, *, job_id: int, reasons: Mapping[str, str]) -> None:
    """Why the search gave tasks up (task key -> reason)."""
    for key, reason in reasons.items():
        session.execute(
            update(JobTask)
            .where(JobTask.job_id == job_id, JobTask.task_key == key, JobTask.dead_reason.is_distinct_from(reason))
            .values(dead_reason=reason)
        )


def live_agents_by_class(session: Session, *, fresh_secs: float) -> dict[int, int]:
    """Agents per device class that are live (`services.db.liveness`: idle or busy,
    heartbeated within `fresh_secs`) and may be leased work: a flagged agent heartbeats
    but is leased nothing (`leases.lease_withheld`), so it neither earns its class a
    fair share of batches nor keeps a model run waiting for it."""
    rows = session.execute(
        select(Agent.device_class_id, func.count())
        .where(liveness.live_clause(fresh_secs), ~trust.flagged_clause())
        .group_by(Agent.device_class_id)
    ).all()
    return {int(c): int(n) for c, n in rows}


@dataclass(frozen=True)
class RunningJob:
    id: int
    device_class_id: int
    team_id: int


def running_jobs(session: Session) -> list[RunningJob]:
    """Every running job, whichever scheduler runs it."""
    rows = session.execute(
        select(Job.id, Job.device_class_id, Job.team_id).where(Job.state == JobState.RUNNING).order_by(Job.id)
    ).all()
    return [RunningJob(int(j), int(c), int(t)) for j, c, t in rows]


def cancel_requests(session: Session, *, job_ids: Iterable[int]) -> set[int]:
    ids = list(job_ids)
    if not ids:
        return set()
    return set(session.scalars(select(Job.id).where(Job.id.in_(ids), Job.cancel_requested)))


def fail_open_batches(session: Session, *, job_id: int, reason: str) -> int:
    """End every batch of the job that is not done: agents and build workers stop
    spending time on it (their results are refused from now on). Returns how many."""
    open_ids = list(
        session.scalars(
            select(Batch.id)
            .where(Batch.job_id == job_id, Batch.state.not_in([BatchState.DONE, BatchState.FAILED]))
            .order_by(Batch.id)
        )
    )
    n = 0
    for batch_id in open_ids:
        try:
            batches.transition_batch(session, batch_id=batch_id, to=BatchState.FAILED, build_error=reason)
            n += 1
        except InvalidTransition:  # finished meanwhile
            pass
    return n


def set_job_state(session: Session, *, job_id: int, state: JobState, error: str | None = None) -> None:
    values: dict[str, Any] = {"state": state}
    if error is not None:
        values["error"] = error[:2000]
    if state.is_terminal:
        values["finished_at"] = func.now()
    session.execute(update(Job).where(Job.id == job_id).values(**values))


def finish_job(
    session: Session,
    *,
    job_id: int,
    artifact_path: str,
    artifact_sha256: str,
    artifact_size: int,
    result: dict[str, Any],
) -> None:
    """The job succeeded: its tuned model archive and summary."""
    session.execute(
        update(Job)
        .where(Job.id == job_id, Job.state.in_([JobState.RUNNING, JobState.FINISHING]))
        .values(
            state=JobState.SUCCEEDED,
            artifact_path=artifact_path,
            artifact_sha256=artifact_sha256,
            artifact_size=artifact_size,
            result=result,
            finished_at=func.now(),
        )
    )


def open_confirmations(session: Session, *, job_id: int) -> int:
    """The job's confirmation batches not finished yet (their bests are not decided)."""
    return int(
        session.scalar(
            select(func.count())
            .select_from(Batch)
            .where(
                Batch.job_id == job_id,
                Batch.confirms_measurement_id.is_not(None),
                Batch.state.not_in([BatchState.DONE, BatchState.FAILED]),
            )
        )
        or 0
    )


def confirmed_keys(session: Session, *, job_id: int) -> dict[str, set[str]]:
    """The candidates of each of the job's tasks (by task key) whose time was confirmed,
    and counts (not an unconfirmed one of a quarantined agent)."""
    rows = session.execute(
        select(JobTask.task_key, Measurement.candidate_key)
        .join(Measurement, Measurement.job_task_id == JobTask.id)
        .where(
            JobTask.job_id == job_id,
            Measurement.confirmation == ConfirmationState.CONFIRMED,
            counted_clause(),
        )
    ).all()
    out: dict[str, set[str]] = {}
    for task_key, candidate_key in rows:
        out.setdefault(task_key, set()).add(candidate_key)
    return out
