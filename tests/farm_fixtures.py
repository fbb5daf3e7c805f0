"""Fixtures for tests against the farm's PostgreSQL (registered in conftest.py).

- `database_url`: a throw-away database per test module, migrated to head, dropped after;
- `db_sessions`: a session factory on it (use with `services.db.session.transaction`);
- `empty_database_url`: a throw-away database per test, not migrated (migration tests);
- `redis_conn`: a client of the farm's Redis (WorkerSettings' URL), per module; tests keep
  to keys of their own prefix on it;
- `running_farm(config_kwargs)`: `farm up` (tunefarm_app.farm_local) with its own Redis
  (or the one at `redis_url`, whose URL has a password) under a queue prefix of its own,
  `farm down` (and the prefix's keys removed from a given Redis) after;
  `team_client(farm)` and `wait_for_job(client, job_id)` for talking to it over REST;
- `assert_measured_exactly_once(sessions, job)`: what a job that ran through faults must
  show (every candidate measured once), and `measured(sessions, job_id)`.

The server is the one `DatabaseSettings` names (TUNEFARM_DATABASE_URL); each database is
`tunefarm_test_<uuid hex>` on it. Tests using these fixtures are skipped when the server
cannot be reached.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest


def service_unavailable(message: str) -> None:
    """PostgreSQL or Redis cannot be reached: a skip on a developer's machine without them,
    a failure in CI (CI=true), which has both and must not skip what it claims to test."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(message)
    pytest.skip(message)


def _throwaway_database() -> str:
    from sqlalchemy import make_url

    from services.db.exceptions import Unavailable
    from services.db.migrate import create_database
    from services.db.settings import DatabaseSettings

    server = make_url(DatabaseSettings().database_url)
    url = server.set(database=f"tunefarm_test_{uuid.uuid4().hex}").render_as_string(hide_password=False)
    try:
        create_database(url)
    except Unavailable as error:
        service_unavailable(f"PostgreSQL is not reachable at {server!r}: {error}")
    return url


@pytest.fixture
def empty_database_url() -> Iterator[str]:
    from services.db.migrate import drop_database

    url = _throwaway_database()
    try:
        yield url
    finally:
        drop_database(url)


@pytest.fixture(scope="module")
def database_url() -> Iterator[str]:
    from services.db.migrate import drop_database, upgrade

    url = _throwaway_database()
    try:
        upgrade(url)
        yield url
    finally:
        drop_database(url)


@pytest.fixture(scope="module")
def db_sessions(database_url: str):
    from services.db.session import make_session_factory

    factory = make_session_factory(database_url)
    try:
        yield factory
    finally:
        factory.kw["bind"].dispose()


@pytest.fixture(scope="module")
def redis_conn():
    import redis

    from services.worker.settings import WorkerSettings

    conn = redis.Redis.from_url(WorkerSettings().redis_url)
    try:
        conn.ping()
    except redis.exceptions.ConnectionError as exc:
        service_unavailable(f"Redis is not reachable: {exc}")
    yield conn
    conn.close()


def placeholder_model(team_id: int, input_shapes: dict | None = None):
    """A `models` row whose files do not exist: for tests that need a job, not a model."""
    from services.db.models import Model

    return Model(
        team_id=team_id,
        name="m",
        input_shapes=input_shapes or {},
        onnx_path="m.onnx",
        onnx_sha256="0" * 64,
        onnx_size=1,
        fused_path="m.json",
        fused_sha256="0" * 64,
        fused_size=1,
        task_table=[],
    )


TEST_FARM_ENV = {
    # Kernels timed briefly (two repeats of at least 5 ms, where a farm's default is five
    # of 40 ms) on one thread: these tests check what is measured and where it goes, not
    # how fast; and the 2-core machine runs another test file beside them.
    "TUNEFARM_TIMING_REPEAT": "2",
    "TUNEFARM_TIMING_MIN_REPEAT_MS": "5",
    "TUNEFARM_AGENT_THREADS": "1",
}
"""Settings every test farm's processes get (a test's own `extra_env` goes over them)."""


def _terminal(job: dict) -> bool:
    return job["state"] in ("succeeded", "failed", "cancelled")


@contextmanager
def running_farm(redis_url: str | None = None, **config: Any) -> Iterator[Any]:
    """A whole farm on loopback (`FarmConfig(**config)`, with `database_url` and
    `state_dir` given) under a queue prefix of its own, on a Redis of its own (farm up
    starts one with a password) or the one at `redis_url`."""
    import shutil

    import redis

    from tunefarm_app.farm_local import FarmConfig, down, up

    if redis_url is None and shutil.which("redis-server") is None:
        service_unavailable("farm up starts its own Redis: redis-server is not installed")
    if redis_url is not None:
        try:
            redis.Redis.from_url(redis_url, socket_connect_timeout=2).ping()
        except Exception as exc:
            service_unavailable(f"Redis is not reachable at {redis_url}: {exc}")
    prefix = f"tftest{uuid.uuid4().hex[:10]}"
    state_dir = config["state_dir"]
    config["extra_env"] = {**TEST_FARM_ENV, **config.get("extra_env", {})}
    running = up(FarmConfig(redis_url=redis_url, queue_prefix=prefix, **config), log=lambda msg: None)
    try:
        yield running
    finally:
        down(state_dir, grace=5.0)
        if redis_url is not None:  # the farm's own Redis stopped with it
            _remove_keys(redis_url, prefix)


def _remove_keys(redis_url: str, prefix: str) -> None:
    import redis

    r = redis.Redis.from_url(redis_url, socket_connect_timeout=2)
    try:
        keys = list(r.scan_iter(f"*{prefix}*"))
        if keys:
            r.delete(*keys)
    except redis.exceptions.ConnectionError:
        pass  # a test's own Redis, stopped already


@contextmanager
def team_client(farm: Any) -> Iterator[Any]:
    """A REST client of the farm with its team token."""
    from tunefarm_app.farm_client import ClientSettings, FarmClient

    info = farm.info
    with FarmClient(ClientSettings.load(server=info["api_url"], token=info["team_token"])) as c:
        yield c


def wait_for_job(client: Any, job_id: int, done: Callable[[dict], bool] = _terminal, timeout: float = 240.0) -> dict:
    """The job once `done` says so (default: in a final state); fails after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        job = client.job(job_id)
        if done(job):
            return job
        assert time.monotonic() < deadline, f"job {job_id} stuck: {json.dumps(job)[:600]}"
        time.sleep(0.5)


def measured(sessions: Any, job_id: int) -> int:
    """The job's measurements so far."""
    from sqlalchemy import func, select

    from services.db.models import Measurement
    from services.db.session import transaction

    with transaction(sessions) as s:
        return int(s.scalar(select(func.count()).select_from(Measurement).where(Measurement.job_id == job_id)) or 0)


def assert_measured_exactly_once(sessions: Any, job: dict, trials: int | None = None) -> None:
    """The job succeeded and its measurements add up (`services.db.measurement_audit`):
    every batch done, every search candidate measured exactly once, every best confirmed
    exactly once, no candidate proposed twice; `trials` (default: the job's budget)
    candidates in all."""
    from services.db.measurement_audit import measurement_audit
    from services.db.session import transaction

    trials = job["trial_budget"] if trials is None else trials
    assert job["state"] == "succeeded", job["error"]
    with transaction(sessions) as s:
        audit = measurement_audit(s, job["id"])
    assert audit.problems(trials) == [], audit
    assert job["trials_used"] == trials
