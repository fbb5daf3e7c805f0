"""The farm's tables (SQLAlchemy 2 ORM). The Alembic migrations in `migrations/` create them.

Map, by who writes what:

- the API: `Team`, `Token` (hashed), `Model` and its `ModelTask`s, `Job` (queued),
  `DashboardSession` (hashed);
- the scheduler: `Job` state and progress, `JobTask` (per-task best), `JobProgress`
  (the curve), `Batch` + `BatchCandidate` (a proposed round), `CostModelVersion`;
- the build workers: `WorkloadRow` task data (`TaskDataRow`), `BatchCandidate` builds, `Batch`
  building -> ready;
- the lease service (agents): `Agent`, `Lease`, `Measurement`, `Confirmation`, and the
  confirmation `Batch`es a new best calls for (`services.db.confirmations`);
- a tuned model for a class the scheduler cannot run itself: the scheduler writes a
  `ModelRun`, an agent of the class leases it and the lease service stores its outputs.

Shared across teams and jobs: `WorkloadRow` (a fused subgraph, by its structural key),
`DeviceClass`, `TaskDataRow`, `CostModelVersion` (one series per device class) and the
`Measurement`s of a class, which every new cost model version trains on.

Large blobs (ONNX files, fused modules, built kernels, task data, cost models, tuned
model archives) live in the artifact directory; a row keeps the path relative to it,
the sha256 and the size in bytes (`*_path`, `*_sha256`, `*_size`).

Invariants the schema itself enforces:
- one measurement per batch candidate (`uq_measurements_batch_candidate_id`), so a result
  written twice is stored once; likewise one confirmation per candidate of a
  confirmation batch (`uq_confirmations_batch_candidate_id`);
- at most one active lease per batch (partial unique index `uq_leases_active_batch`);
- token hashes are unique; a team token has a team and an agent token has none.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Double,
    Enum,
    ForeignKey,
    Identity,
    Index,
    Integer,
    MetaData,
    Sequence,
    String,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, MappedColumn, mapped_column, relationship

from services.db.states import (
    AgentState,
    BatchState,
    ConfirmationState,
    JobState,
    LeaseState,
    ModelRunState,
    TokenKind,
)
from tunefarm.records import ErrorKind

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}
"""Constraint names are derived from the columns, so migrations can name what they alter."""

SHA256_HEX_LEN = 64












    # not counted against the agent, never a best


def _pg_enum(cls: type[StrEnum], name: str) -> Enum:
    """A PostgreSQL enum type holding the members' values (lowercase), not their names."""
    return Enum(cls, name=name, values_callable=lambda e: [m.value for m in e], validate_strings=True)


TOKEN_KIND = _pg_enum(TokenKind, "token_kind")
AGENT_STATE = _pg_enum(AgentState, "agent_state")
JOB_STATE = _pg_enum(JobState, "job_state")
BATCH_STATE = _pg_enum(BatchState, "batch_state")
LEASE_STATE = _pg_enum(LeaseState, "lease_state")
ERROR_KIND = _pg_enum(ErrorKind, "error_kind")
MODEL_RUN_STATE = _pg_enum(ModelRunState, "model_run_state")
CONFIRMATION_STATE = _pg_enum(ConfirmationState, "confirmation_state")


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {
        dict[str, Any]: JSONB,
        list[Any]: JSONB,
        datetime: DateTime(timezone=True),
        int: Integer,
        float: Double,
        str: Text,
    }


def _pk() -> MappedColumn[Any]:
    return mapped_column(BigInteger, Identity(), primary_key=True)


def _fk(target: str, *, ondelete: str | None = None, nullable: bool = False) -> MappedColumn[Any]:
    return mapped_column(BigInteger, ForeignKey(target, ondelete=ondelete), nullable=nullable)


def _created() -> MappedColumn[Any]:
    return mapped_column(server_default=func.now())


def _sha256(*, nullable: bool = False) -> MappedColumn[Any]:
    return mapped_column(String(SHA256_HEX_LEN), nullable=nullable)


# -- tenants and credentials ------------------------------------------------------------------


