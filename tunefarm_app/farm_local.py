"""The whole farm on one machine: `tunefarm farm up --state-dir D` and `farm down`.

`up` runs the migrations (creating the database if needed), makes sure a device class
for this CPU, a team and tokens exist, and starts the farm's processes in the
background, each in its own process group with its log in `D/logs/<name>.log`:

    redis          redis-server             the build queues (unless given --redis-url)
    api            tunefarm api             HTTP API (uvicorn)
    lease-service  tunefarm lease-service   gRPC service the agents dial into
    scheduler      tunefarm scheduler       the searches of every job
    worker-1, -2   tunefarm worker          RQ build workers for the class (and for every
                                            other class in the database, those made later
                                            too: a board's, cross-compiled here)
    agent          tunefarm agent           measures on this CPU (agent-2, ... with `agents`)
    worker-C       tunefarm worker          for each further class C (`extra_classes`):
    agent-C        tunefarm agent           its build worker and its agent, here

They share the artifact root `D/artifacts`, the database and Redis (with the queue
prefix given). Redis is the farm's own, with a generated password, unless a Redis URL
with a password is given (`tunefarm_app.farm_redis`). The class may be another machine's (`FarmConfig.target`, e.g. an aarch64
board's: the workers cross-compile for it), measured by an agent started another way
(`agent_command`, `agent_env`: e.g. the agent under qemu-user in an aarch64 root).

The farm's signing key pair is made once in `D/signing` (`signing_env`; the private key
mode 0600): build workers and the scheduler sign what agents load with it, agents check
with the public key, `D/signing/farm-signing.pub` (copy it to remote boards:
`tunefarm agent --signing-public-key`).

Its agents' names are the host's, `D`'s name and a digest of `D`'s path
(`agent_base_name`: two farms from `a/farm` and `b/farm` on one database do not share
one), and every start issues a new agent token, to which `up` hands those names
(`tokens.claim_agent_names`; refused while a live agent of another farm holds one).

`up` waits until the API answers, the lease service listens and every agent has
registered with this start's token (an agent that exits first fails `up` with its
one-line reason: a taken name, an unknown class, a CPU that cannot run the class's
code), then writes `D/farm.json`: the API URL, the gRPC address, a
team token and an agent token, the Redis URL, and the processes (pid, log, command).
The secrets are in that file only (mode 0600) and in the processes' environment, never
on a command line (`ps` shows those to every user). What the farm writes under `D`
(logs, artifacts, the agent's work) is its user's only: the processes run with umask
077, and a new `D` and its logs/ and artifacts/ are 0700. `down` stops the farm's
supervisor if it has one (below), then the processes (SIGTERM to each group, SIGKILL
after a grace period; the agents first, so that they go offline while the lease service
answers, and the farm's own Redis last, so that the build workers shut down warm), and
marks them stopped in farm.json.

`tunefarm farm up` runs `up` in a detached supervisor that starts again the processes
that die (`tunefarm_app.farm_supervisor`; farm.json's `supervisor`); `up` itself, as
tests and benches call it, starts a farm nobody supervises.

Further classes (`extra_classes`, name -> target; `farm up --extra-class NAME=TARGET`)
are served here too, each by its own build worker and agent: x86 ISA classes whose code
this CPU runs (e.g. `haswell` and `x86-64-v2` on an AVX2 machine) tune side by side. An
agent whose CPU cannot run its class's code is refused (`tunefarm.isa`), and `up` fails
with its log.

`deploy/docker-compose.yml` runs the same processes with the same settings in containers.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tunefarm.errors import UsageError
from tunefarm_app import local_processes
from tunefarm_app.farm_names import agent_base_name, detected_class_name, name_part
from tunefarm_app.farm_redis import REDIS_PROCESS, OwnRedis, check_given, wait_ready
from tunefarm_app.farm_tls import FarmTls

FARM_FILE = "farm.json"
SUPERVISOR = "supervisor"
"""farm.json's entry for `farm up`'s supervisor (tunefarm_app.farm_supervisor): pid, start, log."""
LOGS_DIR = "logs"
ARTIFACTS_DIR = "artifacts"
SIGNING_DIR = "signing"
SIGNING_KEY = "farm-signing.key"
SIGNING_PUBLIC_KEY = "farm-signing.pub"

START_TIMEOUT_SECS = 180.0
"""How long `farm up` waits for every process to be healthy."""

STOP_GRACE_SECS = 20.0
"""How long `farm down` waits after SIGTERM before SIGKILL."""

DEFAULT_TEAM = "local"

PRIVATE_UMASK = 0o077
"""The farm's processes make files their user alone can read (logs, artifacts, work)."""


