"""Confirming a task's best: a second measurement of the same kernel before it counts.

One agent with a valid token could otherwise report any time it likes and make every
team's job on its class "succeed" with its kernels. So a measurement that becomes its
task's best (`measurements.record_measurements` sees it win) is measured again, through the
normal batch path:

    schedule(m)             a confirmation batch: one candidate, the same built kernel
                            (its artifact, input and build copied), ready at once, with
                            `avoid_agent_id` = m's agent; m is `pending`
    lease_next_batch        leases it to an agent of the class of another party (another
                            token: `trust.same_party`) that may confirm (not flagged, not
                            quarantined) when one is live, else (only then) to m's own
                            party, on a later lease
    record_confirmations    the result is a `Confirmation` row (exactly once per
                            candidate, like a measurement; never a second measurement of
                            the job), judged by `trust.verdict`: m becomes confirmed,
                            disputed or failed; the agents' counters follow
    refresh_task_best       the task's best is again its fastest measurement that is not
                            disputed, failed, or an unconfirmed one of a quarantined
                            agent; when that one was never confirmed (and its job has
                            not ended) it is scheduled in turn. `confirmed_*` is the
                            fastest confirmed one.

The job's result and tuned model use confirmed bests only (`services.scheduler`).

Training: the class's cost model learns a measurement once it is vouched for (`vouch`):
numbered in `Measurement.vouched_seq` when its agent is in good standing (`trust`), so
an agent's measurements made before its first confirmed timing are learnt then, and a
flagged or quarantined agent's are not learnt at all. Vouching takes a per-class
advisory lock, so numbers become visible in order and a reader's cursor skips none.

Lock order: the measurement under confirmation (FOR UPDATE), then its confirmation row,
then job tasks, then agents: the order `services.db` keeps (measurements -> confirmations ->
job_tasks -> jobs -> model_runs -> agents). `schedule` updates the measurement it
schedules (`WHERE confirmation IS NULL`): one of the caller's own, just inserted, or one
no confirmation is in flight for.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, Row, and_, exists, func, insert, or_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

from services.db.codec import record_to_json
from services.db.models import (
    MEASUREMENT_VOUCH_SEQ,
    Agent,
    Batch,
    BatchCandidate,
    Confirmation,
    Job,
    JobTask,
    Measurement,
)
from services.db.statements import db_now
from services.db.states import BatchState, ConfirmationState, JobState
from services.db.trust import good_standing_clause, same_party, verdict
from tunefarm.records import ErrorKind, MeasureRecord

VOUCH_LOCK_NAMESPACE = 0x74660003
"""First key of the per-class advisory lock `vouch` takes (`pg_advisory_xact_lock`)."""

_USABLE = (ConfirmationState.PENDING, ConfirmationState.CONFIRMED)
"""Confirmation states a measurement may be its task's best in (besides never asked)."""


@dataclass(frozen=True)
class Stored:
    confirmation_id: int
    created: bool  # False: the candidate already had its confirmation; nothing was written


# -- scheduling -------------------------------------------------------------------------------


def schedule(session: Session, *, measurement_id: int, now: datetime | None = None) -> int | None:
    """Queue a confirmation of an agent's measurement (see the module doc); its batch id,
    or None when it has one already (or no agent measured it)."""
    row = _measured_candidate(session, measurement_id)
    if row.agent_id is None:
        return None
    marked = session.scalar(
        update(Measurement)
        .where(Measurement.id == measurement_id, Measurement.confirmation.is_(None))
        .values(confirmation=ConfirmationState.PENDING)
        .returning(Measurement.id)
    )
    if marked is None:
        return None
    at = db_now(now)
    batch_id = session.scalar(
        insert(Batch)
        .values(
            job_id=row.job_id,
            job_task_id=row.job_task_id,
            workload_id=row.workload_id,
            device_class_id=row.device_class_id,
            state=BatchState.READY,
            timing=row.timing,
            build_timeout_secs=row.build_timeout_secs,
            run_timeout_secs=row.run_timeout_secs,
            confirms_measurement_id=measurement_id,
            avoid_agent_id=row.agent_id,
            ready_at=at,
        )
        .returning(Batch.id)
    )
    session.execute(
        insert(BatchCandidate).values(
            batch_id=batch_id,
            position=0,
            candidate_key=row.candidate_key,
            input=row.input,
            artifact_path=row.artifact_path,
            artifact_signature=row.artifact_signature,  # made for the original candidate
            build=row.build,
        )
    )
    return batch_id


def _measured_candidate(session: Session, measurement_id: int) -> Row[Any]:
    """What a confirmation batch copies from the measurement it checks: its agent, job,
    task, workload and class, its candidate (input, artifact, build) and its batch's timing."""
    return session.execute(
        select(
            Measurement.agent_id,
            Measurement.job_id,
            Measurement.job_task_id,
            Measurement.workload_id,
            Measurement.device_class_id,
            BatchCandidate.candidate_key,
            BatchCandidate.input,
            BatchCandidate.artifact_path,
            BatchCandidate.artifact_signature,
            BatchCandidate.build,
            Batch.timing,
            Batch.build_timeout_secs,
            Batch.run_timeout_secs,
        )
        .join(BatchCandidate, BatchCandidate.id == Measurement.batch_candidate_id)
        .join(Batch, Batch.id == BatchCandidate.batch_id)
        .where(Measurement.id == measurement_id)
    ).one()