class Team(Base):
    __tablename__ = "teams"

    id: Mapped[int] = _pk()
    name: Mapped[str] = mapped_column(unique=True)
    created_at: Mapped[datetime] = _created()


class Token(Base):
    """A bearer token, stored as the sha256 of the plain token (shown once, at creation)."""

    __tablename__ = "tokens"
    __table_args__ = (
        # Team tokens belong to a team; agent tokens to no team (useless on the team API).
        CheckConstraint("(kind = 'team') = (team_id IS NOT NULL)", name="team_iff_team_kind"),
        Index("ix_tokens_team_id", "team_id"),
    )

    id: Mapped[int] = _pk()
    kind: Mapped[TokenKind] = mapped_column(TOKEN_KIND)
    team_id: Mapped[int | None] = _fk("teams.id", ondelete="CASCADE", nullable=True)
    token_hash: Mapped[str] = mapped_column(String(SHA256_HEX_LEN), unique=True)
    prefix: Mapped[str] = mapped_column(String(24))  # the first characters, to tell tokens apart
    label: Mapped[str] = mapped_column(server_default="")
    created_at: Mapped[datetime] = _created()
    revoked_at: Mapped[datetime | None]

    team: Mapped[Team | None] = relationship()


class DashboardSession(Base):
    """A login to the dashboard: its cookie holds a random session id, stored here as
    its sha256 only. Logging out deletes the row; it ends at `expires_at`, and when the
    token it was opened with is revoked (or its team deleted)."""

    __tablename__ = "dashboard_sessions"
    __table_args__ = (Index("ix_dashboard_sessions_expires_at", "expires_at"),)

    id: Mapped[int] = _pk()
    session_hash: Mapped[str] = mapped_column(String(SHA256_HEX_LEN), unique=True)
    team_id: Mapped[int] = _fk("teams.id", ondelete="CASCADE")
    token_id: Mapped[int] = _fk("tokens.id", ondelete="CASCADE")
    created_at: Mapped[datetime] = _created()
    expires_at: Mapped[datetime]


# -- devices ----------------------------------------------------------------------------------


class DeviceClass(Base):
    """A kind of board: every agent of a class measures for the same TVM target."""

    __tablename__ = "device_classes"

    id: Mapped[int] = _pk()
    name: Mapped[str] = mapped_column(unique=True)
    target: Mapped[dict[str, Any]]  # TVM's JSON target dict
    description: Mapped[str] = mapped_column(server_default="")
    created_at: Mapped[datetime] = _created()


class Agent(Base):
    """A board's agent. Counters are kept up to date by `measurements.record_measurement` and,
    for its timings' confirmations, `confirmations.record_confirmations`; whether its
    timings are believed follows from them (`services.db.trust`)."""

    __tablename__ = "agents"
    __table_args__ = (Index("ix_agents_device_class_id", "device_class_id"),)

    id: Mapped[int] = _pk()
    device_class_id: Mapped[int] = _fk("device_classes.id")
    name: Mapped[str] = mapped_column(unique=True)
    token_id: Mapped[int | None] = _fk("tokens.id", ondelete="SET NULL", nullable=True)
    capabilities: Mapped[dict[str, Any]] = mapped_column(server_default=text("'{}'::jsonb"))
    state: Mapped[AgentState] = mapped_column(AGENT_STATE, server_default=AgentState.IDLE.value)
    registered_at: Mapped[datetime] = _created()
    last_heartbeat_at: Mapped[datetime | None]
    measurements_done: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    # {error kind: count} of the agent's measurements that are errors.
    errors_by_kind: Mapped[dict[str, Any]] = mapped_column(server_default=text("'{}'::jsonb"))
    # Its results below the timing floor (`services.db.timing_floor`), measurements and confirmations.
    below_floor: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    # Its timings another measurement confirmed / another agent found slower (or wrong).
    confirmations_agreed: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    confirmations_disputed: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    # Set by an operator (`tunefarm farm agent quarantine`): no leases (state disabled), and its
    # unconfirmed measurements count for nothing (no best, no training).
    quarantined_at: Mapped[datetime | None]
    # sha256 of the secret its last registration was given (`tokens.hash_token`): every
    # call naming the agent must carry that secret; None: none issued yet.
    secret_hash: Mapped[str | None] = _sha256(nullable=True)

    device_class: Mapped[DeviceClass] = relationship()


