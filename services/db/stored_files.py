"""Files the rows name under the artifact root: a batch's kernels and its workload's task data
(`batch_files`, `task_data_of`), as the lease service serves them to the agent holding the lease.

Every function works inside the caller's transaction and commits nothing itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from services.db.models import Batch, BatchCandidate, TaskDataRow


@dataclass(frozen=True)
class BatchFiles:
    """The stored files of a batch that an agent may fetch."""

    batch_id: int
    kernels: dict[int, str | None]  # batch candidate id -> kernel path (None: no built kernel)
    task_data: TaskDataRow | None  # of the batch's workload


def batch_files(session: Session, *, batch_id: int, kernel_ids: Sequence[int]) -> BatchFiles:
    """The kernels of the batch's candidates among `kernel_ids` (others are left out) and its
    workload's task data. The batch must exist."""
    batch = session.get(Batch, batch_id)
    assert batch is not None
    kernels = dict(
        session.execute(
            select(BatchCandidate.id, BatchCandidate.artifact_path).where(
                BatchCandidate.batch_id == batch.id, BatchCandidate.id.in_(kernel_ids)
            )
        ).all()
    )
    return BatchFiles(batch.id, kernels, task_data_of(session, workload_id=batch.workload_id))


def task_data_of(session: Session, *, workload_id: int) -> TaskDataRow | None:
    """The workload's task data (None: it has none)."""
    return session.scalars(select(TaskDataRow).where(TaskDataRow.workload_id == workload_id)).one_or_none()
