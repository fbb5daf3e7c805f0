"""The API's settings: the only place the API process reads the environment.

Environment variables (prefix TUNEFARM_), besides the database's (`DatabaseSettings`):

| variable | default | meaning |
|---|---|---|
| TUNEFARM_API_BIND | 127.0.0.1:8000 | host:port uvicorn listens on |
| TUNEFARM_ARTIFACT_ROOT | .tunefarm/artifacts | the shared artifact directory (models, tuned archives) |
| TUNEFARM_MAX_UPLOAD_BYTES | 268435456 | largest ONNX upload (413 above it, nothing stored) |
| TUNEFARM_MAX_TRIAL_BUDGET | 100000 | largest trial budget a job may ask for |
| TUNEFARM_INTAKE_TIMEOUT_SECS | 600 | how long importing an uploaded model may take |
| TUNEFARM_PAGE_SIZE_MAX | 100 | largest page of a list endpoint |
| TUNEFARM_TOKEN_CACHE_SECS | 10 | how long a verified team token is trusted without asking the database (a revoked one is dropped at once) |
| TUNEFARM_API_WORKERS | 1 | uvicorn worker processes |
| TUNEFARM_REDIS_URL | redis://127.0.0.1:6379/0 | the build queues' Redis (`/metrics` reports their depth) |
| TUNEFARM_QUEUE_PREFIX | tunefarm | queue names are `<prefix>:build:<device class>` (as the workers') |
| TUNEFARM_LEASE_SECS | 30 | the lease window: `/metrics` counts an agent alive if it heartbeat within it |
| TUNEFARM_METRICS_TOKEN | unset | when set, `/metrics` wants it as a bearer token; unset, `/metrics` is open |
"""

from __future__ import annotations

from pathlib import Path

from pydantic_settings import SettingsConfigDict

from services.db.settings import DatabaseSettings
from services.worker.settings import DEFAULT_REDIS_URL


class ApiSettings(DatabaseSettings):
    model_config = SettingsConfigDict(env_prefix="TUNEFARM_", extra="ignore")

    # host:port to listen on (0.0.0.0:8000 in a container).
    api_bind: str = "127.0.0.1:8000"
    # Shared directory of uploaded models and tuned model archives (rows keep paths
    # relative to it); the scheduler, the build workers and the lease service share it.
    artifact_root: Path = Path(".tunefarm/artifacts")
    # Largest ONNX file a team may upload, in bytes; the request body may exceed it only
    # by `multipart_overhead_bytes` (the form's other fields and its framing).
    max_upload_bytes: int = 256 * 1024 * 1024
    multipart_overhead_bytes: int = 64 * 1024
    # Largest trial budget of one job (a larger one is a typo, not a plan).
    max_trial_budget: int = 100_000
    # Seconds importing, simplifying and fusing one uploaded model may take (in a child
    # process: a model that crashes TVM's importer never takes the API down).
    intake_timeout_secs: float = 600.0
    # Items per page of the list endpoints: the default and the most a client may ask for.
    page_size_default: int = 20
    page_size_max: int = 100
    # A verified team token is trusted this long before the database is asked again;
    # a revoked token is dropped at once (services/db/revocations.py).
    token_cache_secs: float = 10.0
    # uvicorn worker processes (each has its own database pool and intake child).
    api_workers: int = 1
    # The build workers' Redis and queue prefix (the same variables as theirs): /metrics
    # reports the depth of each device class's build queue.
    redis_url: str = DEFAULT_REDIS_URL
    queue_prefix: str = "tunefarm"
    # The lease service's lease window (the same variable): an agent that heartbeat
    # within it counts as alive in /metrics.
    lease_secs: float = 30.0
    # A secret Prometheus sends as a bearer token to scrape /metrics; None: /metrics is open.
    metrics_token: str | None = None

    @property
    def host(self) -> str:
        return self.api_bind.rsplit(":", 1)[0]

    @property
    def port(self) -> int:
        return int(self.api_bind.rsplit(":", 1)[1])
