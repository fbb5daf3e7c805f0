"""The settings every server-side farm process shares (API, scheduler, build workers,
lease service): each process's own settings class inherits `ServiceSettings`.

Environment variables (prefix TUNEFARM_), besides the database's (`DatabaseSettings`):

| variable | default | meaning |
|---|---|---|
| TUNEFARM_ARTIFACT_ROOT | .tunefarm/artifacts | the shared artifact directory (its layout: services/common/artifacts.py) |
| TUNEFARM_REDIS_URL | redis://127.0.0.1:6379/0 | the RQ broker of the build queues |
| TUNEFARM_QUEUE_PREFIX | tunefarm | queue names are `<prefix>:build:<device class>` (services/common/queues.py) |
| TUNEFARM_AGENT_FRESH_SECS | 60 | an agent counts as live if it heartbeated this recently: the scheduler's fair shares and model runs, the API's devices (older: shown offline) and a job's `waiting` |
"""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError
from pydantic_settings import SettingsConfigDict

from services.db.settings import DatabaseSettings

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
"""A local Redis without a password (development and tests)."""


class ServiceSettings(DatabaseSettings):
    model_config = SettingsConfigDict(env_prefix="TUNEFARM_", extra="ignore")

    # Shared directory of the farm's files (uploaded models, task data, kernels, model
    # runs, cost models, tuned model archives); rows keep paths relative to it. Every
    # server-side process must see the same directory.
    artifact_root: Path = Path(".tunefarm/artifacts")
    # The RQ broker: the scheduler enqueues build jobs, the workers take them, the API
    # reports the queues' depth. A farm's carries its password
    # (redis://:PASSWORD@HOST:PORT/0; rediss://...?ssl_ca_certs=CA for TLS). Build jobs in
    # it are JSON, refused unless they name build_batch and a batch id
    # (services.worker.build_job).
    redis_url: str = DEFAULT_REDIS_URL
    # First part of every queue name (tests and side-by-side farms use their own).
    queue_prefix: str = "tunefarm"
    # An agent counts as live (serves its class) only if it heartbeated this recently:
    # one stopped without a word (killed, its machine gone) stays idle or busy in its row
    # until the lease service's sweeper marks it offline, and there may be no lease
    # service running to do that. Every process judges liveness by this one window.
    agent_fresh_secs: float = 60.0
    # A job's open batch that has waited this long for its build (no build worker of its
    # class running?) or, built, for an agent to take it, is named in the job's `waiting`
    # (status, --follow, the dashboard) and counted in /metrics.
    batch_stall_secs: float = 600.0


def first_problem(exc: ValidationError) -> tuple[str, str]:
    """The first bad value of refused settings: its field ("" for the whole model) and
    what is wrong with it."""
    first = exc.errors()[0]
    field = ".".join(str(x) for x in first.get("loc", ()))
    return field, str(first.get("msg", exc)).removeprefix("Value error, ")


def settings_problem(exc: ValidationError, env_prefix: str = "TUNEFARM_") -> str:
    """One line for settings a process refused at start: the first bad value's
    environment variable (`env_prefix` + its field's name), its value and what is wrong."""
    field, message = first_problem(exc)
    if not field:
        return message
    return f"{env_prefix}{field.upper()}={exc.errors()[0].get('input')!r}: {message}"
