"""Agents: `register_agent`, `release_agent_leases` (everything an agent does not say it holds: a
grant lost on its way, an agent restarted), `quarantine_agent` / `lift_quarantine` / `clear_flags`
(an operator's verdict on an agent's timings), `mark_agents_offline`; `find_agent`, and
`record_health` (what an agent last said of its health).

Every function works inside the caller's transaction and commits nothing itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, case, func, or_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

from services.db import confirmations
from services.db.batches import transition_batch
from services.db.exceptions import Conflict, RowNotFound
from services.db.leases import token_revoked
from services.db.models import Agent, Batch, Lease, ModelRun
from services.db.statements import db_now
from services.db.states import AgentState, BatchState, LeaseState, ModelRunState


def register_agent(
    session: Session,
    *,
    name: str,
    device_class_id: int,
    token_id: int | None,
    capabilities: Mapping[str, Any],
    secret_hash: str | None = None,
    now: datetime | None = None,
) -> Agent:
    """Create the agent `name`, or take it over again after a restart (same name).
    `secret_hash` is the hash of the secret this registration hands the agent; it
    replaces the previous registration's (whose secret is refused from now on).

    An agent registering again holds none of its earlier leases (its process restarted):
    they end now and their batches go back to the queue, instead of waiting for the
    leases to expire. Raises `Conflict` when the name belongs to an agent of another
    token (unless that token was revoked: a board whose token was replaced keeps its
    name)."""
    at = db_now(now)
    agent = session.scalars(
        select(Agent).where(Agent.name == name).with_for_update().execution_options(populate_existing=True)
    ).one_or_none()
    if agent is None:
        return session.scalars(
            pg_insert(Agent)
            .values(
                name=name,
                device_class_id=device_class_id,
                token_id=token_id,
                capabilities=dict(capabilities),
                state=AgentState.IDLE,
                last_heartbeat_at=at,
                secret_hash=secret_hash,
            )
            .returning(Agent)
        ).one()
    if agent.token_id is not None and agent.token_id != token_id and not token_revoked(session, agent.token_id):
        raise Conflict(f"agent name {name!r} is taken by an agent of another token", constraint="uq_agents_name")
    release_agent_leases(session, agent_id=agent.id, now=now)
    state = case((Agent.state == AgentState.DISABLED, Agent.state), else_=AgentState.IDLE)
    return session.scalars(
        update(Agent)
        .where(Agent.id == agent.id)
        .values(
            device_class_id=device_class_id,
            token_id=token_id,
            capabilities=dict(capabilities),
            state=state,
            last_heartbeat_at=at,
            secret_hash=secret_hash,
        )
        .returning(Agent),
        execution_options={"populate_existing": True},
    ).one()


def quarantine_agent(session: Session, *, name: str, now: datetime | None = None) -> Agent:
    """An operator's verdict on an agent's timings: it is leased nothing more (disabled,
    its leases and model runs end now and go back to the queue), and its unconfirmed
    measurements count for nothing: no best of an unfinished job (those are recomputed,
    their confirmations scheduled on other agents) and no cost model. Confirmations it
    gave are undone. Again on a quarantined agent: nothing changes. Raises `RowNotFound`."""
    agent_id = _agent_id(session, name)
    release_agent_leases(session, agent_id=agent_id, now=now)
    session.execute(
        update(Agent)
        .where(Agent.id == agent_id)
        .values(state=AgentState.DISABLED, quarantined_at=func.coalesce(Agent.quarantined_at, db_now(now))),
        execution_options={"synchronize_session": False},
    )
    confirmations.forget_agent(session, agent_id=agent_id, now=now)
    return _fresh_agent(session, agent_id)


def lift_quarantine(session: Session, *, name: str, now: datetime | None = None) -> Agent:
    """Take an agent out of quarantine: it leases again once it heartbeats (offline until
    then), and its measurements count again (the bests of unfinished jobs' tasks it
    measured are recomputed). Raises `RowNotFound`."""
    agent_id = _agent_id(session, name)
    session.execute(
        update(Agent)
        .where(Agent.id == agent_id, Agent.quarantined_at.is_not(None))
        .values(state=AgentState.OFFLINE, quarantined_at=None),
        execution_options={"synchronize_session": False},
    )
    confirmations.refresh_agent_tasks(session, agent_id=agent_id, now=now)
    return _fresh_agent(session, agent_id)


def clear_flags(session: Session, *, name: str) -> Agent:
    """An operator's pardon of a flagged agent (`tunefarm farm agent unflag`): its results
    below the floor and its disputed timings no longer count against it, so it is leased
    work again (a flagged agent is leased nothing, so nothing else could clear them). Its
    measurements keep their verdicts: a disputed one stays disputed, one below the floor
    an error. Raises `RowNotFound`."""
    agent_id = _agent_id(session, name)
    session.execute(
        update(Agent).where(Agent.id == agent_id).values(below_floor=0, confirmations_disputed=0),
        execution_options={"synchronize_session": False},
    )
    return _fresh_agent(session, agent_id)


def _agent_id(session: Session, name: str) -> int:
    agent_id = session.scalar(select(Agent.id).where(Agent.name == name))
    if agent_id is None:
        raise RowNotFound(f"agent {name!r}")
    return int(agent_id)


def _fresh_agent(session: Session, agent_id: int) -> Agent:
    return session.scalars(
        select(Agent).where(Agent.id == agent_id).execution_options(populate_existing=True)
    ).one()


def release_agent_leases(
    session: Session,
    *,
    agent_id: int,
    keep_lease_ids: Sequence[int] = (),
    keep_model_run_ids: Sequence[int] = (),
    now: datetime | None = None,
) -> list[int]:
    """End the agent's active leases (expired) and leased model runs, but for those it
    still holds (`keep_*`), and put their batches and runs back in the queue at once;
    returns the batch ids."""
    batch_ids = list(
        session.scalars(
            select(Lease.batch_id).where(
                Lease.agent_id == agent_id, Lease.state == LeaseState.ACTIVE, Lease.id.not_in(sorted(set(keep_lease_ids)))
            )
        )
    )
    for batch_id in sorted(batch_ids):  # lock order: the batch, then (in transition_batch) its lease
        batch = session.scalars(select(Batch).where(Batch.id == batch_id).with_for_update()).one()
        if batch.state is BatchState.LEASED:
            transition_batch(session, batch_id=batch_id, to=BatchState.READY, now=now)
    session.execute(
        update(ModelRun)
        .where(
            ModelRun.agent_id == agent_id,
            ModelRun.state == ModelRunState.LEASED,
            ModelRun.id.not_in(sorted(set(keep_model_run_ids))),
        )
        .values(state=ModelRunState.READY, expires_at=None),
        execution_options={"synchronize_session": False},
    )
    return sorted(batch_ids)


def mark_agents_offline(session: Session, *, stale_secs: float, now: datetime | None = None) -> list[int]:
    """Agents whose last heartbeat is older than `stale_secs` become offline; their ids."""
    at = db_now(now)
    return sorted(
        session.scalars(
            update(Agent)
            .where(
                Agent.state.in_([AgentState.IDLE, AgentState.BUSY]),
                or_(
                    Agent.last_heartbeat_at < at - timedelta(seconds=stale_secs),
                    and_(
                        Agent.last_heartbeat_at.is_(None),
                        Agent.registered_at < at - timedelta(seconds=stale_secs),
                    ),
                ),
            )
            .values(state=AgentState.OFFLINE)
            .returning(Agent.id)
        )
    )


def find_agent(session: Session, *, agent_id: int) -> Agent | None:
    """The agent (None: there is no such agent)."""
    return session.get(Agent, agent_id)


def record_health(session: Session, *, agent_id: int, health: dict[str, Any]) -> bool:
    """Keep the agent's latest health report (with its capabilities, under "health": no
    column of its own yet; operators read it there). False: there is no such agent."""
    row = session.get(Agent, agent_id, with_for_update=True)
    if row is None:
        return False
    row.capabilities = {**(row.capabilities or {}), "health": health}
    return True