@dataclass
class FarmConfig:
    """What `farm up` starts, and with which settings (every value reaches the processes
    through the TUNEFARM_* variables their settings classes read)."""

    state_dir: Path
    database_url: str
    redis_url: str | None = None  # None: a Redis of the farm's own (tunefarm_app.farm_redis)
    redis_without_password: bool = False  # accept a given redis_url without a password
    queue_prefix: str = "tunefarm"
    api_bind: str = "127.0.0.1:0"  # port 0: a free one
    lease_bind: str = "127.0.0.1:0"
    workers: int = 2
    agents: int = 1  # CPU agents on this machine: agent, agent-2, agent-3, ...
    team: str = DEFAULT_TEAM
    device_class: str | None = None  # default: detected for this CPU
    extra_env: dict[str, str] = field(default_factory=dict)  # more settings for every process
    target: dict[str, Any] | None = None  # the class's TVM target; default: this CPU's
    agent_command: list[str] | None = None  # how the agent starts; default: `tunefarm agent` here
    agent_env: dict[str, str] = field(default_factory=dict)  # more environment for the agent only
    tls: FarmTls | None = None  # agents and the lease service over TLS; None: plaintext on loopback
    extra_classes: dict[str, dict[str, Any]] = field(default_factory=dict)  # more classes served here

    @property
    def artifact_root(self) -> Path:
        return self.state_dir / ARTIFACTS_DIR


@dataclass
class Process:
    name: str
    command: list[str]
    pid: int
    log: str
    started: str | None = None  # the kernel's start time of `pid` (a pid reused later differs)
    since: float = field(default_factory=time.monotonic)  # when it started, on this process's monotonic clock