# -- what is tuned ----------------------------------------------------------------------------


class WorkloadRow(Base):
    """A tuning task's program, shared by every model and job that has it.

    `key` is the workload's key (`tunefarm.workloads.base.Workload.key`: name#structural hash), independent of the target; the records'
    task key adds the target (`JobTask.task_key`).
    """

    __tablename__ = "workloads"

    id: Mapped[int] = _pk()
    key: Mapped[str] = mapped_column(unique=True)
    name: Mapped[str]
    module_json: Mapped[str]  # tvm.ir.save_json of the workload's IRModule
    flops: Mapped[float]  # one call
    n_inputs: Mapped[int]
    n_outputs: Mapped[int]
    # Bytes of its input and output buffers (the timing floor's memory term); None until a
    # scheduler prepared it.
    io_bytes: Mapped[int | None] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = _created()


class TaskDataRow(Base):
    """A workload's inputs (and reference outputs) as an .npz in the artifact directory."""

    __tablename__ = "task_data"

    id: Mapped[int] = _pk()
    workload_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("workloads.id"), unique=True)
    path: Mapped[str]
    sha256: Mapped[str] = _sha256()
    size: Mapped[int] = mapped_column(BigInteger)
    has_expected: Mapped[bool] = mapped_column(Boolean)  # holds reference outputs to verify against
    created_at: Mapped[datetime] = _created()


class Model(Base):
    """An uploaded ONNX model and its task table."""

    __tablename__ = "models"
    __table_args__ = (Index("ix_models_team_id_id", "team_id", "id"),)

    id: Mapped[int] = _pk()
    team_id: Mapped[int] = _fk("teams.id")
    name: Mapped[str]
    input_shapes: Mapped[dict[str, Any]]  # {input name: [dims...]} as given at upload
    onnx_path: Mapped[str]
    onnx_sha256: Mapped[str] = _sha256()
    onnx_size: Mapped[int] = mapped_column(BigInteger)
    fused_path: Mapped[str]  # tvm.ir.save_json of the fused module (weights included)
    fused_sha256: Mapped[str] = _sha256()
    fused_size: Mapped[int] = mapped_column(BigInteger)
    task_table: Mapped[list[Any]]  # ModelTasks.table() rows as dicts, for display
    # [{"name", "shape", "dtype"}] of the imported model's inputs and outputs (manifest, checks).
    inputs: Mapped[list[Any]] = mapped_column(server_default=text("'[]'::jsonb"))
    outputs: Mapped[list[Any]] = mapped_column(server_default=text("'[]'::jsonb"))
    warnings: Mapped[list[Any]] = mapped_column(server_default=text("'[]'::jsonb"))  # the importer's notes
    created_at: Mapped[datetime] = _created()

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

    id: Mapped[int] = _pk()
    team_id: Mapped[int] = _fk("teams.id")
    model_id: Mapped[int] = _fk("models.id")
    device_class_id: Mapped[int] = _fk("device_classes.id")
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
    cost_model_version_id: Mapped[int | None] = _fk("cost_model_versions.id", nullable=True)
    # Programs the class's shared cost model had been trained on when the job's first batch
    # was ranked (0: that batch was ranked at random); None until then.
    start_model_trained_on: Mapped[int | None]
    # The finished job's summary: stop reason, the tuned model's check and latency.
    result: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    artifact_path: Mapped[str | None]  # the tuned model archive
    artifact_sha256: Mapped[str | None] = _sha256(nullable=True)
    artifact_size: Mapped[int | None] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = _created()
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
    """

    __tablename__ = "job_tasks"
    __table_args__ = (
        UniqueConstraint("job_id", "workload_id"),
        CheckConstraint("weight > 0", name="weight_positive"),
    )

    id: Mapped[int] = _pk()
    job_id: Mapped[int] = _fk("jobs.id", ondelete="CASCADE")
    workload_id: Mapped[int] = _fk("workloads.id")
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

    job: Mapped[Job] = relationship(back_populates="tasks")
    workload: Mapped[WorkloadRow] = relationship()


class JobProgress(Base):
    """One point of a job's curve, written after each round."""

    __tablename__ = "job_progress"
    __table_args__ = (UniqueConstraint("job_id", "trials"),)

    id: Mapped[int] = _pk()
    job_id: Mapped[int] = _fk("jobs.id", ondelete="CASCADE")
    trials: Mapped[int]
    elapsed_secs: Mapped[float]
    est_latency_secs: Mapped[float | None]
    created_at: Mapped[datetime] = _created()


