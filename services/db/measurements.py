"""Measurements: `record_measurement` (exactly once, only under the sender's active lease),
`record_measurements` (the same for many candidates of a lease in a few statements),
`record_build_error` (a candidate that never reached an agent), `abandon_batch` (error results for
what a batch that cannot be measured still lacks), `candidate_results` (which candidates of a batch
have a result, and under which lease). Every agent's time is checked against the
class's timing floor first (`timing_floor`: below it, an error of kind below_floor); a measurement
that becomes its task's best gets a confirmation batch, whose results are `Confirmation`s
(`confirmations`: the same calls store them).

Every function works inside the caller's transaction and commits nothing itself.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Integer, case, cast, func, or_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

from services.db import confirmations, timing_floor
from services.db.batches import transition_batch, unmeasured_candidates
from services.db.codec import build_from_json, input_from_json, record_to_json
from services.db.exceptions import LeaseNotHeld, RowNotFound
from services.db.leases import held_lease
from services.db.models import (
    Agent,
    Batch,
    BatchCandidate,
    DeviceClass,
    Job,
    JobTask,
    Lease,
    Measurement,
    WorkloadRow,
)
from services.db.states import BatchState
from tunefarm.records import BuildResult, ErrorKind, MeasureRecord, MeasureResult, RunResult


@dataclass(frozen=True)
class Recorded:
    measurement_id: int  # in a confirmation batch: the `Confirmation`'s id
    created: bool  # False: the candidate already had its measurement; nothing was written


def record_measurement(
    session: Session,
    *,
    batch_candidate_id: int,
    lease_id: int,
    agent_id: int,
    record: MeasureRecord,
    fingerprint: Mapping[str, Any],
) -> Recorded:
    """Store an agent's measurement of a candidate, exactly once.

    Refused (`LeaseNotHeld`) unless `lease_id` is active, the agent's, and on the
    candidate's batch. A second write of the same candidate (a retry, a duplicate stream)
    changes nothing and returns the first one's id with `created=False`; the unique
    batch candidate guarantees it under any concurrency. A new measurement advances the
    job's and the task's trial counts and best, and the agent's counters, in the same
    transaction. A time below the class's timing floor is stored as a below_floor error;
    a new best gets a confirmation batch; in a confirmation batch, the result is the
    measurement's `Confirmation` (its id is returned).
    """
    lease = held_lease(session, lease_id=lease_id, agent_id=agent_id, lock=False)
    _candidate_of(session, batch_candidate_id=batch_candidate_id, record=record, lease=lease)
    return _store_results(
        session, batch_id=lease.batch_id, lease=lease, items=[(batch_candidate_id, record)], fingerprint=fingerprint
    )[0]


def record_build_error(
    session: Session, *, batch_candidate_id: int, record: MeasureRecord, fingerprint: Mapping[str, Any]
) -> Recorded:
    """Store the measurement of a candidate whose build failed (written by the build
    worker; no agent, no lease). Exactly once, like `record_measurement`."""
    if not record.error_kind.is_error:
        raise ValueError("record_build_error takes a failed record")
    batch_id = _candidate_of(session, batch_candidate_id=batch_candidate_id, record=record, lease=None)
    return _store_results(
        session, batch_id=batch_id, lease=None, items=[(batch_candidate_id, record)], fingerprint=fingerprint
    )[0]


def _candidate_of(session: Session, *, batch_candidate_id: int, record: MeasureRecord, lease: Lease | None) -> int:
    """The batch of a candidate a record is given for, checked: the candidate exists
    (`RowNotFound`), is on the lease's batch (`LeaseNotHeld`), and is the record's (`ValueError`)."""
    row = session.execute(
        select(BatchCandidate.batch_id, BatchCandidate.candidate_key).where(BatchCandidate.id == batch_candidate_id)
    ).one_or_none()
    if row is None:
        raise RowNotFound(f"batch candidate {batch_candidate_id}")
    if lease is not None and lease.batch_id != row.batch_id:
        raise LeaseNotHeld(f"lease {lease.id} is on batch {lease.batch_id}, not on batch {row.batch_id}")
    if record.candidate.key != row.candidate_key:
        raise ValueError(f"record of {record.candidate.key!r} given for candidate {row.candidate_key!r}")
    return int(row.batch_id)


@dataclass(frozen=True)
class _BatchFacts:
    """What storing a batch's results needs to know of it."""

    job_id: int
    job_task_id: int
    workload_id: int
    device_class_id: int
    confirms_measurement_id: int | None  # a confirmation batch: the measurement it re-measures
    floor: float  # the timing floor of its task on its class (seconds; 0: none)


