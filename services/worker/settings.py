"""The build worker's settings: the only place it reads the environment.

| variable | default | meaning |
|---|---|---|
| TUNEFARM_DATABASE_URL, TUNEFARM_ARTIFACT_ROOT, TUNEFARM_REDIS_URL, TUNEFARM_QUEUE_PREFIX, ... | see `ServiceSettings` | the farm database, the shared artifact directory (kernels are written under kernels/), the RQ broker and its queue names |
| TUNEFARM_BUILD_PROCESSES | 0 | isolated build processes per worker (0: one per physical core) |
| TUNEFARM_BUILD_JOB_TIMEOUT_SECS | 1800 | RQ's limit on one build_batch job |
| TUNEFARM_DATABASE_RETRY_SECS | 120 | how long a build job waits for a database that is away (a restart) |
| TUNEFARM_SIGNING_KEY_FILE | unset | the farm's Ed25519 private key (PEM): every kernel built is signed with it |
"""

from __future__ import annotations

from pathlib import Path

from pydantic_settings import SettingsConfigDict

from services.common.settings import ServiceSettings


class WorkerSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="TUNEFARM_", extra="ignore")

    # Isolated build processes (TVM imported once each; a crashing build kills only its
    # process); 0 means one per physical core.
    build_processes: int = 0
    # RQ's limit on one build_batch job (a batch of 64 builds in well under a minute).
    build_job_timeout_secs: int = 1800
    # How long a build job waits for a database that went away (a restart) before it
    # fails: its claim and its results are written again until then.
    database_retry_secs: float = 120.0
    # The farm's signing key (services/protocol/signing.py): each kernel is signed with
    # it for its batch candidate; agents load nothing unsigned (None: unsigned).
    signing_key_file: Path | None = None
