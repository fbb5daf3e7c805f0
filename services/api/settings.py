"""The API's settings: the only place the API process reads the environment.

Environment variables (prefix TUNEFARM_), besides the shared ones (`ServiceSettings`: the
database, TUNEFARM_ARTIFACT_ROOT where uploads and tuned archives are kept,
TUNEFARM_REDIS_URL and TUNEFARM_QUEUE_PREFIX of the build queues `/metrics` reports):

| variable | default | meaning |
|---|---|---|
| TUNEFARM_API_BIND | 127.0.0.1:8000 | host:port uvicorn listens on |
| TUNEFARM_MAX_UPLOAD_BYTES | 268435456 | largest ONNX upload (413 above it, nothing stored) |
| TUNEFARM_MAX_TRIAL_BUDGET | 100000 | largest trial budget a job may ask for |
| TUNEFARM_INTAKE_TIMEOUT_SECS | 600 | how long importing an uploaded model may take |
| TUNEFARM_INTAKE_WORKERS | 2 | model importer processes, shared by all teams |
| TUNEFARM_INTAKE_PER_TEAM | 1 | uploads of one team imported at once (429 for one more) |
| TUNEFARM_INTAKE_QUEUE_SECS | 120 | how long an upload waits for an idle importer (503 after) |
| TUNEFARM_INTAKE_MEMORY_LIMIT_BYTES | 8589934592 | address space of an importer process (RLIMIT_AS); unset: none |
| TUNEFARM_MAX_TENSOR_ELEMENTS | 134217728 | elements a tensor of an uploaded model may have (422 naming it above) |
| TUNEFARM_MAX_MODEL_ELEMENTS | 1073741824 | elements all the tensors of an uploaded model may have together (422 above) |
| TUNEFARM_TEAM_MAX_ACTIVE_JOBS | 10 | a team's jobs queued or running at once (429 for one more) |
| TUNEFARM_TEAM_MAX_ACTIVE_TRIALS | 300000 | the trials a team's jobs queued or running have still to run, together (429 above) |
| TUNEFARM_UI_SESSION_SECS | 43200 | how long a dashboard login lasts |
| TUNEFARM_UI_TRUSTED_ORIGINS | [] | JSON list of further origins the dashboard's forms may post from (a proxy's `https://farm.example`) |
| TUNEFARM_PAGE_SIZE_MAX | 100 | largest page of a list endpoint |
| TUNEFARM_TOKEN_CACHE_SECS | 10 | how long a verified team token is trusted without asking the database (a revoked one is dropped at once) |
| TUNEFARM_API_WORKERS | 1 | uvicorn worker processes |
| TUNEFARM_LEASE_SECS | 30 | the lease window: `/metrics` counts an agent alive if it heartbeat within it |
| TUNEFARM_METRICS_TOKEN | unset | when set, `/metrics` wants it as a bearer token; unset, `/metrics` is open |
| TUNEFARM_API_ALLOWED_HOSTS | localhost, 127.0.0.1, ::1 and the host of TUNEFARM_API_BIND | host names the API answers to (the `Host` header; a 400 for another): a JSON list or comma-separated; `*.example.com` any subdomain, `*` any |
| TUNEFARM_API_DOCS | false | serve the schema browsers `/docs` and `/redoc` (they load scripts from a CDN); `/openapi.json` is always served |
"""

from __future__ import annotations

import ipaddress
import json
from typing import Annotated, Any

from pydantic import Field, field_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from services.common.settings import ServiceSettings

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
"""The host names the API always answers to by default: this machine's."""


