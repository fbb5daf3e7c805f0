"""The farm's measurements as a dataset's sources (`tunefarm.dataset.MeasuredTask`), so that
`tunefarm dataset --database-url URL` exports them like records files.

Only measurements vouched for (`confirmations.vouch`: their agent was in good standing)
are exported, the same ones a class's shared cost model learns from: a lying agent's
times train no pretrained model either. Each task's measurements are grouped by the
environment their agent reported (its fingerprint: TVM and agent versions, CPU model,
cores, host), and named by their device class. Emulated timings are left out by
`export_measured`, which sees the records' own flag; a fingerprint that says so marks
its records too.

`measured_tasks` works inside the caller's transaction and commits nothing;
`read_measured_tasks` opens its own read-only session on a URL (the CLI's).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from services.db.codec import record_from_json
from services.db.exceptions import DatabaseError
from services.db.models import DeviceClass, Measurement, WorkloadRow
from services.db.session import make_session_factory, transaction
from tunefarm.dataset import Environment, MeasuredTask

PAGE_ROWS = 1000
"""Measurement rows read from the server at a time."""


class FarmUnreadable(DatabaseError):
    """The farm's database named by a URL could not be read (the reason in one line)."""


def read_measured_tasks(url: str, *, device_class: str | None = None) -> list[MeasuredTask]:
    """`measured_tasks` of the database at `url` (a plain ``postgresql://`` URL uses the
    driver the farm installs). Raises FarmUnreadable."""
    try:
        parsed = make_url(url)
        if parsed.drivername == "postgresql":  # SQLAlchemy's default driver is not installed
            parsed = parsed.set(drivername="postgresql+psycopg2")
        factory = make_session_factory(parsed.render_as_string(hide_password=False))
        try:
            with transaction(factory) as s:
                return measured_tasks(s, device_class=device_class)
        finally:
            factory.kw["bind"].dispose()
    except (DatabaseError, SQLAlchemyError, ImportError, ValueError) as exc:
        raise FarmUnreadable(" ".join(str(exc).split())) from exc


def redacted(url: str) -> str:
    """`url` without its password, for a dataset's provenance."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not a URL: say nothing of it
        return "(unparseable URL)"


def measured_tasks(session: Session, *, device_class: str | None = None) -> list[MeasuredTask]:
    """The vouched-for measurements of every class (or of the class named `device_class`),
    one `MeasuredTask` per class, task and agent environment, oldest measurement first."""
    query = (
        select(Measurement.record, Measurement.fingerprint, Measurement.workload_id, DeviceClass.name)
        .join(DeviceClass, DeviceClass.id == Measurement.device_class_id)
        .where(Measurement.vouched_seq.is_not(None))
        .order_by(Measurement.id)
    )
    if device_class is not None:
        query = query.where(DeviceClass.name == device_class)
    groups: dict[tuple[str, str, int, Environment], list[Any]] = {}
    for record_json, fingerprint, workload_id, class_name in session.execute(query).yield_per(PAGE_ROWS):
        record = record_from_json(record_json)
        if (fingerprint or {}).get("emulated") and not record.emulated:
            record = replace(record, emulated=True)
        env = agent_environment(fingerprint or {})
        groups.setdefault((class_name, record.task, workload_id, env), []).append(record)
    workloads = _workloads(session, {workload_id for _, _, workload_id, _ in groups})
    return [
        MeasuredTask(key=task, workload_key=workloads[workload_id].key, name=workloads[workload_id].name,
                     module_json=workloads[workload_id].module_json, records=records, environment=env,
                     source=f"farm measurements of class {class_name}", device_class=class_name,
                     n_outputs=workloads[workload_id].n_outputs)  # fmt: skip
        for (class_name, task, workload_id, env), records in groups.items()
    ]


def agent_environment(fingerprint: Mapping[str, Any]) -> Environment:
    """Where an agent measured, from the fingerprint it reported (`services.lease.auth`)."""
    return Environment(
        tvm_version=str(fingerprint.get("tvm_version") or ""),
        tunefarm_version=str(fingerprint.get("agent_version") or ""),
        cpu_model=str(fingerprint.get("cpu_model") or fingerprint.get("gpu_name") or ""),
        cores=int(fingerprint.get("physical_cores") or 0),
        host=str(fingerprint.get("hostname") or fingerprint.get("agent") or ""),
    )


def _workloads(session: Session, ids: set[int]) -> dict[int, Any]:
    rows = session.execute(
        select(WorkloadRow.id, WorkloadRow.key, WorkloadRow.name, WorkloadRow.module_json, WorkloadRow.n_outputs)
        .where(WorkloadRow.id.in_(ids))
    ).all() if ids else []  # fmt: skip
    return {row.id: row for row in rows}
