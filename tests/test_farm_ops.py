"""What an operator meets running farms: `farm up` again on a database an earlier farm
used (issue 26).

- a second `farm up` from another state dir of the same name, and again from the same
  state dir, on the same database: each start's agent registers and stays (it was
  refused the earlier agent's name, and `farm up` took the earlier agent's row for its
  own and said nothing);
- an agent that exits during `farm up` fails it with the agent's one-line reason;
- an agent stopped with SIGTERM says so, goes offline at once and exits 0;
- an agent naming a device class that does not exist stops, naming those that do;
- under `tunefarm farm up` (the command: its supervisor), an operator's bad day (Redis,
  the only build worker, the scheduler and the only agent killed with SIGKILL in one job)
  ends with the job finished, each candidate measured once, and all back; a process
  that keeps dying is given up (farm.log and `farm status` say so), and `farm down`
  stops the supervisor and the rest.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("grpc")

from farm_fixtures import (  # noqa: E402
    TEST_FARM_ENV,
    assert_measured_exactly_once,
    service_unavailable,
    team_client,
    wait_for_job,
)
from onnx_models import tiny_onnx  # noqa: E402
from sqlalchemy import select  # noqa: E402

from services.db.models import Agent, Batch, Lease, Token  # noqa: E402
from services.db.session import make_session_factory, transaction  # noqa: E402
from services.db.states import BatchState, LeaseState  # noqa: E402
from services.db.tokens import hash_token  # noqa: E402
from tunefarm.errors import UsageError  # noqa: E402
from tunefarm_app import local_processes  # noqa: E402
from tunefarm_app.cli import main  # noqa: E402
from tunefarm_app.farm_local import FarmConfig, LocalFarm, down, read_state, up
from tunefarm_app.farm_names import agent_base_name  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _redis_server():
    if shutil.which("redis-server") is None:
        service_unavailable("farm up starts its own Redis: redis-server is not installed")


def config(state_dir, database_url, **kw) -> FarmConfig:
    return FarmConfig(state_dir=state_dir, database_url=database_url, workers=1,
                      queue_prefix=f"tfops{uuid.uuid4().hex[:8]}", extra_env=TEST_FARM_ENV, **kw)  # fmt: skip


def assert_serving(farm: LocalFarm, timeout: float = 90.0) -> None:
    """The farm's agent registered with this start's token, and still runs (`up` returns
    once it registered; an agent refused its name exits right after registering)."""
    sessions = make_session_factory(farm.config.database_url)
    try:
        with transaction(sessions) as s:
            token_id = s.scalar(select(Token.id).where(Token.token_hash == hash_token(farm.info["agent_token"])))
        deadline = time.monotonic() + timeout
        while True:
            assert farm.alive("agent"), open(farm.processes["agent"].log).read()[-2000:]
            with transaction(sessions) as s:
                row = s.scalars(select(Agent).where(Agent.name == farm.agent_name())).one_or_none()
                if row is not None and row.token_id == token_id and row.state.value in ("idle", "busy"):
                    break
            assert time.monotonic() < deadline, "the agent did not register"
            time.sleep(0.5)
        time.sleep(2.0)
        assert farm.alive("agent"), open(farm.processes["agent"].log).read()[-2000:]
    finally:
        sessions.kw["bind"].dispose()


def agent_state(farm: LocalFarm) -> str:
    sessions = make_session_factory(farm.config.database_url)
    try:
        with transaction(sessions) as s:
            return s.scalar(select(Agent.state).where(Agent.name == farm.agent_name())).value
    finally:
        sessions.kw["bind"].dispose()


def stopped_cleanly(farm: LocalFarm) -> None:
    """SIGTERM to the agent: it says so, goes offline at once (not idle for the
    freshness window), and exits 0."""
    process = farm._popen["agent"]
    farm.stop("agent", grace=15.0)
    log = open(farm.processes["agent"].log).read()
    assert process.returncode == 0, log[-2000:]
    assert "stopping (SIGTERM): giving back the leases it holds and going offline" in log, log[-2000:]
    assert "offline; it held no lease" in log, log[-2000:]
    assert agent_state(farm) == "offline"


def test_farm_up_again_on_the_same_database_gets_an_agent_that_serves(database_url, tmp_path):
    a, b = tmp_path / "a" / "farm", tmp_path / "b" / "farm"
    assert agent_base_name(a) != agent_base_name(b) and agent_base_name(a) == agent_base_name(a)
    first = up(config(a, database_url), log=lambda msg: None)
    try:
        assert_serving(first)
        stopped_cleanly(first)
    finally:
        down(a, grace=5.0)
    second = up(config(b, database_url), log=lambda msg: None)  # another dir named farm
    try:
        assert_serving(second)
    finally:
        down(b, grace=5.0)
    assert agent_state(second) == "offline"  # farm down stops the agents first: they go offline at once
    again = up(config(b, database_url), log=lambda msg: None)  # the same dir: a new token, the same name
    try:
        assert again.agent_name() == second.agent_name()
        assert_serving(again)
    finally:
        down(b, grace=5.0)


def test_farm_ups_workers_build_for_a_boards_class_made_before_it_started(database_url, tmp_path):
    """A class made with `farm device-class` (a board's, measured elsewhere) had no worker
    unless someone started one by hand: its jobs waited for builds for ever. farm up's
    shared workers now listen on its queue too (after the host's class)."""
    from services.db.device_classes import ensure_device_class
    from services.db.session import make_session_factory, transaction

    sessions = make_session_factory(database_url)
    board = f"rpi4-{tmp_path.name}"
    try:
        with transaction(sessions) as s:
            ensure_device_class(s, name=board, target={"kind": "llvm", "mtriple": "aarch64-linux-gnu"})
    finally:
        sessions.kw["bind"].dispose()
    farm = LocalFarm(config(tmp_path / "farm", database_url))
    farm.prepare()
    command = farm.commands()["worker-1"]
    classes = [command[i + 1] for i, arg in enumerate(command) if arg == "--device-class"]
    assert classes == [farm.info["device_class"]] and "--every-class" in command  # the board's class, and later ones


def test_farm_up_fails_with_the_reason_its_agent_exited(database_url, tmp_path):
    cfg = config(tmp_path / "farm", database_url, agent_env={"TUNEFARM_AGENT_TOKEN": "tfa_" + "x" * 43})
    with pytest.raises(UsageError) as failed:
        up(cfg, log=lambda msg: None)
    message = str(failed.value)
    assert "\n" not in message and message.startswith("agent exited during start-up: Unauthenticated: "), message
    assert message.endswith(f"(log: {tmp_path / 'farm' / 'logs' / 'agent.log'})"), message


def test_an_agent_naming_a_class_that_does_not_exist_stops_and_says_which_exist(database_url, tmp_path):
    """A typo in --device-class: the class is not created (device classes are the
    operators'), and the agent stops at once with the classes that exist, instead of
    retrying for ever."""
    cfg = config(tmp_path / "farm", database_url, device_class="ops-class",
                 agent_env={"TUNEFARM_AGENT_DEVICE_CLASS": "ops-clas"})  # fmt: skip
    with pytest.raises(UsageError) as failed:
        up(cfg, log=lambda msg: None)
    message = str(failed.value)
    assert "\n" not in message, message
    assert message.startswith("agent exited during start-up: NotFound: device class 'ops-clas' does not exist "
                              "(existing classes: "), message
    assert "ops-class" in message and "tunefarm farm device-class ops-clas" in message, message


# -- under `tunefarm farm up`: its supervisor ------------------------------------------------

HANG_GUARD = 300.0  # generous: an idle machine takes a small part of it

QUICK_FARM = {  # the farm's processes read these from the environment farm up passes on
    **TEST_FARM_ENV,
    "TUNEFARM_POLL_INTERVAL_SECS": "0.1",
    "TUNEFARM_BUILD_CHECK_SECS": "1",  # a build nobody is doing is noticed within a second
    "TUNEFARM_BATCHES_PER_AGENT": "1",  # later batches come after the first results: kills hit mid-job
    "TUNEFARM_CHECK_TUNED_MODEL": "false",
    "TUNEFARM_HEARTBEAT_INTERVAL_SECS": "1",
    "TUNEFARM_LEASE_SECS": "6",
    "TUNEFARM_SWEEP_INTERVAL_SECS": "0.5",
    "TUNEFARM_AGENT_RECONNECT_MAX_SECS": "1",
    "TUNEFARM_COST_MODEL_WARMUP": "8",
    "TUNEFARM_RESTART_FIRST_DELAY_SECS": "0.2",  # the supervisor's delays (1 s doubling to 60 s by default)
    "TUNEFARM_RESTART_MAX_DELAY_SECS": "1",
}


def until(what: str, check, timeout: float = HANG_GUARD):
    """Poll `check()` until it returns something true; that value."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def tunefarm(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tunefarm_app.cli", *argv], env=env, capture_output=True,
                          text=True, timeout=HANG_GUARD)  # fmt: skip


@pytest.fixture(scope="module")
def supervised(database_url, tmp_path_factory):
    """`tunefarm farm up` (one worker, one agent, a device class of its own), as an
    operator runs it; `farm down` after."""
    state_dir = tmp_path_factory.mktemp("supervised") / "farm"
    started = tunefarm("farm", "up", "--state-dir", str(state_dir), "--database-url", database_url, "--workers", "1",
                       "--device-class", f"supervised-{uuid.uuid4().hex[:8]}", "--queue-prefix",
                       f"tfsup{uuid.uuid4().hex[:8]}", env={**os.environ, **QUICK_FARM})  # fmt: skip
    assert started.returncode == 0, started.stdout + started.stderr
    try:
        yield state_dir
    finally:
        tunefarm("farm", "down", "--state-dir", str(state_dir))


@pytest.fixture(scope="module")
def supervised_sessions(database_url):
    factory = make_session_factory(database_url)
    yield factory
    factory.kw["bind"].dispose()


@pytest.fixture(scope="module")
def supervised_client(supervised):
    with team_client(SimpleNamespace(info=read_state(supervised))) as client:
        yield client


@pytest.fixture(scope="module")
def tiny_model(supervised_client, tmp_path_factory) -> int:
    tiny = tiny_onnx(tmp_path_factory.mktemp("model") / "tiny.onnx")
    return supervised_client.upload_model(tiny, {"x": [1, 3, 8, 8]})["id"]


def start_job(state_dir: Path, client, model_id: int, seed: int) -> int:
    """A job of 16 trials on the model's own 4 tasks: four batches (Winograd alternatives,
    tuned through the farm in test_farm_e2e, would make it eight, some slow to build)."""
    device_class = read_state(state_dir)["device_class"]
    return client.create_job(model_id=model_id, device_class=device_class, trial_budget=16, seed=seed,
                             winograd=False)["id"]  # fmt: skip


def process_entry(state_dir: Path, name: str) -> dict:
    return read_state(state_dir)["processes"][name]


def started_again(state_dir: Path, name: str, dead_pid: int) -> int | None:
    """The new pid of `name` once the supervisor started it again (farm.json has it)."""
    entry = process_entry(state_dir, name)
    return entry["pid"] if entry["pid"] != dead_pid and local_processes.is_ours(entry) else None


def farm_log(state_dir: Path) -> str:
    return (state_dir / "logs" / "farm.log").read_text(errors="replace")


def farm_status(capsys, state_dir: Path) -> str:
    capsys.readouterr()
    assert main(["farm", "status", "--state-dir", str(state_dir)]) == 0
    return capsys.readouterr().out


def test_farm_up_fails_naming_a_process_that_exits_while_the_farm_starts(database_url, tmp_path):
    """The command (whose supervisor starts the farm and hands back what failed): a process
    that exits during start-up fails `farm up` (exit 2) with its name and the end of its
    log, and nothing of the farm stays running."""
    state_dir = tmp_path / "farm"
    with socket.socket() as taken:  # the lease service's port: it cannot listen
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        failed = tunefarm("farm", "up", "--state-dir", str(state_dir), "--database-url", database_url,
                          "--workers", "1", "--lease-bind", f"127.0.0.1:{port}",
                          "--queue-prefix", f"tfsup{uuid.uuid4().hex[:8]}")  # fmt: skip
    assert failed.returncode == 2, failed.stdout + failed.stderr
    assert failed.stderr.startswith("tunefarm: error: lease-service exited during start-up:\n"), failed.stderr
    assert f"bind to address 127.0.0.1:{port}" in failed.stderr  # the end of its log: gRPC's reason
    assert not [pid for pid in os.listdir("/proc") if pid.isdigit() and _cwd(pid) == state_dir.resolve()]


def _cwd(pid: str) -> Path | None:
    try:
        return Path(os.readlink(f"/proc/{pid}/cwd"))
    except OSError:
        return None


def test_an_operators_bad_day_redis_a_worker_the_agent_and_the_scheduler_killed_in_one_job(
    supervised, supervised_client, tiny_model, supervised_sessions, capsys
):
    """One job through all of it: the farm's Redis killed while a batch builds, then the
    only build worker (mid-build: the job needs a worker for its later batches), then,
    while a batch is measured, the scheduler that runs the job and the only agent (it
    registers under its name again and its leases end at once), each with SIGKILL and
    nobody's hand after. The job finishes, every candidate measured exactly once, and
    every process is back (farm status says each was started again)."""
    job_id = start_job(supervised, supervised_client, tiny_model, seed=4)  # four batches; the kills come mid-job

    def batch_in(state) -> bool:
        with transaction(supervised_sessions) as s:
            return s.scalar(select(Batch.id).where(Batch.job_id == job_id, Batch.state == state).limit(1)) is not None

    def leased() -> bool:
        with transaction(supervised_sessions) as s:
            return s.scalar(
                select(Lease.id).join(Batch, Batch.id == Lease.batch_id)
                .where(Batch.job_id == job_id, Lease.state == LeaseState.ACTIVE).limit(1)
            ) is not None  # fmt: skip

    def kill(name: str) -> None:
        dead = process_entry(supervised, name)["pid"]
        os.killpg(dead, signal.SIGKILL)
        until(f"{name} to be started again", lambda: started_again(supervised, name, dead))

    until("a batch being built", lambda: batch_in(BatchState.BUILDING))
    kill("redis")
    kill("worker-1")
    until("a batch being measured", leased)
    assert supervised_client.job(job_id)["state"] == "running"  # the kills come mid-job
    kill("scheduler")
    kill("agent")
    job = wait_for_job(supervised_client, job_id, timeout=HANG_GUARD)
    assert_measured_exactly_once(supervised_sessions, job)
    status = farm_status(capsys, supervised)
    for name in ("redis", "worker-1", "agent", "scheduler"):
        assert f"{name} was killed by SIGKILL" in farm_log(supervised), name
        assert f"{name} started again" in farm_log(supervised), name
        line = next(ln for ln in status.splitlines() if f"{name}:" in ln)
        assert "running" in line and "started again" in line, line
    # the agent needs neither Redis nor the scheduler: it died once, by the kill
    line = next(ln for ln in status.splitlines() if "agent:" in ln)
    assert "started again 1 time (last: was killed by SIGKILL)" in line, line
    # the supervisor asked TVM for the host's target without loading torch (`block_imports`)
    supervisor = read_state(supervised)["supervisor"]["pid"]
    assert "libtorch" not in Path(f"/proc/{supervisor}/maps").read_text()


def test_a_process_that_keeps_dying_is_given_up_and_farm_down_stops_the_rest(supervised, capsys):
    """worker-1 killed each time it is started again: after five quick deaths in a row
    it is given up (farm.log and farm status say so); farm down stops the supervisor
    first and then every process, and nothing is started again."""
    killed: set[int] = set()

    def next_start() -> int | str | None:
        """The pid to kill next, or "given up" once the supervisor gave worker-1 up."""
        entry = process_entry(supervised, "worker-1")
        if entry.get("given_up"):
            return "given up"
        return entry["pid"] if entry["pid"] not in killed and local_processes.is_ours(entry) else None

    while (pid := until("worker-1 to be started again or given up", next_start)) != "given up":
        os.killpg(pid, signal.SIGKILL)
        killed.add(pid)
    assert "worker-1 was killed by SIGKILL" in farm_log(supervised) and "GIVEN UP" in farm_log(supervised)
    status = farm_status(capsys, supervised)
    assert "supervisor running" in status, status
    line = next(ln for ln in status.splitlines() if "worker-1:" in ln)
    assert "GIVEN UP: it died 5 times in a row within 10 s of starting (last: was killed by SIGKILL)" in line, line
    state = read_state(supervised)
    assert main(["farm", "down", "--state-dir", str(supervised)]) == 0
    assert capsys.readouterr().out.startswith("stopped    supervisor, agent, ")
    after = read_state(supervised)
    assert not local_processes.pid_alive(state["supervisor"]["pid"])
    assert {name: p["pid"] for name, p in after["processes"].items()} == {
        name: p["pid"] for name, p in state["processes"].items()
    }  # nothing was started again while stopping
    assert not [name for name, p in after["processes"].items() if local_processes.pid_alive(p["pid"])]
    assert "supervisor stopped" in farm_status(capsys, supervised)