# -- results ----------------------------------------------------------------------------------


def record_confirmations(
    session: Session,
    *,
    measurement_id: int,
    agent_id: int | None,
    lease_id: int | None,
    items: Sequence[tuple[int, MeasureRecord]],
    fingerprint: Mapping[str, Any],
    now: datetime | None = None,
) -> list[Stored]:
    """Store the results of a confirmation batch's candidates (checked by the caller:
    they are the batch's, under a lease the agent holds) and judge the measurement they
    confirm. `agent_id` None: the batch was given up (the results are errors)."""
    out = []
    for bc_id, record in items:
        claimed = session.execute(
            select(Measurement.cost, Measurement.agent_id, Measurement.confirmation, Measurement.job_task_id)
            .where(Measurement.id == measurement_id)
            .with_for_update()
        ).one()
        outcome = (
            verdict(claimed.cost, record, same_party=_same_party(session, agent_id, claimed.agent_id))
            if claimed.cost is not None and agent_id is not None
            else ConfirmationState.FAILED
        )
        new_id = session.scalar(
            pg_insert(Confirmation)
            .values(
                batch_candidate_id=bc_id,
                measurement_id=measurement_id,
                agent_id=agent_id,
                lease_id=lease_id,
                cost=record.cost if math.isfinite(record.cost) else None,
                error_kind=record.error_kind,
                outcome=outcome,
                record=record_to_json(record),
                fingerprint=dict(fingerprint),
            )
            .on_conflict_do_nothing(index_elements=[Confirmation.batch_candidate_id])
            .returning(Confirmation.id)
        )
        if new_id is None:
            existing = session.scalar(select(Confirmation.id).where(Confirmation.batch_candidate_id == bc_id))
            assert existing is not None
            out.append(Stored(existing, created=False))
            continue
        out.append(Stored(new_id, created=True))
        if claimed.confirmation in (None, ConfirmationState.PENDING):
            _judge(session, measurement_id=measurement_id, outcome=outcome, confirmer_id=agent_id)
            refresh_task_best(session, job_task_id=claimed.job_task_id, now=now)
            _count(session, measured_by=claimed.agent_id, outcome=outcome)
        _count_confirmer(session, agent_id=agent_id, record=record)
    return out


def _same_party(session: Session, confirmer_id: int, measured_by: int | None) -> bool:
    """The confirming agent and the measuring one are one party (`trust.same_party`): the
    same agent, or two of one token, whose word on each other is no evidence."""
    if measured_by is None:
        return False
    rows = session.execute(select(Agent.id, Agent.token_id).where(Agent.id.in_(sorted({confirmer_id, measured_by}))))
    tokens = {agent_id: token_id for agent_id, token_id in rows}
    return same_party((confirmer_id, tokens.get(confirmer_id)), (measured_by, tokens.get(measured_by)))


def _judge(session: Session, *, measurement_id: int, outcome: ConfirmationState, confirmer_id: int | None) -> None:
    session.execute(
        update(Measurement)
        .where(Measurement.id == measurement_id)
        .values(
            confirmation=outcome,
            confirmed_by_agent_id=confirmer_id if outcome is ConfirmationState.CONFIRMED else None,
        ),
        execution_options={"synchronize_session": False},
    )


def _count(session: Session, *, measured_by: int | None, outcome: ConfirmationState) -> None:
    """The measured agent's confirmation counters."""
    column = {
        ConfirmationState.CONFIRMED: "confirmations_agreed",
        ConfirmationState.DISPUTED: "confirmations_disputed",
    }.get(outcome)
    if measured_by is None or column is None:
        return
    session.execute(
        update(Agent).where(Agent.id == measured_by).values({column: getattr(Agent, column) + 1}),
        execution_options={"synchronize_session": False},
    )


def _count_confirmer(session: Session, *, agent_id: int | None, record: MeasureRecord) -> None:
    """A confirming agent's time below the floor counts against it, as a measurement's does."""
    if agent_id is None or record.error_kind is not ErrorKind.BELOW_FLOOR:
        return
    session.execute(
        update(Agent).where(Agent.id == agent_id).values(below_floor=Agent.below_floor + 1),
        execution_options={"synchronize_session": False},
    )


# -- a task's best ----------------------------------------------------------------------------


def _quarantined_unconfirmed() -> ColumnElement[bool]:
    quarantined = exists().where(Agent.id == Measurement.agent_id, Agent.quarantined_at.is_not(None))
    return and_(Measurement.confirmation.is_distinct_from(ConfirmationState.CONFIRMED), quarantined)


def counted_clause() -> ColumnElement[bool]:
    """A measurement that may be its task's best: not disputed or failed, and not an
    unconfirmed one of a quarantined agent."""
    usable = or_(Measurement.confirmation.is_(None), Measurement.confirmation.in_(_USABLE))
    return and_(usable, ~_quarantined_unconfirmed())


