"""The lease service's settings: the only place it reads the environment.

Environment variables (prefix TUNEFARM_), besides the shared ones (`ServiceSettings`: the
database, TUNEFARM_ARTIFACT_ROOT where the kernels, task data and model runs it serves are):

| variable | default | meaning |
|---|---|---|
| TUNEFARM_LEASE_BIND | 127.0.0.1:50051 | host:port the gRPC server listens on (0.0.0.0:50051 for remote agents) |
| TUNEFARM_LEASE_SECS | 30 | a lease lives this long past the agent's last heartbeat |
| TUNEFARM_HEARTBEAT_INTERVAL_SECS | 5 | how often agents are told to heartbeat |
| TUNEFARM_AGENT_STALE_SECS | 60 | an agent silent this long is marked offline |
| TUNEFARM_SWEEP_INTERVAL_SECS | 2 | how often expired leases and stale agents are swept |
| TUNEFARM_MAX_LEASE_ATTEMPTS | 3 | leases a batch gets before its unmeasured candidates become errors |
| TUNEFARM_LEASE_WAIT_SECS | 5 | how long an empty LeaseBatch waits for a batch before answering |
| TUNEFARM_LEASE_RECHECK_SECS | 0.25 | how often a waiting LeaseBatch looks again |
| TUNEFARM_RESULTS_FLUSH_SECS | 0.05 | results of a stream are stored together within this window |
| TUNEFARM_RESULTS_FLUSH_MAX | 256 | ... and at most this many per transaction |
| TUNEFARM_FETCH_CHUNK_BYTES | 262144 | bytes of file data per Fetch message |
| TUNEFARM_MAX_MESSAGE_BYTES | 67108864 | largest message an agent may send (a model run's outputs) |
| TUNEFARM_GRPC_MAX_WORKERS | 256 | server threads (each agent holds one while it waits for a batch, one while it streams results); more than the agents |
| TUNEFARM_TOKEN_CACHE_SECS | 30 | how long a verified token is trusted without asking the database (a revoked one is dropped at once) |
| TUNEFARM_AUTO_CREATE_DEVICE_CLASSES | false | an agent may name a new device class (its detected target); off: operators create classes |
| TUNEFARM_TLS_CERT_FILE, TUNEFARM_TLS_KEY_FILE | unset | serve TLS with this certificate chain and key (PEM); unset: plaintext |
| TUNEFARM_TLS_CLIENT_CA_FILE | unset | mutual TLS: agents must present a certificate this CA (PEM) signed |
"""

from __future__ import annotations

from pathlib import Path

from pydantic import field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from services.common.artifacts import DEFAULT_CHUNK_BYTES
from services.common.settings import ServiceSettings


class LeaseServiceSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="TUNEFARM_", extra="ignore")

    # host:port to listen on; port 0 picks a free port (tests).
    lease_bind: str = "127.0.0.1:50051"
    # A lease expires this long after the last heartbeat of its agent.
    lease_secs: float = 30.0
    # The heartbeat period agents are told at registration (well under lease_secs).
    heartbeat_interval_secs: float = 5.0
    # Agents whose last heartbeat is older than this are marked offline.
    agent_stale_secs: float = 60.0
    # Period of the sweeper (expired leases, stale agents, batches given up).
    sweep_interval_secs: float = 2.0
    # A batch leased this many times without being finished is given up: its unmeasured
    # candidates are recorded as run_crash errors (they may be what kills the agents).
    max_lease_attempts: int = 3
    # An empty LeaseBatch waits up to this long for a batch (long poll), looking again
    # every lease_recheck_secs, so an idle agent starts on a new batch within that time.
    lease_wait_secs: float = 5.0
    lease_recheck_secs: float = 0.25
    # Results arriving on a stream within this window are stored in one transaction (at
    # most results_flush_max of them), with the lease's finish when it comes in the
    # window: a batch's results cost a few transactions, not one per candidate.
    results_flush_secs: float = 0.05
    results_flush_max: int = 256
    # Bytes per Fetch chunk.
    fetch_chunk_bytes: int = DEFAULT_CHUNK_BYTES
    # The largest message the service accepts: a model run's outputs come in one.
    max_message_bytes: int = 64 * 1024 * 1024
    # Server threads; every agent holds one while it waits for a batch (a long poll) or
    # streams results, and one per other call: keep it above the number of agents (16
    # are never taken by long polls, so heartbeats get through whatever the agents do).
    grpc_max_workers: int = 256
    # A verified token is trusted this long before the database is asked again; a
    # revoked token is dropped at once (services/db/revocations.py).
    token_cache_secs: float = 30.0
    # Registering with an unknown device class creates it, with the agent's detected
    # target. Off by default: every team sees every class, so classes are the operators'
    # (`tunefarm farm device-class`), not something any agent token may add.
    auto_create_device_classes: bool = False
    # TLS: PEM certificate chain and private key; both unset serves plaintext (loopback,
    # or behind a TLS-terminating proxy). One without the other is an error, never a
    # silent fallback to plaintext.
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    # Mutual TLS: the CA (PEM) whose certificates agents must present; needs the above.
    tls_client_ca_file: Path | None = None

    @field_validator("tls_cert_file", "tls_key_file", "tls_client_ca_file", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        return None if value == "" else value  # `VAR=` in a compose file or .env: unset

    @model_validator(mode="after")
    def _tls_complete(self) -> LeaseServiceSettings:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("TLS needs both a certificate and its key (TUNEFARM_TLS_CERT_FILE, TUNEFARM_TLS_KEY_FILE)")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ValueError("mutual TLS (TUNEFARM_TLS_CLIENT_CA_FILE) needs the server's certificate and key too")
        return self

    @property
    def tls(self) -> bool:
        return self.tls_cert_file is not None