class LocalFarm:
    """The processes of a farm on this machine (also used by tests to stop and restart one)."""

    def __init__(self, config: FarmConfig, *, log: Callable[[str], None] = lambda msg: None):
        self.config = config
        self.log = log
        self.processes: dict[str, Process] = {}
        self._popen: dict[str, subprocess.Popen] = {}
        self.env: dict[str, str] = {}
        self.info: dict[str, Any] = {}
        self.agent_token_id: int | None = None  # the agent token this start issued (prepare)
        self._starts: dict[str, int] = {}  # times each process was started
        self.own_redis: OwnRedis | None = None
        # Under `farm up`'s supervisor (tunefarm_app.farm_supervisor): farm.json's
        # "supervisor" entry, and what it notes about each process (restarts, last exit,
        # given up) next to the process's entry.
        self.supervisor: dict[str, Any] | None = None
        self.supervision: dict[str, dict[str, Any]] = {}

    # -- setting up ---------------------------------------------------------------------------

    def prepare(self) -> dict[str, Any]:
        """Database (created and migrated), device class, team, tokens, ports, environment."""
        from services.db import device_classes, teams, tokens
        from services.db.migrate import create_database, database_exists, upgrade
        from services.db.session import make_session_factory, transaction
        from tunefarm.target import host_target_dict

        c = self.config
        c.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # an existing one keeps its mode
        for directory in (c.state_dir / LOGS_DIR, c.artifact_root):
            directory.mkdir(mode=0o700, exist_ok=True)
            os.chmod(directory, 0o700)  # the farm's user only, whoever made it before
        if c.redis_url is None:
            self.own_redis = OwnRedis.create(c.state_dir)
            redis_url = self.own_redis.url
        else:
            check_given(c.redis_url, without_password=c.redis_without_password)
            redis_url = c.redis_url
        if not database_exists(c.database_url):
            create_database(c.database_url)
        upgrade(c.database_url)
        target = c.target or host_target_dict()
        class_name = c.device_class or detected_class_name(target)
        previous_token = _previous_agent_token(c.state_dir)
        sessions = make_session_factory(c.database_url)
        try:
            with transaction(sessions) as s:
                device_classes.ensure_device_class(s, name=class_name, target=target, description="this machine's CPU (farm up)")
                for name, extra in c.extra_classes.items():
                    device_classes.ensure_device_class(s, name=name, target=extra, description="served here (farm up --extra-class)")
                team = teams.ensure_team(s, name=c.team)
                team_token = tokens.issue_team_token(s, team_id=team.id, label="farm up")
                agent_token = tokens.issue_agent_token(s, label="farm up")
                self.agent_token_id = tokens.agent_token_id(s, plain=agent_token)
                previous_id = tokens.agent_token_id(s, plain=previous_token) if previous_token else None
                self._prepare_env(class_name, agent_token, redis_url)
                # The names its agents register with are the new token's (those of an
                # earlier start from this state dir hold them; nothing is issued if a
                # live agent of another farm holds one).
                tokens.claim_agent_names(
                    s, names=self.all_agent_names(), token_id=self.agent_token_id, fresh_secs=self._fresh_secs(),
                    ours=frozenset({previous_id} - {None}),
                )  # fmt: skip
        except tokens.AgentNamesInUse as exc:
            raise UsageError(str(exc)) from None
        finally:
            sessions.kw["bind"].dispose()
        self.info |= {
            "team": c.team,
            "team_token": team_token,
            "agent_token": agent_token,
            "device_class": class_name,
            "target": target,
        }
        return self.info

    def _prepare_env(self, class_name: str, agent_token: str, redis_url: str) -> None:
        """Every process's TUNEFARM_* settings, and farm.json's addresses (`info`)."""
        c = self.config
        api_bind = local_processes.with_free_port(c.api_bind)
        lease_bind = local_processes.with_free_port(c.lease_bind)
        signing = signing_env(c.state_dir)
        self.env = {
            "TUNEFARM_DATABASE_URL": c.database_url,
            "TUNEFARM_REDIS_URL": redis_url,
            "TUNEFARM_QUEUE_PREFIX": c.queue_prefix,
            "TUNEFARM_ARTIFACT_ROOT": str(c.artifact_root.resolve()),
            "TUNEFARM_API_BIND": api_bind,
            "TUNEFARM_LEASE_BIND": lease_bind,
            "TUNEFARM_AGENT_SERVER": local_processes.connect_address(lease_bind),
            "TUNEFARM_AGENT_TOKEN": agent_token,
            "TUNEFARM_AGENT_DEVICE_CLASS": class_name,
            "TUNEFARM_AGENT_NAME": agent_base_name(c.state_dir),
            "TUNEFARM_AGENT_WORK_DIR": str((c.state_dir / "agent").resolve()),
            "TUNEFARM_BUILD_PROCESSES": str(max(1, (os.cpu_count() or 2) // 2)),
            **(c.tls.env() if c.tls else {}),
            **signing,
            **c.extra_env,
        }
        self.info = {
            "api_url": f"http://{local_processes.connect_address(api_bind)}",
            "grpc_address": local_processes.connect_address(lease_bind),
            "grpc_tls": c.tls is not None,
            "extra_classes": dict(c.extra_classes),
            "database_url": c.database_url,
            "redis_url": redis_url,
            "own_redis": self.own_redis is not None,
            "queue_prefix": c.queue_prefix,
            "artifact_root": str(c.artifact_root.resolve()),
            "signing_public_key": signing["TUNEFARM_AGENT_SIGNING_PUBLIC_KEY"],
        }

    def _fresh_secs(self) -> float:
        """The farm's agent freshness window (TUNEFARM_AGENT_FRESH_SECS, as its services read it)."""
        from services.common.settings import ServiceSettings

        given = self.config.extra_env.get("TUNEFARM_AGENT_FRESH_SECS") or os.environ.get("TUNEFARM_AGENT_FRESH_SECS")
        return float(given) if given else ServiceSettings.model_fields["agent_fresh_secs"].default

    def commands(self) -> dict[str, list[str]]:
        """Every process's command line (`python -m tunefarm_app.cli ...`)."""
        cli = [sys.executable, "-m", "tunefarm_app.cli"]
        klass = self.info["device_class"]
        out = {REDIS_PROCESS: self.own_redis.command()} if self.own_redis else {}
        out |= {
            "api": [*cli, "api"],
            "lease-service": [*cli, "lease-service"],
            "scheduler": [*cli, "scheduler"],
        }
        # The shared workers build for every class of the database too, those made later
        # included (a board's, made with `farm device-class`), after the host's class.
        for i in range(1, self.config.workers + 1):
            name = f"worker-{i}"
            out[name] = [*cli, "worker", "--device-class", klass, "--every-class", "--name", self.worker_name(name)]
        for name in self.agent_names():
            out[name] = list(self.config.agent_command or [*cli, "agent"])
        for c in self.config.extra_classes:
            out[f"worker-{c}"] = [*cli, "worker", "--device-class", c, "--name", self.worker_name(f"worker-{c}")]
            out[f"agent-{c}"] = [
                *cli, "agent", "--device-class", c, "--name", self.agent_name(c),
                "--work-dir", str((self.config.state_dir / f"agent-{c}").resolve()),
            ]  # fmt: skip
        return out

    def all_agent_names(self) -> list[str]:
        """The names every agent process of the farm registers with."""
        return [self.registered_name(p) for p in (*self.agent_names(), *(f"agent-{c}" for c in self.config.extra_classes))]

    def agent_names(self) -> list[str]:
        """The agent processes of the farm's own class (`agents` of them)."""
        return ["agent", *(f"agent-{i}" for i in range(2, self.config.agents + 1))]

    def agent_name(self, device_class: str | None = None) -> str:
        """The name the farm's first agent registers with (that of an extra class's, given one)."""
        base = self.env["TUNEFARM_AGENT_NAME"]
        return base if device_class is None else f"{base}-{name_part(device_class)}"

    def registered_name(self, process: str) -> str:
        """The name an agent process registers with."""
        for c in self.config.extra_classes:
            if process == f"agent-{c}":
                return self.agent_name(c)
        return {**self.env, **self._agent_env(process)}["TUNEFARM_AGENT_NAME"]

    def worker_name(self, process: str) -> str:
        """The RQ name of a worker process as last started: unique to this farm (one
        process may start several farms on one Redis, each with its own prefix) and to
        this start of it (RQ refuses a name still registered in Redis, as a killed
        worker's stays)."""
        again = self._starts.get(process, 1) - 1
        return f"{socket.gethostname()}-{self.config.queue_prefix}-{os.getpid()}-{process}" + (f".{again}" if again else "")

    def _agent_env(self, name: str) -> dict[str, str]:
        """An agent's own name and work directory (the first keeps the farm's)."""
        if name == "agent":
            return dict(self.config.agent_env)
        return {
            "TUNEFARM_AGENT_NAME": f"{self.env['TUNEFARM_AGENT_NAME']}-{name.rsplit('-', 1)[1]}",
            "TUNEFARM_AGENT_WORK_DIR": f"{self.env['TUNEFARM_AGENT_WORK_DIR']}-{name.rsplit('-', 1)[1]}",
            **self.config.agent_env,
        }

    # -- processes ----------------------------------------------------------------------------

    def start(self, name: str) -> Process:
        self._starts[name] = self._starts.get(name, 0) + 1
        command = self.commands()[name]
        log_path = self.config.state_dir / LOGS_DIR / f"{name}.log"
        env = {**os.environ, **self.env, **(self._agent_env(name) if name in self.agent_names() else {})}
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "ab") as log_file:
            proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.config.state_dir,
                start_new_session=True,  # its own process group: `down` stops its children too
                umask=PRIVATE_UMASK,
            )
        process = Process(name, command, proc.pid, str(log_path), local_processes.started_at(proc.pid))
        self.processes[name] = process
        self._popen[name] = proc
        if (self.config.state_dir / FARM_FILE).exists():  # a restart: keep farm.json's pids right
            self.write_state()
        return process

    def start_all(self) -> None:
        for name in self.commands():
            self.start(name)
            if name == REDIS_PROCESS:  # the others connect to it at once
                self._wait_own_redis()

    def _wait_own_redis(self) -> None:
        log = Path(self.processes[REDIS_PROCESS].log)
        wait_ready(self.info["redis_url"], lambda: self.alive(REDIS_PROCESS), lambda: local_processes.log_tail(log))

    def alive(self, name: str) -> bool:
        proc = self._popen.get(name)
        if proc is not None:
            return proc.poll() is None
        return local_processes.pid_alive(self.processes[name].pid)

    def exit_status(self, name: str) -> int | None:
        """How a process this object started ended (Popen's returncode: -N for signal N);
        None while it runs, or for one started elsewhere."""
        proc = self._popen.get(name)
        return proc.poll() if proc is not None else None

    def stop(self, name: str, *, sig: int = signal.SIGTERM, grace: float = STOP_GRACE_SECS) -> None:
        """Stop one process (its whole group); SIGKILL after `grace` seconds."""
        process = self.processes[name]
        local_processes.signal_group(process.pid, sig)
        deadline = time.monotonic() + grace
        while self.alive(name) and time.monotonic() < deadline:
            time.sleep(0.1)
        if self.alive(name):
            local_processes.signal_group(process.pid, signal.SIGKILL)
            while self.alive(name):
                time.sleep(0.05)
        proc = self._popen.pop(name, None)
        if proc is not None:
            proc.wait()

    def stop_all(self, *, grace: float = STOP_GRACE_SECS) -> None:
        """The agents first (`stopping_order`), then the rest, Redis last; each group's
        SIGTERMs at once, so that its processes stop in parallel."""
        for group in stopping_order(list(self.processes)):
            for name in group:
                local_processes.signal_group(self.processes[name].pid, signal.SIGTERM)
            for name in group:
                self.stop(name, grace=grace)

    # -- health -------------------------------------------------------------------------------

    def wait_healthy(self, timeout: float = START_TIMEOUT_SECS) -> None:
        """Until the API answers, the lease service listens and every agent registered
        (with this start's token: a row of an earlier farm's agent under the same name
        does not count); `UsageError` if a process exits first: an agent's own one-line
        reason (a taken name, a class this CPU cannot serve), another's log tail."""
        deadline = time.monotonic() + timeout
        pending = {"api", "lease-service", *self.agent_names(), *(f"agent-{c}" for c in self.config.extra_classes)}
        while pending:
            for name in self.processes:
                if not self.alive(name):
                    log = Path(self.processes[name].log)
                    reason = agent_exit_reason(log) if name.startswith("agent") else None
                    if reason:
                        raise UsageError(f"{name} exited during start-up: {reason} (log: {log})")
                    raise UsageError(f"{name} exited during start-up:\n{local_processes.log_tail(log)}")
            if "api" in pending and local_processes.http_ok(self.info["api_url"] + "/healthz"):
                pending.discard("api")
            if "lease-service" in pending and local_processes.port_open(self.info["grpc_address"]):
                pending.discard("lease-service")
            pending -= {name for name in pending if name.startswith("agent") and self._agent_registered(name)}
            if not pending:
                return
            if time.monotonic() > deadline:
                raise UsageError(f"the farm did not come up within {timeout:.0f} s (waiting for {', '.join(sorted(pending))})")
            time.sleep(0.5)

    def _agent_registered(self, name: str) -> bool:
        from services.db.database_admin import agent_registered

        return agent_registered(self.config.database_url, name=self.registered_name(name), token_id=self.agent_token_id)

    # -- farm.json ----------------------------------------------------------------------------

    def write_state(self) -> Path:
        path = self.config.state_dir / FARM_FILE
        data = {
            **self.info,
            "processes": {
                p.name: {"pid": p.pid, "started": p.started, "log": p.log, "command": p.command, "running": True,
                         **self.supervision.get(p.name, {})}
                for p in self.processes.values()
            },  # fmt: skip
            **({SUPERVISOR: self.supervisor} if self.supervisor is not None else {}),
        }
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it holds tokens
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
        return path


