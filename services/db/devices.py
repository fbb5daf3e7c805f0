"""The farm's devices as teams see them: every agent with its class (`agents_with_classes`),
the device classes with their live agents (`classes_with_live_agents`), and the database's
clock that heartbeat ages are measured against (`database_now`).

Every function works inside the caller's transaction and commits nothing itself.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from services.db import liveness
from services.db.models import Agent, DeviceClass


def agents_with_classes(session: Session) -> list[tuple[Agent, str]]:
    """Every agent and its class's name, oldest agent first."""
    rows = session.execute(
        select(Agent, DeviceClass.name).join(DeviceClass, DeviceClass.id == Agent.device_class_id).order_by(Agent.id)
    ).all()
    return [(agent, class_name) for agent, class_name in rows]


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
