"""Saved versions of the class cost models: `add_cost_model_version`, `latest_cost_model_version`,
`latest_cost_models_of_classes` (transfer).
"""

from __future__ import annotations

from sqlalchemy import func, insert, select
from sqlalchemy.orm import Session

from services.db.models import CostModelVersion, DeviceClass


def add_cost_model_version(
    session: Session,
    *,
    device_class_id: int,
    feature_version: int,
    path: str,
    sha256: str,
    size: int,
    trained_on: int,
    last_measurement_id: int | None,
    transferred_from_id: int | None = None,
) -> CostModelVersion:
    """Store the class's next cost model version (1 + the latest). Two concurrent writers
    get a `Conflict` for one of them (unique class + version) at flush or commit."""
    latest = select(func.coalesce(func.max(CostModelVersion.version), 0) + 1).where(
        CostModelVersion.device_class_id == device_class_id
    )
    return session.scalars(
        insert(CostModelVersion).returning(CostModelVersion),
        [
            {
                "device_class_id": device_class_id,
                "version": session.scalar(latest),
                "feature_version": feature_version,
                "path": path,
                "sha256": sha256,
                "size": size,
                "trained_on": trained_on,
                "last_measurement_id": last_measurement_id,
                "transferred_from_id": transferred_from_id,
            }
        ],
    ).one()


def latest_cost_model_version(
    session: Session, *, device_class_id: int, feature_version: int | None = None
) -> CostModelVersion | None:
    """The class's newest cost model (of `feature_version`, when given), or None."""
    query = select(CostModelVersion).where(CostModelVersion.device_class_id == device_class_id)
    if feature_version is not None:
        query = query.where(CostModelVersion.feature_version == feature_version)
    return session.scalars(query.order_by(CostModelVersion.version.desc()).limit(1)).one_or_none()


def latest_cost_models_of_classes(session: Session, *, feature_version: int) -> list[tuple[DeviceClass, CostModelVersion]]:
    """Every class that has a cost model of `feature_version`, with its newest one."""
    newest = (
        select(CostModelVersion.device_class_id, func.max(CostModelVersion.version).label("version"))
        .where(CostModelVersion.feature_version == feature_version)
        .group_by(CostModelVersion.device_class_id)
        .subquery()
    )
    rows = session.execute(
        select(DeviceClass, CostModelVersion)
        .join(CostModelVersion, CostModelVersion.device_class_id == DeviceClass.id)
        .join(
            newest,
            (newest.c.device_class_id == CostModelVersion.device_class_id) & (newest.c.version == CostModelVersion.version),
        )
        .order_by(DeviceClass.name)
    ).all()
    return [(dc, version) for dc, version in rows]