def up(config: FarmConfig, *, log: Callable[[str], None] = print) -> LocalFarm:
    """Start a farm (see the module docstring) and write farm.json; returns it running."""
    existing = config.state_dir / FARM_FILE
    if existing.exists():
        state = read_state(config.state_dir)
        procs = {**state.get("processes", {}), **({SUPERVISOR: state[SUPERVISOR]} if state.get(SUPERVISOR) else {})}
        running = [n for n, p in procs.items() if p.get("running") and local_processes.is_ours(p)]
        if running:
            raise UsageError(f"a farm is already running from {config.state_dir} ({', '.join(running)}); run farm down first")
    farm = LocalFarm(config, log=log)
    info = farm.prepare()
    log(f"starting the farm in {config.state_dir} (device class {info['device_class']})")
    try:
        farm.start_all()
        farm.wait_healthy()
    except BaseException:
        farm.stop_all(grace=5.0)
        raise
    farm.write_state()
    return farm


def down(state_dir: Path, *, grace: float = STOP_GRACE_SECS) -> list[str]:
    """Stop the processes `farm up` started from `state_dir`, its supervisor first (so
    that nothing is started again meanwhile); returns the names stopped."""
    stopped = [SUPERVISOR] if _stop_supervisor(state_dir, grace) else []
    data = read_state(state_dir)  # as the supervisor left it
    if data.get(SUPERVISOR):
        data[SUPERVISOR]["running"] = False
    procs = data.get("processes", {})
    for p in procs.values():
        if p.get("running") and not local_processes.is_ours(p):
            p["running"] = False  # exited long ago; the pid may be another program's now
    for group in stopping_order([name for name, p in procs.items() if p.get("running")]):
        for name in group:
            local_processes.signal_group(procs[name]["pid"], signal.SIGTERM)
        deadline = time.monotonic() + grace
        for name in group:
            p = procs[name]
            while local_processes.pid_alive(p["pid"]) and time.monotonic() < deadline:
                time.sleep(0.1)
            if local_processes.pid_alive(p["pid"]):
                local_processes.signal_group(p["pid"], signal.SIGKILL)
            p["running"] = False
            stopped.append(name)
    path = state_dir / FARM_FILE
    fd = os.open(path.with_name(path.name + ".tmp"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    os.replace(path.with_name(path.name + ".tmp"), path)
    return stopped


def _stop_supervisor(state_dir: Path, grace: float) -> bool:
    """SIGTERM to the farm's supervisor, if one runs (SIGKILL after `grace` seconds); True
    if one did. It exits without stopping the processes."""
    supervisor = read_state(state_dir).get(SUPERVISOR)
    if not supervisor or not supervisor.get("running") or not local_processes.is_ours(supervisor):
        return False
    pid = supervisor["pid"]
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + grace
    while local_processes.pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if local_processes.pid_alive(pid):
        local_processes.signal_group(pid, signal.SIGKILL)  # it leads its own session and group
        while local_processes.pid_alive(pid):
            time.sleep(0.05)
    return True


def stopping_order(names: list[str]) -> list[list[str]]:
    """The farm's processes in the order they are stopped: its agents first, while the
    lease service still answers their GoOffline (they give back their leases and are
    offline at once; stopped together with it, each stayed idle in its row for the
    freshness window), then the others, then the farm's own Redis (stopped together
    with it, a build worker blocked on it lost it before it saw its SIGTERM, and retried
    it until it was killed after the grace period)."""
    agents = [n for n in names if n == "agent" or n.startswith("agent-")]
    redis = [n for n in names if n == REDIS_PROCESS]
    others = [n for n in names if n not in agents and n not in redis]
    return [group for group in (agents, others, redis) if group]


def read_state(state_dir: Path) -> dict[str, Any]:
    path = Path(state_dir) / FARM_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"no farm in {state_dir} (no {FARM_FILE}); start one with tunefarm farm up") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path} is not valid JSON ({exc.msg})") from None


