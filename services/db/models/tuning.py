"""What is tuned: workloads and their task data, uploaded models and their tasks, and the
jobs tuning them (per-task bests, the curve)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, Boolean, CheckConstraint, ForeignKey, Index, UniqueConstraint, func, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column, relationship

from services.db.models.base import Base, created_time, foreign_key, pg_enum, primary_key, sha256_hex
from services.db.models.devices import DeviceClass
from services.db.states import JobState

JOB_STATE = pg_enum(JobState, "job_state")


class WorkloadRow(Base):
    """A tuning task's program, shared by every model and job that has it.

    `key` is the workload's key (`tunefarm.workloads.base.Workload.key`: name#structural hash), independent of the target; the records'
    task key adds the target (`JobTask.task_key`).
    """

    __tablename__ = "workloads"

    id: Mapped[int] = primary_key()
    key: Mapped[str] = mapped_column(unique=True)
    name: Mapped[str]
    module_json: Mapped[str]  # tvm.ir.save_json of the workload's IRModule
    flops: Mapped[float]  # one call
    n_inputs: Mapped[int]
    n_outputs: Mapped[int]
    # Bytes of its input and output buffers (the timing floor's memory term); None until a
    # scheduler prepared it.
    io_bytes: Mapped[int | None] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = created_time()


class TaskDataRow(Base):
    """A workload's inputs (and reference outputs) as an .npz in the artifact directory."""

    __tablename__ = "task_data"

    id: Mapped[int] = primary_key()
    workload_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("workloads.id"), unique=True)
    path: Mapped[str]
    sha256: Mapped[str] = sha256_hex()
    size: Mapped[int] = mapped_column(BigInteger)
    has_expected: Mapped[bool] = mapped_column(Boolean)  # holds reference outputs to verify against
    created_at: Mapped[datetime] = created_time()


class Model(Base):
    """An uploaded ONNX model and its task table."""

    __tablename__ = "models"
    __table_args__ = (Index("ix_models_team_id_id", "team_id", "id"),)

    id: Mapped[int] = primary_key()
    team_id: Mapped[int] = foreign_key("teams.id")
    name: Mapped[str]
    input_shapes: Mapped[dict[str, Any]]  # {input name: [dims...]} as given at upload
    onnx_path: Mapped[str]
    onnx_sha256: Mapped[str] = sha256_hex()
    onnx_size: Mapped[int] = mapped_column(BigInteger)
    fused_path: Mapped[str]  # tvm.ir.save_json of the fused module (weights included)
    fused_sha256: Mapped[str] = sha256_hex()
    fused_size: Mapped[int] = mapped_column(BigInteger)
    task_table: Mapped[list[Any]]  # ModelTasks.table() rows as dicts, for display
    # [{"name", "shape", "dtype"}] of the imported model's inputs and outputs (manifest, checks).
    inputs: Mapped[list[Any]] = mapped_column(server_default=text("'[]'::jsonb"))
    outputs: Mapped[list[Any]] = mapped_column(server_default=text("'[]'::jsonb"))
    warnings: Mapped[list[Any]] = mapped_column(server_default=text("'[]'::jsonb"))  # the importer's notes
    created_at: Mapped[datetime] = created_time()

    tasks: Mapped[list[ModelTask]] = relationship(order_by="ModelTask.position", back_populates="model")


class ModelTask(Base):
    __tablename__ = "model_tasks"
    __table_args__ = (
        CheckConstraint("weight > 0", name="weight_positive"),
        Index("ix_model_tasks_workload_id", "workload_id"),
    )

    model_id: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("models.id", ondelete="CASCADE"), primary_key=True
    )
    workload_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("workloads.id"), primary_key=True)
    position: Mapped[int]  # order in which the model's main first calls it
    weight: Mapped[int]  # calls per model run
    const_inputs: Mapped[list[Any]]  # input indices bound to weights in every call
    global_vars: Mapped[list[Any]]  # the fused module's PrimFunc names this task stands for

    model: Mapped[Model] = relationship(back_populates="tasks")
    workload: Mapped[WorkloadRow] = relationship()


# -- jobs -------------------------------------------------------------------------------------


