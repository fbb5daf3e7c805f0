"""The farm's work on a job: batches and their candidates, leases to agents, measurements and
their confirmations, tuned models run on an agent, and the class cost models trained on it all."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, CheckConstraint, ForeignKey, Index, Sequence, UniqueConstraint, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column, relationship

from services.db.models.base import Base, created_time, foreign_key, pg_enum, primary_key, sha256_hex
from services.db.models.devices import Agent
from services.db.states import BatchState, ConfirmationState, LeaseState, ModelRunState
from tunefarm.records import ErrorKind

BATCH_STATE = pg_enum(BatchState, "batch_state")
LEASE_STATE = pg_enum(LeaseState, "lease_state")
ERROR_KIND = pg_enum(ErrorKind, "error_kind")
MODEL_RUN_STATE = pg_enum(ModelRunState, "model_run_state")
CONFIRMATION_STATE = pg_enum(ConfirmationState, "confirmation_state")


class Batch(Base):
    """One round of one task of a job: the scheduler's `MeasureBatch`, with its lifecycle.

    `device_class_id` and `workload_id` repeat the job's and the task's so that the lease
    query reads one table. `ready_at` orders the queue (FIFO); a batch that goes back to
    the queue keeps its place.

    A confirmation batch (`confirms_measurement_id` set) re-measures one measured kernel,
    already built: it is created ready, belongs to the measured job and task, and its
    result is a `Confirmation`, not a `Measurement`. An agent other than `avoid_agent_id`
    (the one whose time it checks) leases it when one that may confirm is live.
    """

    __tablename__ = "batches"
    __table_args__ = (
        CheckConstraint("attempts >= 0", name="attempts_nonnegative"),
        # A batch in the queue has its place in it.
        CheckConstraint(
            "ready_at IS NOT NULL OR state NOT IN ('ready', 'leased')", name="queued_has_ready_at"
        ),
        # The queue: ready batches (and leased ones, whose lease may have expired) of a class.
        Index(
            "ix_batches_queue",
            "device_class_id",
            "ready_at",
            "id",
            postgresql_where=text("state IN ('ready', 'leased')"),
        ),
        Index("ix_batches_job_id_id", "job_id", "id"),
        Index("ix_batches_job_task_id", "job_task_id"),
        # A job's open batches (its progress names the one that has waited longest).
        Index("ix_batches_open_by_job", "job_id", postgresql_where=text("state IN ('proposed', 'building', 'ready')")),
    )

    id: Mapped[int] = primary_key()
    job_id: Mapped[int] = foreign_key("jobs.id", ondelete="CASCADE")
    job_task_id: Mapped[int] = foreign_key("job_tasks.id", ondelete="CASCADE")
    workload_id: Mapped[int] = foreign_key("workloads.id")
    device_class_id: Mapped[int] = foreign_key("device_classes.id")
    state: Mapped[BatchState] = mapped_column(BATCH_STATE, server_default=BatchState.PROPOSED.value)
    timing: Mapped[dict[str, Any]]  # TimingConfig as a dict
    build_timeout_secs: Mapped[float]
    run_timeout_secs: Mapped[float]
    build_error: Mapped[str | None]  # why the whole batch failed to build (state failed)
    attempts: Mapped[int] = mapped_column(server_default=text("0"))  # leases granted so far
    confirms_measurement_id: Mapped[int | None] = mapped_column(
        BigInteger, ForeignKey("measurements.id", use_alter=True), nullable=True
    )
    avoid_agent_id: Mapped[int | None] = foreign_key("agents.id", nullable=True)
    created_at: Mapped[datetime] = created_time()
    ready_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]

    candidates: Mapped[list[BatchCandidate]] = relationship(
        order_by="BatchCandidate.position", back_populates="batch"
    )


class BatchCandidate(Base):
    __tablename__ = "batch_candidates"
    __table_args__ = (UniqueConstraint("batch_id", "candidate_key"),)

    id: Mapped[int] = primary_key()
    batch_id: Mapped[int] = foreign_key("batches.id", ondelete="CASCADE")
    position: Mapped[int]  # order in the proposal (best predicted first)
    candidate_key: Mapped[str]  # Candidate.key
    input: Mapped[dict[str, Any]]  # the MeasureInput (codec.input_to_json)
    artifact_path: Mapped[str | None]  # the built kernel, once built
    # The farm's signature of the kernel (hex; services.protocol.signing); None: unsigned.
    artifact_signature: Mapped[str | None]
    build: Mapped[dict[str, Any] | None] = mapped_column(JSONB)  # the BuildResult (codec.build_to_json)

    batch: Mapped[Batch] = relationship(back_populates="candidates")


class Lease(Base):
    __tablename__ = "leases"
    __table_args__ = (
        # At most one active lease per batch.
        Index("uq_leases_active_batch", "batch_id", unique=True, postgresql_where=text("state = 'active'")),
        # Finding expired leases, and an agent's active ones.
        Index("ix_leases_active_expires_at", "expires_at", postgresql_where=text("state = 'active'")),
        Index("ix_leases_active_agent_id", "agent_id", postgresql_where=text("state = 'active'")),
        Index("ix_leases_batch_id", "batch_id"),
    )

    id: Mapped[int] = primary_key()
    batch_id: Mapped[int] = foreign_key("batches.id", ondelete="CASCADE")
    agent_id: Mapped[int] = foreign_key("agents.id")
    state: Mapped[LeaseState] = mapped_column(LEASE_STATE, server_default=LeaseState.ACTIVE.value)
    granted_at: Mapped[datetime] = created_time()
    expires_at: Mapped[datetime]
    finished_at: Mapped[datetime | None]

    batch: Mapped[Batch] = relationship()
    agent: Mapped[Agent] = relationship()


class Measurement(Base):
    """One measured candidate. The unique batch candidate makes a second write of the same
    result a no-op; job, task, workload and class are copied from the batch at insert so
    that the hot reads (a job's records, a class's training set) use one index each.
    Measurements are never cascaded away: a job, batch or agent that has some cannot be
    deleted (every class's cost model trains on them).

    `agent_id`/`lease_id` are None for a candidate whose build failed (measured by nobody).

    Trust (`services.db.confirmations`): a measurement that became its task's best is
    re-measured (`confirmation`, `confirmed_by_agent_id`); the class's cost model learns
    a measurement once its agent is in good standing, in the order `vouched_seq` numbers
    them (None: not vouched for, yet or ever).
    """

    __tablename__ = "measurements"
    __table_args__ = (
        CheckConstraint("cost IS NULL OR cost >= 0", name="cost_nonnegative"),
        CheckConstraint("(error_kind = 'none') OR cost IS NULL", name="error_has_no_cost"),
        Index("ix_measurements_job_id_id", "job_id", "id"),
        Index("ix_measurements_device_class_id_id", "device_class_id", "id"),
        Index("ix_measurements_workload_id_device_class_id", "workload_id", "device_class_id"),
        Index("ix_measurements_agent_id", "agent_id"),
        Index("ix_measurements_job_task_id_cost", "job_task_id", "cost"),
        Index(
            "ix_measurements_device_class_id_vouched_seq",
            "device_class_id",
            "vouched_seq",
            postgresql_where=text("vouched_seq IS NOT NULL"),
        ),
        Index("ix_measurements_unvouched", "device_class_id", postgresql_where=text("vouched_seq IS NULL")),
    )

    id: Mapped[int] = primary_key()
    batch_candidate_id: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("batch_candidates.id"), unique=True
    )
    job_id: Mapped[int] = foreign_key("jobs.id")
    job_task_id: Mapped[int] = foreign_key("job_tasks.id")
    workload_id: Mapped[int] = foreign_key("workloads.id")
    device_class_id: Mapped[int] = foreign_key("device_classes.id")
    agent_id: Mapped[int | None] = foreign_key("agents.id", nullable=True)
    lease_id: Mapped[int | None] = foreign_key("leases.id", nullable=True)
    candidate_key: Mapped[str]
    cost: Mapped[float | None]  # seconds per call (median); None for an error
    error_kind: Mapped[ErrorKind] = mapped_column(ERROR_KIND)
    record: Mapped[dict[str, Any]]  # the MeasureRecord JSON line, parsed
    fingerprint: Mapped[dict[str, Any]]  # environment: TVM version, device capabilities
    confirmation: Mapped[ConfirmationState | None] = mapped_column(CONFIRMATION_STATE)
    confirmed_by_agent_id: Mapped[int | None] = foreign_key("agents.id", nullable=True)
    vouched_seq: Mapped[int | None] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = created_time()


MEASUREMENT_VOUCH_SEQ = Sequence("measurements_vouched_seq", metadata=Base.metadata)
"""Numbers `Measurement.vouched_seq` in the order measurements are vouched for."""


class Confirmation(Base):
    """The result of a confirmation batch's candidate: the kernel of measurement
    `measurement_id` measured again (by `agent_id`, None when the batch was given up), and
    what that made of it (`outcome`). Written once per candidate, like a measurement."""

    __tablename__ = "confirmations"
    __table_args__ = (
        CheckConstraint("cost IS NULL OR cost >= 0", name="cost_nonnegative"),
        CheckConstraint("(error_kind = 'none') OR cost IS NULL", name="error_has_no_cost"),
        Index("ix_confirmations_measurement_id", "measurement_id"),
        Index("ix_confirmations_agent_id", "agent_id"),
    )

    id: Mapped[int] = primary_key()
    batch_candidate_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("batch_candidates.id"), unique=True)
    measurement_id: Mapped[int] = foreign_key("measurements.id")
    agent_id: Mapped[int | None] = foreign_key("agents.id", nullable=True)
    lease_id: Mapped[int | None] = foreign_key("leases.id", nullable=True)
    cost: Mapped[float | None]  # seconds per call (median); None for an error
    error_kind: Mapped[ErrorKind] = mapped_column(ERROR_KIND)
    outcome: Mapped[ConfirmationState] = mapped_column(CONFIRMATION_STATE)
    record: Mapped[dict[str, Any]]
    fingerprint: Mapped[dict[str, Any]]
    created_at: Mapped[datetime] = created_time()


class ModelRun(Base):
    """A tuned model run on an agent of its class: once for the outputs the scheduler
    checks against the reference, then `repeat` timed inferences (the model's latency on
    the class's device), in alternating rounds with the peers (onnxruntime, OpenVINO) on
    `onnx_path` when the run has one. Every tuned model of the farm is checked and timed
    so. `result` holds the latency samples and who ran them: {"latency_samples": [s...],
    "round_medians", "threads", "run_secs", "agent", "emulated", "fingerprint"};
    `peer_latencies` the peers' per peer: {"onnxruntime": {"latency_samples",
    "round_medians", "threads"} or {"error": why it was not timed}, ...}.
    """

    __tablename__ = "model_runs"
    __table_args__ = (
        CheckConstraint("attempts >= 0", name="attempts_nonnegative"),
        CheckConstraint("state <> 'leased' OR (agent_id IS NOT NULL AND expires_at IS NOT NULL)", name="leased_has_agent"),
        # The queue of a class: ready runs, and leased ones whose lease may have expired.
        Index("ix_model_runs_queue", "device_class_id", "id", postgresql_where=text("state IN ('ready', 'leased')")),
        Index("ix_model_runs_job_id", "job_id"),
    )

    id: Mapped[int] = primary_key()
    job_id: Mapped[int] = foreign_key("jobs.id", ondelete="CASCADE")
    device_class_id: Mapped[int] = foreign_key("device_classes.id")
    state: Mapped[ModelRunState] = mapped_column(MODEL_RUN_STATE, server_default=ModelRunState.READY.value)
    library_path: Mapped[str]
    library_sha256: Mapped[str] = sha256_hex()
    library_size: Mapped[int] = mapped_column(BigInteger)
    # The farm's signature of the library (hex; services.protocol.signing); None: unsigned.
    library_signature: Mapped[str | None]
    inputs_path: Mapped[str]  # .npz: arr_0, arr_1, ... in the model's input order
    inputs_sha256: Mapped[str] = sha256_hex()
    inputs_size: Mapped[int] = mapped_column(BigInteger)
    # The ONNX graph the peers are timed on beside the model, and the names of the inputs'
    # arrays in order (their feeds); None: no peer is timed (an untimed run, a GPU's model).
    onnx_path: Mapped[str | None]
    onnx_sha256: Mapped[str | None] = sha256_hex(nullable=True)
    onnx_size: Mapped[int | None] = mapped_column(BigInteger)
    onnx_signature: Mapped[str | None]  # the farm's signature of the graph (hex), like the library's
    input_names: Mapped[list[str] | None] = mapped_column(JSONB)
    repeat: Mapped[int]
    warmup: Mapped[int]
    timeout_secs: Mapped[float]
    attempts: Mapped[int] = mapped_column(server_default=text("0"))  # leases granted so far
    agent_id: Mapped[int | None] = foreign_key("agents.id", nullable=True)  # the agent of the latest lease
    expires_at: Mapped[datetime | None]  # while leased
    outputs_path: Mapped[str | None]  # .npz: arr_0, arr_1, ... once done
    result: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    peer_latencies: Mapped[dict[str, Any] | None] = mapped_column(JSONB)  # once done, when peers were asked for
    error: Mapped[str | None]
    created_at: Mapped[datetime] = created_time()
    finished_at: Mapped[datetime | None]


class CostModelVersion(Base):
    """A saved cost model of a device class; versions count up from 1 per class."""

    __tablename__ = "cost_model_versions"
    __table_args__ = (
        UniqueConstraint("device_class_id", "version"),
        CheckConstraint("version > 0", name="version_positive"),
    )

    id: Mapped[int] = primary_key()
    device_class_id: Mapped[int] = foreign_key("device_classes.id")
    version: Mapped[int]
    feature_version: Mapped[int]  # the feature version it was trained with (tunefarm.search.features)
    path: Mapped[str]
    sha256: Mapped[str] = sha256_hex()
    size: Mapped[int] = mapped_column(BigInteger)
    trained_on: Mapped[int]  # programs (measurements) in its training set
    # The class's highest `Measurement.vouched_seq` in the training set (the id, for
    # measurements stored before vouching existed): the next version trains on the
    # measurements vouched for after it (plus what this one saw).
    last_measurement_id: Mapped[int | None] = mapped_column(BigInteger)
    # The other class's version this class's model started from (tunefarm.search.cost_model.transfer),
    # on every version descending from it; None for a model trained on the class's own data only.
    transferred_from_id: Mapped[int | None] = foreign_key("cost_model_versions.id", nullable=True)
    created_at: Mapped[datetime] = created_time()