def signing_env(state_dir: Path) -> dict[str, str]:
    """The farm's signing key pair, made once in `state_dir/signing` (the private key
    mode 0600, in a directory only its owner enters): the settings that hand the private
    key to the build workers and the scheduler, the public key to the agents."""
    from services.protocol.signing import KeyFileError, ensure_key_pair

    directory = (state_dir / SIGNING_DIR).resolve()
    directory.mkdir(mode=0o700, exist_ok=True)
    try:
        ensure_key_pair(directory / SIGNING_KEY, directory / SIGNING_PUBLIC_KEY)
    except KeyFileError as exc:
        raise UsageError(str(exc)) from None
    return {
        "TUNEFARM_SIGNING_KEY_FILE": str(directory / SIGNING_KEY),
        "TUNEFARM_AGENT_SIGNING_PUBLIC_KEY": str(directory / SIGNING_PUBLIC_KEY),
    }


AGENT_ERROR_PREFIX = "tunefarm agent: error: "
"""How `tunefarm agent` prints the reason it stops (services/agent/cli.py)."""


def agent_exit_reason(log: Path) -> str | None:
    """The one-line reason an agent process gave for exiting (its last `tunefarm agent:
    error:` line), None if it gave none."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    reasons = [line.split(AGENT_ERROR_PREFIX, 1)[1].strip() for line in lines if AGENT_ERROR_PREFIX in line]
    return reasons[-1] if reasons else None


def _previous_agent_token(state_dir: Path) -> str | None:
    """The agent token of the last start from `state_dir` (farm.json), if any."""
    try:
        return json.loads((Path(state_dir) / FARM_FILE).read_text()).get("agent_token")
    except (OSError, ValueError, AttributeError):
        return None
