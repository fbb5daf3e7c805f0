"""The farm's state counted for its metrics (`GET /metrics`): `farm_counts`, read at each
scrape. The agents' measurements and errors are their precomputed counts (kept with each
measurement), so a scrape costs the same however many measurements the farm holds;
failed builds (no agent) are counted from the measurements' agent index.

Every function works inside the caller's transaction and commits nothing itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import timedelta

from sqlalchemy import Integer, case, cast, func, literal_column, select
from sqlalchemy.orm import Session

from services.db.models import Agent, Batch, DeviceClass, Job, Lease, Measurement
from services.db.states import AgentState, BatchState, JobState, LeaseState

OPEN_BATCH_STATES = (BatchState.PROPOSED, BatchState.BUILDING, BatchState.READY, BatchState.LEASED)
"""The states of a batch not finished."""


@dataclass(frozen=True)
class AgentCount:
    """The agents of one class in one state."""

    device_class_id: int
    state: AgentState
    agents: int
    alive: int  # that heartbeated within the window
    measured: int  # candidates they measured, together


@dataclass(frozen=True)
class FarmCounts:
    """What the metrics show, by device class id (a class or state absent: none)."""

    class_names: dict[int, str]
    open_batches: dict[tuple[int, BatchState], int]
    active_leases: dict[int, int]
    agents: list[AgentCount]
    errors: dict[tuple[int, str], int]  # measurements that are errors, by class and kind
    jobs: dict[JobState, int]
    stalled_batches: dict[tuple[int, str], int] = field(default_factory=dict)  # by class and phase (build, agent)


def farm_counts(session: Session, *, alive_secs: float, stall_secs: float = math.inf) -> FarmCounts:
    """The farm's counts now; an agent is alive when it heartbeated within `alive_secs`; a
    batch is stalled when it has waited `stall_secs` for its build or, built, for an agent."""
    return FarmCounts(
        class_names=dict(session.execute(select(DeviceClass.id, DeviceClass.name)).all()),
        open_batches=_open_batches(session),
        stalled_batches=_stalled_batches(session, stall_secs=stall_secs),
        active_leases=_active_leases(session),
        agents=_agent_counts(session, alive_secs=alive_secs),
        errors=_error_counts(session),
        jobs=dict(session.execute(select(Job.state, func.count()).group_by(Job.state)).all()),
    )


def _open_batches(session: Session) -> dict[tuple[int, BatchState], int]:
    rows = session.execute(
        select(Batch.device_class_id, Batch.state, func.count())
        .where(Batch.state.in_(OPEN_BATCH_STATES))
        .group_by(Batch.device_class_id, Batch.state)
    ).all()
    return {(c, s): n for c, s, n in rows}


def _stalled_batches(session: Session, *, stall_secs: float) -> dict[tuple[int, str], int]:
    """Open batches that have waited at least `stall_secs`: "build" (proposed or building,
    since made), "agent" (ready, since built)."""
    if not math.isfinite(stall_secs):
        return {}
    unbuilt = Batch.state.in_((BatchState.PROPOSED, BatchState.BUILDING))
    phase = case((unbuilt, literal_column("'build'")), else_=literal_column("'agent'"))
    since = case((unbuilt, Batch.created_at), else_=Batch.ready_at)
    rows = session.execute(
        select(Batch.device_class_id, phase, func.count())
        .where(
            Batch.state.in_((BatchState.PROPOSED, BatchState.BUILDING, BatchState.READY)),
            since < func.now() - timedelta(seconds=stall_secs),
        )
        .group_by(Batch.device_class_id, phase)
    ).all()
    return {(c, p): n for c, p, n in rows}


def _active_leases(session: Session) -> dict[int, int]:
    return dict(
        session.execute(
            select(Batch.device_class_id, func.count())
            .select_from(Lease)
            .join(Batch, Batch.id == Lease.batch_id)
            .where(Lease.state == LeaseState.ACTIVE)
            .group_by(Batch.device_class_id)
        ).all()
    )


def _agent_counts(session: Session, *, alive_secs: float) -> list[AgentCount]:
    recent = Agent.last_heartbeat_at >= func.now() - timedelta(seconds=alive_secs)
    rows = session.execute(
        select(
            Agent.device_class_id,
            Agent.state,
            func.count(),
            func.sum(case((recent, 1), else_=0)),
            func.sum(Agent.measurements_done),
        ).group_by(Agent.device_class_id, Agent.state)
    ).all()
    return [
        AgentCount(device_class_id=c, state=s, agents=n, alive=int(n_alive or 0), measured=int(n_measured or 0))
        for c, s, n, n_alive, n_measured in rows
    ]


def _error_counts(session: Session) -> dict[tuple[int, str], int]:
    """Errors by class and kind: the agents' counts, and failed builds (measured by no agent)."""
    kinds: dict[tuple[int, str], int] = {}
    each = func.jsonb_each_text(Agent.errors_by_kind).table_valued("key", "value").alias("e")
    for class_id, kind, n in session.execute(
        select(Agent.device_class_id, each.c.key, func.sum(cast(each.c.value, Integer)))
        .select_from(Agent)
        .join(each, literal_column("true"))
        .group_by(Agent.device_class_id, each.c.key)
    ).all():
        kinds[(class_id, kind)] = kinds.get((class_id, kind), 0) + int(n)
    for class_id, kind, n in session.execute(
        select(Measurement.device_class_id, Measurement.error_kind, func.count())
        .where(Measurement.agent_id.is_(None))
        .group_by(Measurement.device_class_id, Measurement.error_kind)
    ).all():
        key = (class_id, str(kind))
        kinds[key] = kinds.get(key, 0) + int(n)
    return kinds