def _batch_facts(session: Session, batch_id: int) -> _BatchFacts:
    row = session.execute(
        select(
            Batch.job_id,
            Batch.job_task_id,
            Batch.workload_id,
            Batch.device_class_id,
            Batch.confirms_measurement_id,
            WorkloadRow.flops,
            WorkloadRow.io_bytes,
            DeviceClass.target,
        )
        .join(WorkloadRow, WorkloadRow.id == Batch.workload_id)
        .join(DeviceClass, DeviceClass.id == Batch.device_class_id)
        .where(Batch.id == batch_id)
    ).one()
    floor = timing_floor.floor_secs(row.target or {}, flops=row.flops, io_bytes=row.io_bytes)
    return _BatchFacts(
        row.job_id, row.job_task_id, row.workload_id, row.device_class_id, row.confirms_measurement_id, floor
    )


def _store_results(
    session: Session,
    *,
    batch_id: int,
    lease: Lease | None,
    items: Sequence[tuple[int, MeasureRecord]],
    fingerprint: Mapping[str, Any],
) -> list[Recorded]:
    """Store checked results (candidate id, record) of one batch, exactly once each, in
    a handful of statements whatever their number; one `Recorded` per item, in order.
    An agent's times below the floor become below_floor errors first."""
    facts = _batch_facts(session, batch_id)
    agent_id = lease.agent_id if lease is not None else None
    if agent_id is not None:
        items = [(bc_id, timing_floor.checked(rec, facts.floor)) for bc_id, rec in items]
    if facts.confirms_measurement_id is not None:
        stored = confirmations.record_confirmations(
            session,
            measurement_id=facts.confirms_measurement_id,
            agent_id=agent_id,
            lease_id=lease.id if lease is not None else None,
            items=items,
            fingerprint=fingerprint,
        )
        return [Recorded(measurement_id=c.confirmation_id, created=c.created) for c in stored]
    lease_id = lease.id if lease is not None else None
    ids = [bc_id for bc_id, _ in items]
    created, existing = _insert_measurements(session, facts, agent_id, lease_id, items, fingerprint)
    new = [(created[bc_id], rec) for bc_id, rec in items if bc_id in created]
    if new:
        _count_measurements(session, facts=facts, agent_id=agent_id, new=new)
    return [
        Recorded(measurement_id=created[i], created=True)
        if i in created
        else Recorded(measurement_id=existing[i], created=False)
        for i in ids
    ]


def _insert_measurements(
    session: Session,
    facts: _BatchFacts,
    agent_id: int | None,
    lease_id: int | None,
    items: Sequence[tuple[int, MeasureRecord]],
    fingerprint: Mapping[str, Any],
) -> tuple[dict[int, int], dict[int, int]]:
    """Insert the items' measurements, none twice: (candidate id -> new measurement id,
    candidate id -> the measurement stored before for the others)."""
    rows = [
        {
            "batch_candidate_id": bc_id,
            "job_id": facts.job_id,
            "job_task_id": facts.job_task_id,
            "workload_id": facts.workload_id,
            "device_class_id": facts.device_class_id,
            "agent_id": agent_id,
            "lease_id": lease_id,
            "candidate_key": rec.candidate.key,  # the candidate's: checked by every caller
            "cost": rec.cost if math.isfinite(rec.cost) else None,
            "error_kind": rec.error_kind,
            "record": record_to_json(rec),
            "fingerprint": dict(fingerprint),
        }
        for bc_id, rec in items
    ]
    # One statement whatever the number of rows (SQLAlchemy's "insertmanyvalues"), and
    # the same statement every time, so it is compiled once per process.
    created = dict(
        session.execute(
            pg_insert(Measurement)
            .on_conflict_do_nothing(index_elements=[Measurement.batch_candidate_id])
            .returning(Measurement.batch_candidate_id, Measurement.id),
            rows,
        ).all()
    )
    missing = [bc_id for bc_id, _ in items if bc_id not in created]
    if not missing:
        return created, {}
    existing = session.execute(
        select(Measurement.batch_candidate_id, Measurement.id).where(Measurement.batch_candidate_id.in_(missing))
    ).all()
    return created, dict(existing)


