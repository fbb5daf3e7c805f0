"""The farm against whoever reaches its Redis, and what it leaves readable on the machine.

- `farm up` starts its own Redis with a password (loopback, config 0600): a client
  without the password is refused; a given Redis URL without a password is refused;
- a whole farm over a TLS Redis with a password (`rediss://`, a private `redis-server`):
  a job's queued build whose payload is swapped for a pickle is refused by the worker
  (the pickle never loads), and the scheduler builds the batch again: the job succeeds;
- `os.system` enqueued on the farm's build queue by someone with the password runs
  nothing;
- no secret is on a farm process's command line; what the farm writes under its state
  dir is its user's alone; `farm down` stops the farm's own redis-server too.
"""

from __future__ import annotations

import os
import pickle
import stat
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("grpc")
rq = pytest.importorskip("rq")

import redis  # noqa: E402
from farm_fixtures import running_farm, service_unavailable, team_client, wait_for_job  # noqa: E402
from onnx_models import tiny_onnx  # noqa: E402
from private_services import PrivateRedis, ServiceMissing  # noqa: E402
from sqlalchemy import select  # noqa: E402

from services.common.queues import BUILD_JOB, build_job_id, build_queue_name  # noqa: E402
from services.db.models import Batch  # noqa: E402
from services.db.session import make_session_factory, transaction  # noqa: E402
from services.db.states import BatchState  # noqa: E402
from services.worker.build_job import fetch_build_job  # noqa: E402
from tunefarm.errors import UsageError  # noqa: E402
from tunefarm_app.cli import main  # noqa: E402
from tunefarm_app.farm_local import FarmConfig, LocalFarm, down, read_state  # noqa: E402
from tunefarm_app.farm_redis import REDIS_PROCESS, check_given, has_password, redact, wait_ready  # noqa: E402

pytestmark = pytest.mark.slow

JOB_TIMEOUT = 300.0


