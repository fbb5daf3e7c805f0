"""A batch's life: the state machine (`BATCH_TRANSITIONS`, `transition_batch`), `mark_batch_ready`,
`unmeasured_candidates`, and ending a batch's active lease; a build worker's side of it
(`claim_for_build`, `build_source`, `set_builds`), and `lock_batch`, `overleased_batches`.

Every function works inside the caller's transaction and commits nothing itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import exists, select, text, update
from sqlalchemy.orm import Session

from services.db.exceptions import InvalidTransition, RowNotFound
from services.db.models import (
    Batch,
    BatchCandidate,
    Confirmation,
    DeviceClass,
    Lease,
    Measurement,
    WorkloadRow,
)
from services.db.statements import db_now
from services.db.states import BatchState, LeaseState

BATCH_TRANSITIONS: Mapping[BatchState, frozenset[BatchState]] = {
    BatchState.PROPOSED: frozenset({BatchState.BUILDING, BatchState.FAILED}),
    # back to proposed: the build worker died and the build is queued again
    BatchState.BUILDING: frozenset(
        {BatchState.PROPOSED, BatchState.READY, BatchState.DONE, BatchState.FAILED}
    ),
    BatchState.READY: frozenset({BatchState.LEASED, BatchState.FAILED}),
    # back to ready: the lease expired or ended with candidates unmeasured
    BatchState.LEASED: frozenset({BatchState.READY, BatchState.DONE, BatchState.FAILED}),
    BatchState.DONE: frozenset(),
    BatchState.FAILED: frozenset(),
}
"""The batch states each state may move to."""


def transition_batch(
    session: Session,
    *,
    batch_id: int,
    to: BatchState,
    build_error: str | None = None,
    now: datetime | None = None,
) -> Batch:
    """Move a batch to `to` if `BATCH_TRANSITIONS` allows it from its current state.

    Entering ready sets `ready_at` the first time (its place in the queue), entering done
    or failed sets `finished_at`, and leaving leased ends the batch's active lease (a
    failed or cancelled batch takes no more results). Raises `RowNotFound`, `InvalidTransition`.
    """
    batch = session.scalars(
        select(Batch).where(Batch.id == batch_id).with_for_update().execution_options(populate_existing=True)
    ).one_or_none()
    if batch is None:
        raise RowNotFound(f"batch {batch_id}")
    if to not in BATCH_TRANSITIONS[batch.state]:
        raise InvalidTransition(f"batch {batch_id}: {batch.state} -> {to}")
    values: dict[str, Any] = {"state": to}
    if to is BatchState.READY and batch.ready_at is None:
        values["ready_at"] = db_now(now)
    if to.is_terminal:
        values["finished_at"] = db_now(now)
    if build_error is not None:
        values["build_error"] = build_error
    if batch.state is BatchState.LEASED:
        end_active_lease(session, batch_id=batch_id, state=LeaseState.EXPIRED, now=now)
    return session.scalars(
        update(Batch).where(Batch.id == batch_id).values(**values).returning(Batch),
        execution_options={"populate_existing": True},
    ).one()


def mark_batch_ready(session: Session, *, batch_id: int, now: datetime | None = None) -> BatchState:
    """A built batch joins its class's queue; one with nothing left to measure (every build
    failed and was recorded) is done instead. Returns the state reached."""
    session.execute(select(Batch.id).where(Batch.id == batch_id).with_for_update())
    to = BatchState.READY if unmeasured_candidates(session, batch_id=batch_id) else BatchState.DONE
    return transition_batch(session, batch_id=batch_id, to=to, now=now).state


def unmeasured_candidates(session: Session, *, batch_id: int) -> list[BatchCandidate]:
    """The batch's candidates without a measurement (or, in a confirmation batch, a
    confirmation), in proposal order (what an agent runs)."""
    measured = exists().where(Measurement.batch_candidate_id == BatchCandidate.id)
    confirmed = exists().where(Confirmation.batch_candidate_id == BatchCandidate.id)
    return list(
        session.scalars(
            select(BatchCandidate)
            .where(BatchCandidate.batch_id == batch_id, ~measured, ~confirmed)
            .order_by(BatchCandidate.position, BatchCandidate.id)
        )
    )


def end_active_lease(
    session: Session, *, batch_id: int, state: LeaseState, now: datetime | None, only_expired: bool = False
) -> int | None:
    """End the batch's active lease (the caller holds the batch's lock); its id, or None."""
    at = db_now(now)
    where = [Lease.batch_id == batch_id, Lease.state == LeaseState.ACTIVE]
    if only_expired:
        where.append(Lease.expires_at < at)
    return session.scalars(
        update(Lease).where(*where).values(state=state, finished_at=at).returning(Lease.id)
    ).one_or_none()


def lock_batch(session: Session, *, batch_id: int) -> BatchState | None:
    """The batch's state, its row locked FOR UPDATE (None: there is no such batch)."""
    return session.scalar(select(Batch.state).where(Batch.id == batch_id).with_for_update())


