"""The farm's state counted for its metrics (`GET /metrics`): `farm_counts`, read at each
scrape. The agents' measurements and errors are their precomputed counts (kept with each
measurement), so a scrape costs the same however many measurements the farm holds;
failed builds (no agent) are counted from the measurements' agent index.

Every function works inside the caller's transaction and commits nothing itself.
"""

from __future__ import annotations

from dataclasses import dataclass
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


def farm_counts(session: Session, *, alive_secs: float) -> FarmCounts:
    """The farm's counts now; an agent is alive when it heartbeated within `alive_secs`."""
    return FarmCounts(
        class_names=dict(session.execute(select(DeviceClass.id, DeviceClass.name)).all()),
        open_batches=_open_batches(session),
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