class TouchOnUnpickle:
    """A pickle that creates a file when loaded: what a forged payload does."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    try:
        server = PrivateRedis(tmp_path_factory.mktemp("redis"), tls=True)
    except ServiceMissing as exc:
        service_unavailable(f"these tests need a Redis of their own: {exc}")
    server.start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def farm(tls_redis, database_url, tmp_path_factory):
    with running_farm(
        redis_url=tls_redis.url,
        state_dir=tmp_path_factory.mktemp("farm"),
        database_url=database_url,
        workers=1,
        extra_env={
            "TUNEFARM_POLL_INTERVAL_SECS": "0.1",
            "TUNEFARM_BUILD_CHECK_SECS": "1",  # a refused build is noticed within a second
            "TUNEFARM_BUILD_PROCESSES": "1",
            "TUNEFARM_CHECK_TUNED_MODEL": "false",
        },
    ) as running:
        yield running


@pytest.fixture(scope="module")
def sessions(farm: LocalFarm):
    factory = make_session_factory(farm.config.database_url)
    yield factory
    factory.kw["bind"].dispose()


def until(what: str, check, timeout: float = JOB_TIMEOUT):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def log_of(farm: LocalFarm, name: str) -> str:
    return Path(farm.processes[name].log).read_text(errors="replace")


# -- farm up's own Redis ------------------------------------------------------------------


def test_farm_ups_own_redis_wants_its_password(database_url, tmp_path):
    farm = LocalFarm(FarmConfig(state_dir=tmp_path / "farm", database_url=database_url, queue_prefix="tfownredis"))
    info = farm.prepare()
    try:
        farm.start(REDIS_PROCESS)
        wait_ready(info["redis_url"], lambda: farm.alive(REDIS_PROCESS), lambda: "")
        port = redis.connection.parse_url(info["redis_url"])["port"]
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=port).ping()
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=port, password="guess").ping()
        with redis.Redis.from_url(info["redis_url"]) as client:
            assert client.ping()
            for admin in (client.flushall, lambda: client.config_get("bind"), client.shutdown):
                with pytest.raises(redis.exceptions.ResponseError, match="unknown command"):
                    admin()  # the password holder cannot wipe, reconfigure or stop it
            assert client.ping()
        assert "bind 127.0.0.1" in farm.own_redis.config_file.read_text().splitlines()
        config = farm.own_redis.config_file
        assert stat.S_IMODE(config.stat().st_mode) == 0o600 and stat.S_IMODE(config.parent.stat().st_mode) == 0o700
        pid = farm.processes[REDIS_PROCESS].pid
        assert farm.own_redis.password.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
        farm.write_state()
        assert down(farm.config.state_dir, grace=5.0) == [REDIS_PROCESS]  # recognised as the farm's
        until("redis to stop", lambda: not _alive(pid), timeout=30)
    finally:
        farm.stop_all(grace=5.0)


def test_farm_up_refuses_a_redis_url_without_a_password(tmp_path, capsys):
    argv = ["farm", "up", "--state-dir", str(tmp_path / "farm"), "--redis-url", "redis://127.0.0.1:6379/0",
            "--database-url", "postgresql+psycopg2://nobody@127.0.0.1:1/none"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no password" in err and "--redis-without-password" in err, err


def test_which_redis_urls_carry_a_password(redis_conn):
    assert has_password("redis://:pw@127.0.0.1:6379/0") and has_password("rediss://user:pw@h:6380/0?ssl_ca_certs=/c")
    assert not has_password("redis://127.0.0.1:6379/0") and not has_password("rediss://h:6380/0")
    with pytest.raises(UsageError, match="--redis-url"):
        has_password("http://127.0.0.1:6379")
    unprotected = redis_conn.connection_pool.connection_kwargs
    url = f"redis://{unprotected['host']}:{unprotected['port']}/0"
    check_given(url, without_password=True)  # the operator said so: accepted
    with pytest.raises(UsageError, match="no password"):
        check_given(url, without_password=False)
    assert redact("rediss://:hunter2@h:1/0") == "rediss://:***@h:1/0"


# -- a farm over TLS Redis -------------------------------------------------------------------


def test_the_farm_works_over_tls_and_a_build_swapped_for_a_pickle_is_refused(farm, sessions, tmp_path_factory):
    marker = tmp_path_factory.mktemp("attack") / "pickle-ran"
    info = farm.info
    assert info["redis_url"].startswith("rediss://")
    farm.stop("worker-1")  # builds wait in the queue while the payload is swapped
    with team_client(farm) as client:
        model = client.upload_model(tiny_onnx(tmp_path_factory.mktemp("model") / "tiny.onnx"), {"x": [1, 3, 8, 8]})
        job_id = client.create_job(model_id=model["id"], device_class=info["device_class"], trial_budget=8,
                                   winograd=False)["id"]  # the model's 4 tasks (no Winograd alternatives): 4 batches

        conn = redis.Redis.from_url(info["redis_url"])

        def queued_build() -> tuple[int, str] | None:
            with transaction(sessions) as s:
                batch_id = s.scalar(select(Batch.id).where(Batch.job_id == job_id, Batch.state == BatchState.PROPOSED))
            key = f"rq:job:{build_job_id(batch_id, info['queue_prefix'])}"
            return (batch_id, key) if batch_id is not None and conn.exists(key) else None

        batch_id, key = until("a batch whose build job waits", queued_build)
        conn.hset(key, "data", pickle.dumps((BUILD_JOB, None, (TouchOnUnpickle(marker),), {})))
        farm.start("worker-1")
        job = wait_for_job(client, job_id, timeout=JOB_TIMEOUT)
    assert job["state"] == "succeeded", job["error"]
    assert not marker.exists()
    assert "not JSON" in log_of(farm, "worker-1") and "refused job" in log_of(farm, "worker-1")
    assert f"the build of batch {batch_id} failed" in log_of(farm, "scheduler")


def test_os_system_enqueued_on_the_farms_queue_runs_nothing(farm, tmp_path_factory):
    marker = tmp_path_factory.mktemp("attack") / "os-system-ran"
    conn = redis.Redis.from_url(farm.info["redis_url"])  # an attacker who got the password
    queue = rq.Queue(build_queue_name(farm.info["device_class"], farm.info["queue_prefix"]), connection=conn)
    job = queue.enqueue("os.system", f"touch {marker}")
    until("the worker to take the job", lambda: fetch_build_job(conn, job.id).get_status(refresh=False) == "failed")
    assert not marker.exists()
    assert f"refused job {job.id}" in log_of(farm, "worker-1")


def test_no_secret_is_on_a_farm_processs_command_line(farm):
    info = read_state(farm.config.state_dir)
    password = redis.connection.parse_url(info["redis_url"])["password"]
    secrets = [info["team_token"], info["agent_token"], password]
    assert "agent" in info["processes"]
    for name, process in info["processes"].items():
        cmdline = Path(f"/proc/{process['pid']}/cmdline").read_bytes()
        assert not [s for s in secrets if s.encode() in cmdline], name
        assert not [s for s in secrets if s in " ".join(process["command"])], name


def test_what_the_farm_wrote_is_its_users_alone(farm):
    os.kill(farm.processes["agent"].pid, 0)  # the farm runs (and has run a job: the test above)
    state = farm.config.state_dir
    readable = []
    for root, dirs, files in os.walk(state):
        for name in [*dirs, *files]:
            path = Path(root) / name
            mode = stat.S_IMODE(path.lstat().st_mode)
            if path.suffix == ".pub":  # the farm's public signing key: for every agent to read
                continue
            if not stat.S_ISLNK(path.lstat().st_mode) and mode & 0o077:
                readable.append(f"{path.relative_to(state)} {oct(mode)}")
    assert readable == []
    kinds = {p.relative_to(state).parts[0] for p in state.rglob("*")}
    assert {"logs", "artifacts", "farm.json", "agent"} <= kinds  # what was checked (the agent's work dir
    # may hold no file: a root agent keeps its kernels where the sandbox user can read them)
    assert any((state / "artifacts" / "kernels").rglob("*"))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
