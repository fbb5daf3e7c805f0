"""What a device class's shared cost model (`services.scheduler.shared_model`) reads
besides its saved versions (`cost_models`): the class's target, where a transferred
version came from, the class's measurements in the order they were vouched for
(`confirmations.vouch`), and the workload a measurement's task is rebuilt from.

Every function works inside the caller's transaction and commits nothing itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from services.db.confirmations import believed_clause
from services.db.models import CostModelVersion, DeviceClass, Measurement, WorkloadRow


def class_target(session: Session, *, device_class_id: int) -> dict[str, Any] | None:
    """The class's target (None: no such class)."""
    return session.scalar(select(DeviceClass.target).where(DeviceClass.id == device_class_id))


def version_origin(session: Session, *, version_id: int) -> tuple[int, str]:
    """A cost model version's number and the name of its class."""
    row = session.execute(
        select(CostModelVersion.version, DeviceClass.name)
        .join(DeviceClass, DeviceClass.id == CostModelVersion.device_class_id)
        .where(CostModelVersion.id == version_id)
    ).one()
    return row.version, row.name


def vouched_measurements(
    session: Session, *, device_class_id: int, after_seq: int, limit: int
) -> list[tuple[int, int, int]]:
    """(vouched_seq, measurement id, workload id) of the class's first `limit` measurements
    vouched for after `after_seq`, in that order, that are still believed (their records:
    `measurement_records`, for those the caller has not decoded already)."""
    rows = session.execute(
        select(Measurement.vouched_seq, Measurement.id, Measurement.workload_id)
        .where(
            Measurement.device_class_id == device_class_id,
            Measurement.vouched_seq > after_seq,
            believed_clause(),
        )
        .order_by(Measurement.vouched_seq)
        .limit(limit)
    ).all()
    return [(seq, measurement_id, workload_id) for seq, measurement_id, workload_id in rows]


def measurement_records(session: Session, *, measurement_ids: Sequence[int]) -> dict[int, dict[str, Any]]:
    """The stored record (its JSON) of each of these measurements, by id."""
    if not measurement_ids:
        return {}
    rows = session.execute(select(Measurement.id, Measurement.record).where(Measurement.id.in_(measurement_ids)))
    return {measurement_id: record for measurement_id, record in rows}


@dataclass(frozen=True)
class StoredWorkload:
    """A workload row's fields a search task is rebuilt from (`workload_from_stored`)."""

    key: str
    name: str
    module_json: str
    n_outputs: int


def stored_workload(session: Session, *, workload_id: int) -> StoredWorkload:
    """The workload row's key, name, IRModule JSON and output count."""
    row = session.execute(
        select(WorkloadRow.key, WorkloadRow.name, WorkloadRow.module_json, WorkloadRow.n_outputs).where(WorkloadRow.id == workload_id)
    ).one()
    return StoredWorkload(row.key, row.name, row.module_json, row.n_outputs)