def overleased_batches(session: Session, *, min_attempts: int, limit: int) -> list[tuple[int, int]]:
    """(id, attempts) of the first `limit` ready batches leased `min_attempts` times or more."""
    rows = session.execute(
        select(Batch.id, Batch.attempts)
        .where(Batch.state == BatchState.READY, Batch.attempts >= min_attempts)
        .order_by(Batch.id)
        .limit(limit)
    ).all()
    return [(batch_id, attempts) for batch_id, attempts in rows]


def workload_and_target(session: Session, *, batch_id: int) -> tuple[str, dict[str, Any]]:
    """The name of the batch's workload and its device class's target."""
    name, target = session.execute(
        select(WorkloadRow.name, DeviceClass.target)
        .join(Batch, Batch.workload_id == WorkloadRow.id)
        .join(DeviceClass, DeviceClass.id == Batch.device_class_id)
        .where(Batch.id == batch_id)
    ).one()
    return name, target


# -- a build worker's side ------------------------------------------------------------------


def claim_for_build(session: Session, *, batch_id: int) -> Batch | None:
    """The batch, locked FOR UPDATE (None: there is no such batch); a proposed one moves to
    building. A batch in any other state is returned as it is."""
    batch = session.scalars(select(Batch).where(Batch.id == batch_id).with_for_update()).one_or_none()
    if batch is not None and batch.state is BatchState.PROPOSED:
        transition_batch(session, batch_id=batch_id, to=BatchState.BUILDING)
    return batch


@dataclass(frozen=True)
class BuildSource:
    """What a batch's builds are made from, besides its candidates."""

    workload_name: str
    module_json: str | None  # the workload's IRModule JSON; None when not asked for
    target: dict[str, Any]  # its device class's


def build_source(session: Session, *, batch: Batch, with_module: bool) -> BuildSource:
    """The batch's workload name (and IRModule JSON when `with_module`) and its class's target."""
    name = session.scalar(select(WorkloadRow.name).where(WorkloadRow.id == batch.workload_id))
    module_json = (
        session.scalar(select(WorkloadRow.module_json).where(WorkloadRow.id == batch.workload_id))
        if with_module
        else None
    )
    target = session.scalar(select(DeviceClass.target).where(DeviceClass.id == batch.device_class_id))
    return BuildSource(str(name), module_json, dict(target or {}))


_SET_BUILDS = text(
    "UPDATE batch_candidates AS bc SET artifact_path = v.path, build = CAST(v.build AS jsonb), "
    "artifact_signature = v.signature "
    "FROM unnest(CAST(:ids AS bigint[]), CAST(:paths AS text[]), CAST(:builds AS text[]), "
    "CAST(:signatures AS text[])) AS v(id, path, build, signature) "
    "WHERE bc.id = v.id"
)


def set_builds(
    session: Session,
    *,
    ids: Sequence[int],
    paths: Sequence[str | None],
    builds: Sequence[str],
    signatures: Sequence[str | None],
) -> None:
    """Each candidate's kernel path (relative to the artifact root), build result (JSON text)
    and signature (hex), for a whole batch in one statement."""
    if ids:
        session.execute(
            _SET_BUILDS,
            {"ids": list(ids), "paths": list(paths), "builds": list(builds), "signatures": list(signatures)},
        )