def _is_unspecified(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def _host_pattern(pattern: Any) -> bool:
    """A name, `*.domain` or `*` (what Starlette's TrustedHostMiddleware accepts)."""
    if not isinstance(pattern, str) or not pattern or "*" in pattern[1:]:
        return False
    return not pattern.startswith("*") or pattern == "*" or pattern.startswith("*.")


class ApiSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="TUNEFARM_", extra="ignore")

    # host:port to listen on (0.0.0.0:8000 in a container).
    api_bind: str = "127.0.0.1:8000"
    # Largest ONNX file a team may upload, in bytes; the request body may exceed it only
    # by `multipart_overhead_bytes` (the form's other fields and its framing).
    max_upload_bytes: int = 256 * 1024 * 1024
    multipart_overhead_bytes: int = 64 * 1024
    # Largest trial budget of one job (a larger one is a typo, not a plan).
    max_trial_budget: int = 100_000
    # Seconds importing, simplifying and fusing one uploaded model may take (in a child
    # process: a model that crashes TVM's importer never takes the API down).
    intake_timeout_secs: float = 600.0
    # Importer child processes, shared by every team; one team's uploads take at most
    # `intake_per_team` of them (another upload of the team meanwhile is a 429), and an
    # upload waits at most `intake_queue_secs` for an idle one (503 after that).
    intake_workers: int = Field(default=2, ge=1)
    intake_per_team: int = Field(default=1, ge=1)
    intake_queue_secs: float = 120.0
    # Address space of one importer process (RLIMIT_AS; its TVM and onnxruntime threads
    # reserve some GiB of it idle); None: no limit.
    intake_memory_limit_bytes: int | None = 8 * 1024**3
    # Elements any tensor of an uploaded model may have (an input at its shape, an
    # initializer, an intermediate value), checked on shapes before anything is allocated:
    # a file of a few bytes may declare a tensor of gigabytes.
    max_tensor_elements: int = Field(default=1 << 27, ge=1)
    # ... and all of them together (inputs, initializers, constants, inferred values):
    # many tensors, each under the cap, add up to gigabytes too.
    max_model_elements: int = Field(default=1 << 30, ge=1)
    # A team's quota: its jobs queued, running or finishing at once, and the sum of
    # their trial budgets. A job past either is refused (429) until some of them end.
    team_max_active_jobs: int = Field(default=10, ge=1)
    team_max_active_trials: int = Field(default=300_000, ge=1)
    # How long a dashboard session lasts after its login (seconds).
    ui_session_secs: float = Field(default=12 * 3600.0, gt=0)
    # Origins besides the request's own that the dashboard's forms may post from: a
    # reverse proxy's public origin ("https://farm.example") when it does not pass the
    # scheme and host through. Any other origin's POST is refused (cross-site).
    ui_trusted_origins: list[str] = []
    # Items per page of the list endpoints: the default and the most a client may ask for.
    page_size_default: int = 20
    page_size_max: int = 100
    # A verified team token is trusted this long before the database is asked again;
    # a revoked token is dropped at once (services/db/revocations.py).
    token_cache_secs: float = 10.0
    # uvicorn worker processes (each has its own database pool and intake child).
    api_workers: int = 1
    # The lease service's lease window (the same variable): an agent that heartbeat
    # within it counts as alive in /metrics.
    lease_secs: float = 30.0
    # A secret Prometheus sends as a bearer token to scrape /metrics; None: /metrics is open.
    metrics_token: str | None = None
    # The host names requests may name in their Host header (services/api/trusted_hosts.py:
    # DNS rebinding); None: `LOOPBACK_HOSTS` and the host of `api_bind` (`allowed_hosts()`).
    # "*.example.com" allows its subdomains, "*" any name.
    api_allowed_hosts: Annotated[list[str] | None, NoDecode] = None
    # Serve FastAPI's schema browsers, /docs and /redoc: they load their scripts from a CDN
    # (whoever serves it runs script on the farm's origin), so they are off unless asked for.
    api_docs: bool = False

    @field_validator("api_allowed_hosts", mode="before")
    @classmethod
    def _host_list(cls, value: Any) -> Any:
        """A JSON list, or names separated by commas (`*`, `farm.example,localhost`)."""
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return json.loads(text)
            value = [h.strip() for h in text.split(",") if h.strip()]
        for pattern in value or ():
            if not _host_pattern(pattern):
                raise ValueError(f"{pattern!r} is no host name or pattern: a name, '*.example.com' or '*'")
        return value

    def allowed_hosts(self) -> list[str]:
        """The host names the API answers to: `api_allowed_hosts`, or by default the
        loopback names and the host it binds to (not a wildcard address such as 0.0.0.0,
        which names no host: a container's API lists its names in TUNEFARM_API_ALLOWED_HOSTS)."""
        if self.api_allowed_hosts is not None:
            return list(self.api_allowed_hosts)
        hosts = list(LOOPBACK_HOSTS)
        bound = self.host.strip("[]")
        if bound and bound not in hosts and not _is_unspecified(bound):
            hosts.append(bound)
        return hosts

    @property
    def host(self) -> str:
        return self.api_bind.rsplit(":", 1)[0]

    @property
    def port(self) -> int:
        return int(self.api_bind.rsplit(":", 1)[1])
