"""The farm's devices as teams see them: every agent with its class (`agents_with_classes`),
one of them (`agent_with_class`) and its measurements hour by hour (`agent_history`), the
device classes with their live agents (`classes_with_live_agents`), and the database's
clock that heartbeat ages are measured against (`database_now`).

Every function works inside the caller's transaction and commits nothing itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from services.db import liveness
from services.db.models import Agent, DeviceClass, Measurement
from tunefarm.records import ErrorKind


def agents_with_classes(session: Session) -> list[tuple[Agent, str]]:
    """Every agent and its class's name, oldest agent first."""
    rows = session.execute(
        select(Agent, DeviceClass.name).join(DeviceClass, DeviceClass.id == Agent.device_class_id).order_by(Agent.id)
    ).all()
    return [(agent, class_name) for agent, class_name in rows]


def agent_with_class(session: Session, *, agent_id: int) -> tuple[Agent, str] | None:
    """The agent and its class's name (None: no such agent)."""
    row = session.execute(
        select(Agent, DeviceClass.name).join(DeviceClass, DeviceClass.id == Agent.device_class_id).where(Agent.id == agent_id)
    ).one_or_none()
    return None if row is None else (row[0], row[1])


@dataclass(frozen=True)
class MeasuredHour:
    """An hour (UTC, its start) of an agent's measurements: how many, how many errors."""

    hour: datetime
    measurements: int
    errors: int


def agent_history(session: Session, *, agent_id: int, hours: int) -> list[MeasuredHour]:
    """The agent's measurements hour by hour over the last `hours` hours, newest first;
    hours without one are left out. Reads the agent's measurements of that window
    (`ix_measurements_agent_id`, then their time)."""
    hour = func.date_trunc("hour", func.timezone("UTC", Measurement.created_at))
    rows = session.execute(
        select(hour, func.count(), func.count().filter(Measurement.error_kind != ErrorKind.NONE))
        .where(Measurement.agent_id == agent_id, Measurement.created_at >= func.now() - timedelta(hours=hours))
        .group_by(hour)
        .order_by(hour.desc())
    ).all()
    return [MeasuredHour(at, int(n), int(errors)) for at, n, errors in rows]


def classes_with_live_agents(session: Session, *, fresh_secs: float) -> list[tuple[DeviceClass, int]]:
    """Every device class, by name, and how many of its agents are live (`liveness`:
    heartbeat within `fresh_secs`)."""
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
    return [(device_class, int(n)) for device_class, n in rows]


def database_now(session: Session) -> datetime:
    """The database's clock (ages of heartbeats are measured against it, as they are written)."""
    return session.scalar(select(func.now()))