def _new_best(cost: float, measurement_id: int, emulated: bool) -> dict[str, Any]:
    """A task's best columns after a valid measurement: it, when it is faster (and
    unconfirmed, until its confirmation comes back)."""
    better = or_(JobTask.best_cost.is_(None), JobTask.best_cost > cost)
    return {
        "best_cost": case((better, cost), else_=JobTask.best_cost),
        "best_measurement_id": case((better, measurement_id), else_=JobTask.best_measurement_id),
        "best_emulated": case((better, emulated), else_=JobTask.best_emulated),
        "best_confirmed": case((better, False), else_=JobTask.best_confirmed),
    }


def _count_measurements(
    session: Session, *, facts: _BatchFacts, agent_id: int | None, new: Sequence[tuple[int, MeasureRecord]]
) -> None:
    """The precomputed progress new measurements (id, record) of one task advance (task,
    job, agent); a new best of the task is scheduled for confirmation."""
    valid = [(r.cost, mid, r.emulated) for mid, r in new if math.isfinite(r.cost)]
    task_values: dict[str, Any] = {"trials": JobTask.trials + len(new)}
    fastest = min(valid) if valid else None
    if fastest is not None:
        task_values.update(_new_best(*fastest))
    opts = {"synchronize_session": False}
    best_id = session.scalar(
        update(JobTask).where(JobTask.id == facts.job_task_id).values(**task_values).returning(JobTask.best_measurement_id),
        execution_options=opts,
    )
    session.execute(
        update(Job).where(Job.id == facts.job_id).values(trials_used=Job.trials_used + len(new)), execution_options=opts
    )
    if agent_id is None:
        return
    _count_agent(session, agent_id=agent_id, new=new)
    if fastest is not None and best_id == fastest[1]:
        confirmations.schedule(session, measurement_id=best_id)


def _count_agent(session: Session, *, agent_id: int, new: Sequence[tuple[int, MeasureRecord]]) -> None:
    agent_values: dict[str, Any] = {"measurements_done": Agent.measurements_done + len(new)}
    errors: dict[str, int] = {}
    for _, rec in new:
        if rec.error_kind.is_error:
            errors[str(rec.error_kind)] = errors.get(str(rec.error_kind), 0) + 1
    if errors:
        pairs: list[Any] = []
        for kind, n in sorted(errors.items()):
            pairs += [kind, func.coalesce(cast(Agent.errors_by_kind[kind].astext, Integer), 0) + n]
        agent_values["errors_by_kind"] = Agent.errors_by_kind.op("||")(func.jsonb_build_object(*pairs))
    below = errors.get(str(ErrorKind.BELOW_FLOOR), 0)
    if below:
        agent_values["below_floor"] = Agent.below_floor + below
    session.execute(
        update(Agent).where(Agent.id == agent_id).values(**agent_values), execution_options={"synchronize_session": False}
    )


