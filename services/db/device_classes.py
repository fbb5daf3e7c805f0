"""Device classes: `find_device_class`, `device_class_names`, `ensure_device_class` (created if
missing, as an agent registering for a class may when the lease service lets it).

Every function works inside the caller's transaction and commits nothing itself.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

from services.db.models import DeviceClass


def find_device_class(session: Session, *, name: str) -> DeviceClass | None:
    """The device class `name` (None: there is none)."""
    return session.scalars(select(DeviceClass).where(DeviceClass.name == name)).one_or_none()


def device_class_names(session: Session, *, by_id: bool = False) -> list[str]:
    """Every class's name, by name (`by_id`: oldest class first)."""
    order = DeviceClass.id if by_id else DeviceClass.name
    return list(session.scalars(select(DeviceClass.name).order_by(order)))


def ensure_device_class(
    session: Session, *, name: str, target: dict[str, Any], description: str = ""
) -> DeviceClass:
    """The device class `name`, created with `target` if it does not exist (an existing
    class keeps its target: its measurements were made for it)."""
    session.execute(
        pg_insert(DeviceClass)
        .values(name=name, target=target, description=description)
        .on_conflict_do_nothing(index_elements=[DeviceClass.name])
    )
    return session.scalars(select(DeviceClass).where(DeviceClass.name == name)).one()
