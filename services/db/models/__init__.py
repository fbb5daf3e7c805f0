"""The farm's tables (SQLAlchemy 2 ORM). The Alembic migrations in `migrations/` create them.

| module | tables |
|---|---|
| `base.py` | none: `Base` (constraint naming, column types) and the shared column helpers |
| `accounts.py` | `Team`, `Token`, `DashboardSession` |
| `devices.py` | `DeviceClass`, `Agent` |
| `tuning.py` | `WorkloadRow`, `TaskDataRow`, `Model`, `ModelTask`, `Job`, `JobTask`, `JobProgress` |
| `farm_work.py` | `Batch`, `BatchCandidate`, `Lease`, `Measurement`, `Confirmation`, `ModelRun`, `CostModelVersion` |

Importers name the tables from here (`from services.db.models import Job`). Importing any of
them loads every module: relationships name their targets by class, which SQLAlchemy finds in
`Base`'s registry, and `Base.metadata` (what Alembic compares against) holds every table only then.

Map, by who writes what:

- the API: `Team`, `Token` (hashed), `Model` and its `ModelTask`s, `Job` (queued),
  `DashboardSession` (hashed);
- the scheduler: `Job` state and progress, `JobTask` (per-task best), `JobProgress`
  (the curve), `Batch` + `BatchCandidate` (a proposed round), `CostModelVersion`;
- the build workers: `WorkloadRow` task data (`TaskDataRow`), `BatchCandidate` builds, `Batch`
  building -> ready;
- the lease service (agents): `Agent`, `Lease`, `Measurement`, `Confirmation`, and the
  confirmation `Batch`es a new best calls for (`services.db.confirmations`);
- every tuned model: the scheduler writes a `ModelRun`, an agent of the class leases it
  and the lease service stores its outputs and latencies (its own, and its peers').

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

from services.db.models.accounts import DashboardSession, Team, Token
from services.db.models.base import Base
from services.db.models.devices import Agent, DeviceClass
from services.db.models.farm_work import (
    MEASUREMENT_VOUCH_SEQ,
    Batch,
    BatchCandidate,
    Confirmation,
    CostModelVersion,
    Lease,
    Measurement,
    ModelRun,
)
from services.db.models.tuning import Job, JobProgress, JobTask, Model, ModelTask, TaskDataRow, WorkloadRow

__all__ = [
    "MEASUREMENT_VOUCH_SEQ",
    "Agent",
    "Base",
    "Batch",
    "BatchCandidate",
    "Confirmation",
    "CostModelVersion",
    "DashboardSession",
    "DeviceClass",
    "Job",
    "JobProgress",
    "JobTask",
    "Lease",
    "Measurement",
    "Model",
    "ModelRun",
    "ModelTask",
    "TaskDataRow",
    "Team",
    "Token",
    "WorkloadRow",
]
