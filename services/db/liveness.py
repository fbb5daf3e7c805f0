"""Whether an agent is live: what every process means by "an agent serves its class".

An agent's row says `idle` or `busy` from its registration until someone writes
otherwise: the agent itself when it stops cleanly (`go_offline`, the GoOffline RPC its
SIGTERM sends), or the lease service's
sweeper once its heartbeats have stopped for `agent_stale_secs`. An agent killed while
no lease service runs (a farm taken down, then another one started on the same database)
keeps its `idle` forever. So a row's state alone is not liveness: an agent is live when
its state is idle or busy *and* it heartbeated within the freshness window
(`ServiceSettings.agent_fresh_secs`, TUNEFARM_AGENT_FRESH_SECS). The scheduler's fair
shares, the API's devices list and a job's `waiting` all judge by `live_clause`.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, and_, func, update
from sqlalchemy.orm import Session

from services.db import agents
from services.db.models import Agent
from services.db.states import AgentState

LIVE_STATES = (AgentState.IDLE, AgentState.BUSY)


def live_clause(fresh_secs: float | ColumnElement[float]) -> ColumnElement[bool]:
    """SQL: the agent row is live (idle or busy, heartbeated within `fresh_secs`, by the
    database's clock). `fresh_secs` may be a SQL expression (a bound parameter of a
    statement built once)."""
    window = (
        timedelta(seconds=fresh_secs)
        if isinstance(fresh_secs, int | float)
        else func.make_interval(0, 0, 0, 0, 0, 0, fresh_secs)
    )
    return and_(Agent.state.in_(LIVE_STATES), Agent.last_heartbeat_at > func.now() - window)


def shown_state(state: AgentState, last_heartbeat_at: datetime | None, *, now: datetime, fresh_secs: float) -> AgentState:
    """The state to show for an agent row: `offline` for an idle or busy one whose last
    heartbeat is older than `fresh_secs` (it stopped without saying so); else its own."""
    if state in LIVE_STATES and (last_heartbeat_at is None or now - last_heartbeat_at > timedelta(seconds=fresh_secs)):
        return AgentState.OFFLINE
    return state


def go_offline(session: Session, *, agent_id: int) -> list[int]:
    """An agent stopping cleanly (`GoOffline`): the leases and model runs it holds end now
    and go back to the queue (another agent takes them at once, not after the lease
    window), and it is offline (a quarantined one stays disabled) until it registers
    again. Returns the batches released."""
    released = agents.release_agent_leases(session, agent_id=agent_id)
    session.execute(
        update(Agent)
        .where(Agent.id == agent_id, Agent.state.in_(LIVE_STATES))
        .values(state=AgentState.OFFLINE),
        execution_options={"synchronize_session": False},
    )
    return released