def believed_clause() -> ColumnElement[bool]:
    """A measurement whose time may teach a cost model or seed a search: not disputed,
    and not an unconfirmed one of a quarantined agent."""
    return and_(Measurement.confirmation.is_distinct_from(ConfirmationState.DISPUTED), ~_quarantined_unconfirmed())


def refresh_task_best(session: Session, *, job_task_id: int, now: datetime | None = None) -> None:
    """Recompute a task's best and confirmed best from its measurements (after a
    confirmation, or a quarantine); a best never confirmed is scheduled for it."""
    valid = and_(
        Measurement.job_task_id == job_task_id,
        Measurement.error_kind == ErrorKind.NONE,
        Measurement.cost.is_not(None),
        counted_clause(),
    )

    def fastest(*where: ColumnElement[bool]) -> Any:
        return session.execute(
            select(Measurement.id, Measurement.cost, Measurement.confirmation, Measurement.record["emulated"])
            .where(valid, *where)
            .order_by(Measurement.cost, Measurement.id)
            .limit(1)
        ).one_or_none()

    best = fastest()
    confirmed = fastest(Measurement.confirmation == ConfirmationState.CONFIRMED)
    if best is not None and best.confirmation is None and _job_open(session, job_task_id):
        schedule(session, measurement_id=best.id, now=now)
    session.execute(
        update(JobTask)
        .where(JobTask.id == job_task_id)
        .values(
            best_cost=best.cost if best else None,
            best_measurement_id=best.id if best else None,
            best_emulated=bool(best and best[3]),
            best_confirmed=bool(best and best.confirmation is ConfirmationState.CONFIRMED),
            confirmed_cost=confirmed.cost if confirmed else None,
            confirmed_measurement_id=confirmed.id if confirmed else None,
        ),
        execution_options={"synchronize_session": False},
    )


def _job_open(session: Session, job_task_id: int) -> bool:
    """The task's job may still use a confirmation (it has not ended)."""
    state = session.scalar(select(Job.state).join(JobTask, JobTask.job_id == Job.id).where(JobTask.id == job_task_id))
    return state is not None and not state.is_terminal


# -- quarantine -------------------------------------------------------------------------------


def forget_agent(session: Session, *, agent_id: int, now: datetime | None = None) -> list[int]:
    """A quarantined agent's word counts for nothing: confirmations it gave (of others'
    measurements, or of its own) are undone, and the bests of the tasks it measured or
    confirmed are recomputed (`refresh_agent_tasks`). Returns those tasks' ids."""
    undone = session.scalars(
        update(Measurement)
        .where(Measurement.confirmed_by_agent_id == agent_id)
        .values(confirmation=None, confirmed_by_agent_id=None)
        .returning(Measurement.job_task_id)
    )
    return refresh_agent_tasks(session, agent_id=agent_id, also=set(undone), now=now)


def refresh_agent_tasks(
    session: Session, *, agent_id: int, also: Iterable[int] = (), now: datetime | None = None
) -> list[int]:
    """Recompute the bests of the unfinished jobs' tasks the agent measured (and of the
    tasks `also`), after its standing changed; their ids."""
    measured = select(Measurement.job_task_id).where(Measurement.agent_id == agent_id)
    tasks = sorted(
        session.scalars(
            select(JobTask.id)
            .join(Job, Job.id == JobTask.job_id)
            .where(
                or_(JobTask.id.in_(measured), JobTask.id.in_(sorted(set(also)))),
                Job.state.in_([state for state in JobState if not state.is_terminal]),
            )
        )
    )
    for job_task_id in tasks:
        refresh_task_best(session, job_task_id=job_task_id, now=now)
    return tasks


# -- training ---------------------------------------------------------------------------------


def vouch(session: Session, *, device_class_id: int) -> int:
    """Number the class's measurements not vouched for yet whose agent is in good
    standing (or that no agent timed: build errors), so the class's cost model learns
    them; a time below the floor or disputed never is. Returns how many."""
    session.execute(select(func.pg_advisory_xact_lock(VOUCH_LOCK_NAMESPACE, device_class_id & 0x7FFFFFFF)))
    believed = select(Agent.id).where(Agent.device_class_id == device_class_id, good_standing_clause())
    return len(
        list(
            session.scalars(
                update(Measurement)
                .where(
                    Measurement.device_class_id == device_class_id,
                    Measurement.vouched_seq.is_(None),
                    Measurement.error_kind != ErrorKind.BELOW_FLOOR,
                    Measurement.confirmation.is_distinct_from(ConfirmationState.DISPUTED),
                    or_(Measurement.agent_id.is_(None), Measurement.agent_id.in_(believed)),
                )
                .values(vouched_seq=MEASUREMENT_VOUCH_SEQ.next_value())
                .returning(Measurement.id)
            )
        )
    )


__all__ = [
    "Stored",
    "schedule",
    "record_confirmations",
    "refresh_task_best",
    "counted_clause",
    "believed_clause",
    "forget_agent",
    "refresh_agent_tasks",
    "vouch",
]