# -- measuring --------------------------------------------------------------------------------


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
    )

    id: Mapped[int] = _pk()
    job_id: Mapped[int] = _fk("jobs.id", ondelete="CASCADE")
    job_task_id: Mapped[int] = _fk("job_tasks.id", ondelete="CASCADE")
    workload_id: Mapped[int] = _fk("workloads.id")
    device_class_id: Mapped[int] = _fk("device_classes.id")
    state: Mapped[BatchState] = mapped_column(BATCH_STATE, server_default=BatchState.PROPOSED.value)
    timing: Mapped[dict[str, Any]]  # TimingConfig as a dict
    build_timeout_secs: Mapped[float]
    run_timeout_secs: Mapped[float]
    build_error: Mapped[str | None]  # why the whole batch failed to build (state failed)
    attempts: Mapped[int] = mapped_column(server_default=text("0"))  # leases granted so far
    confirms_measurement_id: Mapped[int | None] = mapped_column(
        BigInteger, ForeignKey("measurements.id", use_alter=True), nullable=True
    )
    avoid_agent_id: Mapped[int | None] = _fk("agents.id", nullable=True)
    created_at: Mapped[datetime] = _created()
    ready_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]

    candidates: Mapped[list[BatchCandidate]] = relationship(
        order_by="BatchCandidate.position", back_populates="batch"
    )


class BatchCandidate(Base):
    __tablename__ = "batch_candidates"
    __table_args__ = (UniqueConstraint("batch_id", "candidate_key"),)

    id: Mapped[int] = _pk()
    batch_id: Mapped[int] = _fk("batches.id", ondelete="CASCADE")
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

    id: Mapped[int] = _pk()
    batch_id: Mapped[int] = _fk("batches.id", ondelete="CASCADE")
    agent_id: Mapped[int] = _fk("agents.id")
    state: Mapped[LeaseState] = mapped_column(LEASE_STATE, server_default=LeaseState.ACTIVE.value)
    granted_at: Mapped[datetime] = _created()
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

    id: Mapped[int] = _pk()
    batch_candidate_id: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("batch_candidates.id"), unique=True
    )
    job_id: Mapped[int] = _fk("jobs.id")
    job_task_id: Mapped[int] = _fk("job_tasks.id")
    workload_id: Mapped[int] = _fk("workloads.id")
    device_class_id: Mapped[int] = _fk("device_classes.id")
    agent_id: Mapped[int | None] = _fk("agents.id", nullable=True)
    lease_id: Mapped[int | None] = _fk("leases.id", nullable=True)
    candidate_key: Mapped[str]
    cost: Mapped[float | None]  # seconds per call (median); None for an error
    error_kind: Mapped[ErrorKind] = mapped_column(ERROR_KIND)
    record: Mapped[dict[str, Any]]  # the MeasureRecord JSON line, parsed
    fingerprint: Mapped[dict[str, Any]]  # environment: TVM version, device capabilities
    confirmation: Mapped[ConfirmationState | None] = mapped_column(CONFIRMATION_STATE)
    confirmed_by_agent_id: Mapped[int | None] = _fk("agents.id", nullable=True)
    vouched_seq: Mapped[int | None] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = _created()


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

    id: Mapped[int] = _pk()
    batch_candidate_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("batch_candidates.id"), unique=True)
    measurement_id: Mapped[int] = _fk("measurements.id")
    agent_id: Mapped[int | None] = _fk("agents.id", nullable=True)
    lease_id: Mapped[int | None] = _fk("leases.id", nullable=True)
    cost: Mapped[float | None]  # seconds per call (median); None for an error
    error_kind: Mapped[ErrorKind] = mapped_column(ERROR_KIND)
    outcome: Mapped[ConfirmationState] = mapped_column(CONFIRMATION_STATE)
    record: Mapped[dict[str, Any]]
    fingerprint: Mapped[dict[str, Any]]
    created_at: Mapped[datetime] = _created()


