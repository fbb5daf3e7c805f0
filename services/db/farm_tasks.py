"""A job's tasks as the farm measures them (`services.scheduler.farm_measurer`): the
workload row (with its buffers' bytes, for the timing floor), its task data (inputs and
expected outputs, one file per workload shared by every job) and the job's task row; a
task's alternatives (`add_alternative`: its Winograd programs, `JobTask.alternative_of`)
are added by the scheduler when it starts the job, before they are prepared.

Every function works inside the caller's transaction and commits nothing itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from sqlalchemy import func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

from services.db.models import JobTask, TaskDataRow, WorkloadRow

if TYPE_CHECKING:
    from tunefarm.workloads import Workload


@dataclass(frozen=True)
class WorkloadFields:
    """A workload row's values (`WorkloadRow`)."""

    key: str
    name: str
    module_json: str
    flops: float
    n_inputs: int
    n_outputs: int
    io_bytes: int


def workload_fields(workload: Workload) -> WorkloadFields:
    """The row values of `workload` (its module as `Workload.to_json` writes it)."""
    return WorkloadFields(
        key=workload.key,
        name=workload.name,
        module_json=workload.to_json(),
        flops=float(workload.flops),
        n_inputs=len(workload.inputs),
        n_outputs=len(workload.outputs),
        io_bytes=sum(t.nbytes for t in (*workload.inputs, *workload.outputs)),
    )


def store_workload(session: Session, *, workload: WorkloadFields) -> int | None:
    """The workload's row id, the row inserted if there is none with its key. Its
    `io_bytes`, the timing floor's memory term, is filled in if missing (the API stores
    workloads without it)."""
    session.execute(
        pg_insert(WorkloadRow)
        .values(
            key=workload.key,
            name=workload.name,
            module_json=workload.module_json,
            flops=workload.flops,
            n_inputs=workload.n_inputs,
            n_outputs=workload.n_outputs,
        )
        .on_conflict_do_nothing(index_elements=[WorkloadRow.key])
    )
    workload_id = session.scalar(select(WorkloadRow.id).where(WorkloadRow.key == workload.key))
    session.execute(
        update(WorkloadRow)
        .where(WorkloadRow.id == workload_id, WorkloadRow.io_bytes.is_(None))
        .values(io_bytes=workload.io_bytes)
    )
    return workload_id


def task_data_of(session: Session, *, workload_id: int) -> TaskDataRow | None:
    """The workload's task data row (None: none written yet)."""
    return session.scalars(select(TaskDataRow).where(TaskDataRow.workload_id == workload_id)).one_or_none()


def required_task_data(session: Session, *, workload_id: int) -> TaskDataRow:
    """The workload's task data row; there must be one."""
    return session.scalars(select(TaskDataRow).where(TaskDataRow.workload_id == workload_id)).one()


def store_task_data(
    session: Session, *, workload_id: int, path: str, sha256: str, size: int, has_expected: bool
) -> None:
    """The workload's task data file (relative to the artifact root), replacing its row if
    it has one."""
    values = {"path": path, "sha256": sha256, "size": size, "has_expected": has_expected}
    session.execute(
        pg_insert(TaskDataRow)
        .values(workload_id=workload_id, **values)
        .on_conflict_do_update(index_elements=[TaskDataRow.workload_id], set_=values)
    )


def add_job_task(session: Session, *, job_id: int, workload_id: int, task_key: str) -> int | None:
    """The job's task row of the workload, added after the job's others (weight 1) if the
    job has none; its id."""
    position = session.scalar(select(func.count()).where(JobTask.job_id == job_id))
    session.execute(
        pg_insert(JobTask)
        .values(job_id=job_id, workload_id=workload_id, task_key=task_key, position=position, weight=1)
        .on_conflict_do_nothing(index_elements=[JobTask.job_id, JobTask.workload_id])
    )
    return session.scalar(select(JobTask.id).where(JobTask.job_id == job_id, JobTask.workload_id == workload_id))


def add_alternative(session: Session, *, of_job_task_id: int, workload_id: int, task_key: str) -> int | None:
    """The task row of the workload as an alternative of the job's task row
    `of_job_task_id` (`JobTask.alternative_of`, with that task's weight), added after the
    job's others if the job has no row of the workload; its id."""
    task = session.execute(select(JobTask.job_id, JobTask.weight).where(JobTask.id == of_job_task_id)).one()
    position = session.scalar(select(func.count()).where(JobTask.job_id == task.job_id))
    session.execute(
        pg_insert(JobTask)
        .values(job_id=task.job_id, workload_id=workload_id, task_key=task_key, position=position,
                weight=task.weight, alternative_of=of_job_task_id)  # fmt: skip
        .on_conflict_do_nothing(index_elements=[JobTask.job_id, JobTask.workload_id])
    )
    return session.scalar(select(JobTask.id).where(JobTask.job_id == task.job_id, JobTask.workload_id == workload_id))


def job_task_id(session: Session, *, job_id: int, task_key: str) -> int | None:
    """The id of the job's task row with `task_key` (None: there is none)."""
    return session.scalar(select(JobTask.id).where(JobTask.job_id == job_id, JobTask.task_key == task_key))


@dataclass(frozen=True)
class PreparedTask:
    """A job task row with its workload and task data (as a restarted scheduler finds it)."""

    task_key: str
    workload_id: int
    workload_name: str
    n_inputs: int
    n_outputs: int
    task_data_id: int | None  # None: no task data written
    has_expected: bool | None


def prepared_task(session: Session, *, job_task_id: int) -> PreparedTask:
    """The job task row `job_task_id` (it must exist), its workload and its task data."""
    row = session.execute(
        select(JobTask.task_key, WorkloadRow.id, WorkloadRow.name, WorkloadRow.n_inputs, WorkloadRow.n_outputs, TaskDataRow.id,
               TaskDataRow.has_expected)
        .join(WorkloadRow, WorkloadRow.id == JobTask.workload_id)
        .outerjoin(TaskDataRow, TaskDataRow.workload_id == WorkloadRow.id)
        .where(JobTask.id == job_task_id)
    ).one()
    return PreparedTask(*row)