def record_measurements(
    session: Session,
    *,
    lease_id: int,
    agent_id: int,
    items: Sequence[tuple[int, MeasureRecord]],
    fingerprint: Mapping[str, Any],
) -> list[Recorded]:
    """`record_measurement` for many candidates of one lease in a handful of statements
    (one lease check, one insert, one update each of the task, the job and the agent),
    whatever their number. Same rules: refused (`LeaseNotHeld`) unless the lease is
    active, the agent's, and on every candidate's batch; exactly once per candidate.
    Returns one `Recorded` per item, in order."""
    if not items:
        return []
    lease = held_lease(session, lease_id=lease_id, agent_id=agent_id, lock=False)
    ids = [bc_id for bc_id, _ in items]
    if len(set(ids)) != len(ids):
        raise ValueError("the same batch candidate twice in one call")
    keys = dict(
        session.execute(
            select(BatchCandidate.id, BatchCandidate.candidate_key).where(
                BatchCandidate.id.in_(ids), BatchCandidate.batch_id == lease.batch_id
            )
        ).all()
    )
    foreign = [i for i in ids if i not in keys]
    if foreign:
        raise LeaseNotHeld(f"lease {lease_id} is on batch {lease.batch_id}, not on candidates {foreign[:5]}")
    for bc_id, rec in items:
        if rec.candidate.key != keys[bc_id]:
            raise ValueError(f"record of {rec.candidate.key!r} given for candidate {keys[bc_id]!r}")
    return _store_results(session, batch_id=lease.batch_id, lease=lease, items=items, fingerprint=fingerprint)


def abandon_batch(
    session: Session,
    *,
    batch_id: int,
    reason: str,
    error_kind: ErrorKind = ErrorKind.RUN_CRASH,
    fingerprint: Mapping[str, Any] | None = None,
    now: datetime | None = None,
) -> int:
    """Give a batch up: each unmeasured candidate gets an error measurement (`error_kind`,
    `reason`; no agent, no lease; in a confirmation batch, an error confirmation: the
    measurement it checks is not confirmed), and the batch fails (ending its active lease). For a
    batch that can never be measured (it was leased again and again and no agent ever
    finished it), so that every candidate still has exactly one result. Returns the
    number of candidates given up; 0 for a batch already done or failed."""
    batch = session.scalars(
        select(Batch).where(Batch.id == batch_id).with_for_update().execution_options(populate_existing=True)
    ).one_or_none()
    if batch is None:
        raise RowNotFound(f"batch {batch_id}")
    if batch.state.is_terminal:
        return 0
    workload_name, target = session.execute(
        select(WorkloadRow.name, DeviceClass.target)
        .join(Batch, Batch.workload_id == WorkloadRow.id)
        .join(DeviceClass, DeviceClass.id == Batch.device_class_id)
        .where(Batch.id == batch_id)
    ).one()
    lost = unmeasured_candidates(session, batch_id=batch_id)
    stamp = time.time()
    items = []
    for cand in lost:
        inp = input_from_json(cand.input)
        run: RunResult | None
        if error_kind in (ErrorKind.BUILD_ERROR, ErrorKind.BUILD_TIMEOUT):
            build, run = BuildResult(cand.candidate_key, None, 0.0, error_kind, reason), None
        else:
            build = build_from_json(cand.build) if cand.build else BuildResult(cand.candidate_key, None, 0.0)
            run = RunResult(cand.candidate_key, (), 0.0, error_kind, reason)
        items.append((cand.id, MeasureRecord.of(MeasureResult(inp, build, run), workload=workload_name, target=target, timestamp=stamp)))
    if items:
        _store_results(session, batch_id=batch_id, lease=None, items=items, fingerprint=dict(fingerprint or {}))
    transition_batch(session, batch_id=batch_id, to=BatchState.FAILED, build_error=reason, now=now)
    return len(lost)


@dataclass(frozen=True)
class CandidateResult:
    """A batch candidate and its measurement, if it has one."""

    id: int
    input: dict[str, Any]
    build: dict[str, Any] | None
    measurement_id: int | None  # None: not measured yet
    lease_id: int | None  # the measurement's lease (None: not measured, or given up)


def candidate_results(session: Session, *, batch_id: int) -> list[CandidateResult]:
    """Every candidate of the batch, with its measurement's id and lease."""
    rows = session.execute(
        select(
            BatchCandidate.id,
            BatchCandidate.input,
            BatchCandidate.build,
            Measurement.id.label("measurement_id"),
            Measurement.lease_id,
        )
        .outerjoin(Measurement, Measurement.batch_candidate_id == BatchCandidate.id)
        .where(BatchCandidate.batch_id == batch_id)
    ).all()
    return [CandidateResult(r.id, r.input, r.build, r.measurement_id, r.lease_id) for r in rows]
