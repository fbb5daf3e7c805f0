"""A job's batches as the farm measurer (`services.scheduler.farm_measurer`) submits and
watches them: the job's device class, new batches with their candidates, the batches
still open after a restart (with their unmeasured inputs), the job's measurements as
they land, and what a finished batch left unmeasured.

Every function works inside the caller's transaction and commits nothing itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import exists, insert, select
from sqlalchemy.orm import Session

from services.db import codec
from services.db.models import Batch, BatchCandidate, Measurement
from services.db.states import BatchState
from tunefarm.records import MeasureInput, TimingConfig


@dataclass(frozen=True)
class NewBatch:
    """A batch of one task of a job, as proposed."""

    job_id: int
    job_task_id: int
    workload_id: int
    device_class_id: int
    timing: TimingConfig
    build_timeout_secs: float
    run_timeout_secs: float


def add_batch(session: Session, *, batch: NewBatch, inputs: Sequence[MeasureInput]) -> int:
    """A proposed batch and its candidates (in `inputs`' order, keys distinct); its id."""
    batch_id = session.scalar(
        insert(Batch)
        .values(
            job_id=batch.job_id,
            job_task_id=batch.job_task_id,
            workload_id=batch.workload_id,
            device_class_id=batch.device_class_id,
            timing=codec.timing_to_json(batch.timing),
            build_timeout_secs=batch.build_timeout_secs,
            run_timeout_secs=batch.run_timeout_secs,
        )
        .returning(Batch.id)
    )
    assert batch_id is not None
    if inputs:
        session.execute(
            insert(BatchCandidate),
            [
                {"batch_id": batch_id, "position": i, "candidate_key": m.key, "input": codec.input_to_json(m)}
                for i, m in enumerate(inputs)
            ],
        )
    return batch_id


@dataclass(frozen=True)
class OpenBatch:
    """A batch of the job's search not finished yet, and its inputs without a measurement."""

    batch: Batch
    unmeasured: list[MeasureInput]


def open_search_batches(session: Session, *, job_id: int) -> list[OpenBatch]:
    """The job's batches that are neither done nor failed, confirmation batches aside, in
    id order, each with its unmeasured inputs in proposal order."""
    measured = exists().where(Measurement.batch_candidate_id == BatchCandidate.id)
    open_ = list(
        session.scalars(
            select(Batch)
            .where(
                Batch.job_id == job_id,
                Batch.state.not_in([BatchState.DONE, BatchState.FAILED]),
                Batch.confirms_measurement_id.is_(None),
            )
            .order_by(Batch.id)
        )
    )
    cands = session.execute(
        select(BatchCandidate.batch_id, BatchCandidate.input)
        .where(BatchCandidate.batch_id.in_([b.id for b in open_]), ~measured)
        .order_by(BatchCandidate.batch_id, BatchCandidate.position)
    ).all()
    by_batch: dict[int, list[MeasureInput]] = {}
    for batch_id, data in cands:
        by_batch.setdefault(batch_id, []).append(codec.input_from_json(data))
    return [OpenBatch(b, by_batch.get(b.id, [])) for b in open_]


def measurements_after(
    session: Session, *, job_id: int, after_id: int, limit: int
) -> list[tuple[int, int, dict[str, Any]]]:
    """(measurement id, batch id, stored record) of the job's first `limit` measurements
    with an id above `after_id`, in id order."""
    rows = session.execute(
        select(Measurement.id, BatchCandidate.batch_id, Measurement.record)
        .join(BatchCandidate, BatchCandidate.id == Measurement.batch_candidate_id)
        .where(Measurement.job_id == job_id, Measurement.id > after_id)
        .order_by(Measurement.id)
        .limit(limit)
    ).all()
    return [(mid, batch_id, record) for mid, batch_id, record in rows]


def batch_states(session: Session, *, batch_ids: Sequence[int]) -> dict[int, BatchState]:
    """The state of each batch of `batch_ids` that exists."""
    return {i: state for i, state in session.execute(select(Batch.id, Batch.state).where(Batch.id.in_(batch_ids)))}


def candidates_left(
    session: Session, *, batch_id: int, keys: Sequence[str]
) -> list[tuple[str, str | None, dict[str, Any], dict[str, Any] | None]]:
    """(candidate key, kernel path, stored input, stored record or None: not measured) of
    the batch's candidates with one of `keys`."""
    rows = session.execute(
        select(BatchCandidate.candidate_key, BatchCandidate.artifact_path, BatchCandidate.input, Measurement.record)
        .outerjoin(Measurement, Measurement.batch_candidate_id == BatchCandidate.id)
        .where(BatchCandidate.batch_id == batch_id, BatchCandidate.candidate_key.in_(keys))
    ).all()
    return [(key, artifact, data, record) for key, artifact, data, record in rows]


def batch_build_error(session: Session, *, batch_id: int) -> str | None:
    """Why the batch failed as a whole (None: it did not, or no reason was recorded)."""
    return session.scalar(select(Batch.build_error).where(Batch.id == batch_id))