class ModelRun(Base):
    """A tuned model run on an agent of its class: once for the outputs the scheduler
    checks against the reference, then `repeat` timed inferences (the model's latency on
    the class's device). Made for classes whose code the scheduler's host cannot run
    (another architecture). `result` holds the latency samples and who ran them:
    {"latency_samples": [s...], "run_secs", "agent", "emulated", "fingerprint"}.
    """

    __tablename__ = "model_runs"
    __table_args__ = (
        CheckConstraint("attempts >= 0", name="attempts_nonnegative"),
        CheckConstraint("state <> 'leased' OR (agent_id IS NOT NULL AND expires_at IS NOT NULL)", name="leased_has_agent"),
        # The queue of a class: ready runs, and leased ones whose lease may have expired.
        Index("ix_model_runs_queue", "device_class_id", "id", postgresql_where=text("state IN ('ready', 'leased')")),
        Index("ix_model_runs_job_id", "job_id"),
    )

    id: Mapped[int] = _pk()
    job_id: Mapped[int] = _fk("jobs.id", ondelete="CASCADE")
    device_class_id: Mapped[int] = _fk("device_classes.id")
    state: Mapped[ModelRunState] = mapped_column(MODEL_RUN_STATE, server_default=ModelRunState.READY.value)
    library_path: Mapped[str]
    library_sha256: Mapped[str] = _sha256()
    library_size: Mapped[int] = mapped_column(BigInteger)
    # The farm's signature of the library (hex; services.protocol.signing); None: unsigned.
    library_signature: Mapped[str | None]
    inputs_path: Mapped[str]  # .npz: arr_0, arr_1, ... in the model's input order
    inputs_sha256: Mapped[str] = _sha256()
    inputs_size: Mapped[int] = mapped_column(BigInteger)
    repeat: Mapped[int]
    warmup: Mapped[int]
    timeout_secs: Mapped[float]
    attempts: Mapped[int] = mapped_column(server_default=text("0"))  # leases granted so far
    agent_id: Mapped[int | None] = _fk("agents.id", nullable=True)  # the agent of the latest lease
    expires_at: Mapped[datetime | None]  # while leased
    outputs_path: Mapped[str | None]  # .npz: arr_0, arr_1, ... once done
    result: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    error: Mapped[str | None]
    created_at: Mapped[datetime] = _created()
    finished_at: Mapped[datetime | None]


class CostModelVersion(Base):
    """A saved cost model of a device class; versions count up from 1 per class."""

    __tablename__ = "cost_model_versions"
    __table_args__ = (
        UniqueConstraint("device_class_id", "version"),
        CheckConstraint("version > 0", name="version_positive"),
    )

    id: Mapped[int] = _pk()
    device_class_id: Mapped[int] = _fk("device_classes.id")
    version: Mapped[int]
    feature_version: Mapped[int]  # the feature version it was trained with (tunefarm.search.features)
    path: Mapped[str]
    sha256: Mapped[str] = _sha256()
    size: Mapped[int] = mapped_column(BigInteger)
    trained_on: Mapped[int]  # programs (measurements) in its training set
    # The class's highest `Measurement.vouched_seq` in the training set (the id, for
    # measurements stored before vouching existed): the next version trains on the
    # measurements vouched for after it (plus what this one saw).
    last_measurement_id: Mapped[int | None] = mapped_column(BigInteger)
    # The other class's version this class's model started from (tunefarm.search.cost_model.transfer),
    # on every version descending from it; None for a model trained on the class's own data only.
    transferred_from_id: Mapped[int | None] = _fk("cost_model_versions.id", nullable=True)
    created_at: Mapped[datetime] = _created()