class Job(Base):
    """Tuning one model for one device class within a trial budget.

    `trials_used`, the per-task bests (`JobTask`) and the curve (`JobProgress`) are kept up
    to date as measurements arrive, so reading a job costs the same at any trial count.
    """

    __tablename__ = "jobs"
    __table_args__ = (
        CheckConstraint("trial_budget > 0", name="trial_budget_positive"),
        CheckConstraint("trials_used >= 0", name="trials_used_nonnegative"),
        CheckConstraint(
            "latency_target_secs IS NULL OR latency_target_secs > 0", name="latency_target_positive"
        ),
        Index("ix_jobs_team_id_id", "team_id", "id"),
        Index("ix_jobs_state_id", "state", "id"),
    )

    id: Mapped[int] = primary_key()
    team_id: Mapped[int] = foreign_key("teams.id")
    model_id: Mapped[int] = foreign_key("models.id")
    device_class_id: Mapped[int] = foreign_key("device_classes.id")
    trial_budget: Mapped[int]
    latency_target_secs: Mapped[float | None]
    config: Mapped[dict[str, Any]] = mapped_column(server_default=text("'{}'::jsonb"))  # TuneConfig.as_dict()
    state: Mapped[JobState] = mapped_column(JOB_STATE, server_default=JobState.QUEUED.value)
    cancel_requested: Mapped[bool] = mapped_column(server_default=text("false"))
    error: Mapped[str | None]
    trials_used: Mapped[int] = mapped_column(server_default=text("0"))
    est_latency_start_secs: Mapped[float | None]  # estimated model latency before tuning
    est_latency_secs: Mapped[float | None]  # ... with the best kernels found so far
    # The cost model version the job's search started from (None: a fresh model).
    cost_model_version_id: Mapped[int | None] = foreign_key("cost_model_versions.id", nullable=True)
    # Programs the class's shared cost model had been trained on when the job's first batch
    # was ranked (0: that batch was ranked at random); None until then.
    start_model_trained_on: Mapped[int | None]
    # The pretrained base under the cost model the job's search started from: what it
    # learnt from (`services.scheduler.shared_model.pretrained_summary`); None: none.
    cost_model_pretrained: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    # The finished job's summary: stop reason, the tuned model's check and latency.
    result: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    artifact_path: Mapped[str | None]  # the tuned model archive
    artifact_sha256: Mapped[str | None] = sha256_hex(nullable=True)
    artifact_size: Mapped[int | None] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = created_time()
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    updated_at: Mapped[datetime] = mapped_column(server_default=func.now(), onupdate=func.now())

    model: Mapped[Model] = relationship()
    device_class: Mapped[DeviceClass] = relationship()
    tasks: Mapped[list[JobTask]] = relationship(order_by="JobTask.position", back_populates="job")


class JobTask(Base):
    """One task of a job, with its precomputed progress.

    `best_*` is the task's fastest valid measurement that nothing discredited (its
    confirmation is pending, or it was confirmed); `best_confirmed` says which.
    `confirmed_*` is the fastest confirmed one: what the tuned model uses.

    `alternative_of`: the task (row) this one is another program of, by another algorithm
    (`tunefarm.models.alternatives`: a 3x3 convolution by Winograd), with that task's
    weight, added by the scheduler after the model's tasks; None for a task of the model.
    """

    __tablename__ = "job_tasks"
    __table_args__ = (
        UniqueConstraint("job_id", "workload_id"),
        CheckConstraint("weight > 0", name="weight_positive"),
    )

    id: Mapped[int] = primary_key()
    job_id: Mapped[int] = foreign_key("jobs.id", ondelete="CASCADE")
    workload_id: Mapped[int] = foreign_key("workloads.id")
    task_key: Mapped[str]  # the records' task key: workload key @ target hash
    position: Mapped[int]
    weight: Mapped[int]
    trials: Mapped[int] = mapped_column(server_default=text("0"))
    best_cost: Mapped[float | None]  # seconds; None until a valid measurement
    best_measurement_id: Mapped[int | None] = mapped_column(
        BigInteger, ForeignKey("measurements.id", use_alter=True), nullable=True
    )
    # The best was measured under an emulator: best_cost is the emulator's time.
    best_emulated: Mapped[bool] = mapped_column(server_default=text("false"))
    best_confirmed: Mapped[bool] = mapped_column(server_default=text("false"))
    confirmed_cost: Mapped[float | None]
    confirmed_measurement_id: Mapped[int | None] = mapped_column(
        BigInteger, ForeignKey("measurements.id", use_alter=True), nullable=True
    )
    dead_reason: Mapped[str | None]  # why the search gave the task up (space exhausted, ...)
    alternative_of: Mapped[int | None] = foreign_key("job_tasks.id", ondelete="CASCADE", nullable=True)

    job: Mapped[Job] = relationship(back_populates="tasks")
    workload: Mapped[WorkloadRow] = relationship()


class JobProgress(Base):
    """One point of a job's curve, written after each round."""

    __tablename__ = "job_progress"
    __table_args__ = (UniqueConstraint("job_id", "trials"),)

    id: Mapped[int] = primary_key()
    job_id: Mapped[int] = foreign_key("jobs.id", ondelete="CASCADE")
    trials: Mapped[int]
    elapsed_secs: Mapped[float]
    est_latency_secs: Mapped[float | None]
    created_at: Mapped[datetime] = created_time()
