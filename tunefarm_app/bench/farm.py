"""`tunefarm bench farm`: the measurement farm's data plane on this machine.

Everything runs on loopback, each piece in its own process as in a deployment: the
lease service (`python -m services.lease`), an RQ build worker
(`python -m services.worker`), N agents (`python -m services.agent`); this
process plays the scheduler (`FarmMeasurer`). It needs the farm's PostgreSQL and Redis
(TUNEFARM_DATABASE_URL, TUNEFARM_REDIS_URL; it makes and drops a database of its own and
uses queue names of its own).

1. Throughput: measurements per second with 1, 2 and 4 agents on tiny kernels (an
   elementwise add), every batch built before the clock starts. Batches are built for a
   holding class, the agents start and report healthy, then the batches move to the
   agents' class in one transaction: the clock runs from there to the last result
   collected. Target: N agents measure at least 0.9 x N x one agent's rate. (All agents
   share this machine's cores here; on a farm each has its own board.)
2. Dispatch overhead per candidate: build and run replaced by stand-ins that take no
   time (the worker "builds" by naming a 16 KB file, the agent "runs" by answering a
   fixed cost), so what is left is the queue, the RPCs (lease, fetch, results) and the
   database. One batch of 64 at a time (latency, with where the time goes) and 16
   batches of 64 at once (what the pipeline sustains). Target: at most 1 ms per
   candidate amortised over a batch of 64.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tunefarm.errors import UsageError
from tunefarm_app.bench import farm_progress

ROOT = Path(__file__).resolve().parents[2]

DISPATCH_BATCH = 64
DISPATCH_TARGET_MS = 1.0
SCALING_TARGET = 0.9


def add_command(bsub) -> None:
    bf = bsub.add_parser("farm", help="the measurement farm: measurements/s with 1, 2, 4 agents; dispatch overhead")
    bf.add_argument("--agents", default="1,2,4", help="agent counts to measure with (default 1,2,4)")
    bf.add_argument("--per-agent", type=int, default=64, help="kernels measured per agent in each run (default 64)")
    bf.add_argument("--batch-size", type=int, default=16, help="candidates per batch in the throughput runs")
    bf.add_argument("--repeat", type=int, default=3, help="timed repeats per kernel (default 3)")
    bf.add_argument("--min-repeat-ms", type=float, default=10.0, help="minimum length of a repeat (default 10)")
    bf.add_argument("--dispatch-batches", type=int, default=16, help="batches of 64 in the pipelined dispatch run")
    bf.add_argument("--skip-throughput", action="store_true", help="skip the measurements-per-second runs")
    bf.add_argument("--skip-dispatch", action="store_true", help="skip the dispatch overhead run")
    bf.add_argument("--json", type=Path, help="write the results as JSON here")
    farm_progress.add_arguments(bf)  # the control plane's part: the progress endpoint under pollers


def run_farm_bench(args: argparse.Namespace) -> int:
    counts = [int(x) for x in str(args.agents).split(",") if x.strip()]
    if not counts or min(counts) < 1 or args.per_agent < 1 or args.batch_size < 1:
        raise UsageError("--agents, --per-agent and --batch-size must be positive")
    out: dict[str, Any] = {}
    with BenchFarm() as farm:
        if not args.skip_throughput:
            out["throughput"] = _throughput(farm, counts, args)
        if not args.skip_dispatch:
            out["dispatch"] = _dispatch(farm, args)
    if not args.skip_progress:
        out["progress"] = farm_progress.from_args(args, log=_say)
    _print(out)
    if "progress" in out:
        farm_progress.print_table(out["progress"])
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- the farm under test --------------------------------------------------------------------


LEASE_SERVICE_ENV = {
    "TUNEFARM_LEASE_WAIT_SECS": "2",
    "TUNEFARM_LEASE_RECHECK_SECS": "0.05",
    "TUNEFARM_HEARTBEAT_INTERVAL_SECS": "1",
}
"""The lease service's settings in the throughput and dispatch runs (a few agents: short
long polls, quick rechecks)."""


class BenchFarm:
    """A throw-away database, artifact root and queue prefix; the lease service (with
    `lease_env` for its settings) and the processes the runs start; a job to measure for."""

    def __init__(self, lease_env: dict[str, str] | None = None):
        self.lease_env = LEASE_SERVICE_ENV if lease_env is None else lease_env

    def __enter__(self) -> BenchFarm:
        from redis import Redis

        from services.db.database_admin import with_database
        from services.db.migrate import create_database, upgrade
        from services.db.session import make_session_factory
        from services.db.settings import DatabaseSettings
        from services.worker.settings import WorkerSettings

        self.uid = uuid.uuid4().hex[:8]
        self.url = with_database(DatabaseSettings().database_url, f"tunefarm_bench_{self.uid}")
        create_database(self.url)
        upgrade(self.url)
        self.sessions = make_session_factory(self.url)
        self.redis_url = WorkerSettings().redis_url
        self.redis = Redis.from_url(self.redis_url)
        self.prefix = f"bench-{self.uid}"
        self.tmp = tempfile.TemporaryDirectory(prefix="tunefarm-bench-farm-")
        self.root = Path(self.tmp.name) / "artifacts"
        self.root.mkdir()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.env = {
            **os.environ,
            "TUNEFARM_DATABASE_URL": self.url,
            "TUNEFARM_REDIS_URL": self.redis_url,
            "TUNEFARM_ARTIFACT_ROOT": str(self.root),
            "TUNEFARM_QUEUE_PREFIX": self.prefix,
            "PYTHONUNBUFFERED": "1",
        }
        self.port = free_port()
        self.job_id, self.token = self._job()
        self.env["TUNEFARM_AGENT_TOKEN"] = self.token
        self.env.update(bench_signing_env(Path(self.tmp.name) / "signing"))
        self.lease_service = self.start(
            "lease-service",
            [sys.executable, "-m", "services.lease", "--bind", f"127.0.0.1:{self.port}"],
            **self.lease_env,
        )
        wait_port(self.port, self.lease_service)
        return self

    def __exit__(self, *exc: object) -> None:
        from services.db.migrate import drop_database

        for proc in reversed(self.procs):
            self.stop(proc)
        for key in self.redis.scan_iter(f"*{self.prefix}*"):
            self.redis.delete(key)
        self.sessions.kw["bind"].dispose()
        drop_database(self.url)
        self.tmp.cleanup()

    def _job(self) -> tuple[int, str]:
        from services.db import synthetic_load, teams, tokens
        from services.db.session import transaction
        from services.db.states import TokenKind

        cls = self.device_class("jobs")
        with transaction(self.sessions) as s:
            team = teams.ensure_team(s, name=f"bench-{self.uid}")
            [job_id] = synthetic_load.add_model_and_jobs(s, team_id=team.id, device_class_id=cls, name="bench",
                                                         n_jobs=1, trial_budget=10**9)  # fmt: skip
            _, token = tokens.issue_token(s, kind=TokenKind.AGENT, label="bench")
            return job_id, token

    def device_class(self, name: str) -> int:
        """The id of the class `name` (for this machine's CPU), made if it does not exist."""
        from services.db import device_classes
        from services.db.session import transaction
        from tunefarm.target import host_target_dict

        with transaction(self.sessions) as s:
            return int(device_classes.ensure_device_class(s, name=name, target=host_target_dict()).id)

    def start(self, label: str, argv: list[str], **env: str) -> subprocess.Popen[bytes]:
        log = open(Path(self.tmp.name) / f"{label}.log", "ab")  # noqa: SIM115 (the process keeps it)
        proc = subprocess.Popen(argv, cwd=ROOT, env={**self.env, **env}, stdout=log, stderr=subprocess.STDOUT)
        proc.log_path = log.name  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def log_tail(self, proc: subprocess.Popen[bytes], lines: int = 15) -> str:
        log = getattr(proc, "log_path", None)
        return "\n".join(Path(log).read_text(errors="replace").splitlines()[-lines:]) if log else ""

    def stop(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc in self.procs:
            self.procs.remove(proc)

    def measurer(self, device_class: str, **kw: Any):
        from services.scheduler.farm_measurer import FarmMeasurer

        return FarmMeasurer(
            self.sessions,
            self.redis,
            artifact_root=self.root,
            job_id=self.job_id,
            device_class=device_class,
            queue_prefix=self.prefix,
            **kw,
        )

    def agent_argv(self, name: str, device_class: str) -> list[str]:
        return [
            sys.executable, "-m", "services.agent", "--server", f"127.0.0.1:{self.port}",
            "--device-class", device_class, "--name", name, "--threads", "1",
            "--work-dir", str(Path(self.tmp.name) / "agents" / name),
        ]  # fmt: skip

    def wait_healthy(self, names: Sequence[str], timeout: float = 300.0) -> None:
        """Until every named agent has registered and reported a started runner."""
        from services.db import synthetic_load
        from services.db.session import transaction

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with transaction(self.sessions) as s:
                rows = synthetic_load.agent_capabilities(s, names)
            ok = [n for n, caps in rows if (caps or {}).get("health", {}).get("status") == "HEALTH_STATUS_OK"]
            if len(ok) == len(names):
                return
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"a farm process exited: {' '.join(map(str, proc.args))}\n{self.log_tail(proc)}")
            time.sleep(0.1)
        raise TimeoutError(f"agents {list(names)} did not become healthy")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the lease service exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError("the lease service did not start listening")


def tiny_workload(n: int = 4096):
    from tvm import te

    from tunefarm.workloads import workload_from_te

    a = te.placeholder((n,), "float32", name="A")
    b = te.placeholder((n,), "float32", name="B")
    c = te.compute((n,), lambda i: a[i] + b[i], name="C")
    return workload_from_te(f"add{n}", [a, b, c], reference=lambda x, y: [x + y])


def distinct_inputs(task_key: str, start: int, n: int):
    from tunefarm.records import Candidate, MeasureInput

    # Distinct candidates of one tiny program (the unscheduled one: every build succeeds).
    return [MeasureInput(task_key, Candidate.make(0, {"bench.i": start + i}), "bench", [[], []]) for i in range(n)]


def _collect(measurer, n: int, timeout: float) -> list:
    out: list = []
    deadline = time.monotonic() + timeout
    while len(out) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(out)} of {n} results after {timeout:.0f} s")
        out += measurer.collect(timeout=1.0)
    return out


# -- 1. throughput --------------------------------------------------------------------------


def _throughput(farm: BenchFarm, counts: list[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    from services.db import synthetic_load
    from services.db.session import transaction
    from services.db.states import BatchState
    from tunefarm.measure import MeasureBatch
    from tunefarm.records import ErrorKind, TimingConfig
    from tunefarm.target import host_target_dict

    hold = f"hold-{farm.uid}"
    farm.device_class(hold)
    worker = farm.start("worker", [sys.executable, "-m", "services.worker", "--device-class", hold],
                        TUNEFARM_BUILD_PROCESSES="2")  # fmt: skip
    wl = tiny_workload()
    timing = TimingConfig(repeat=args.repeat, min_repeat_ms=args.min_repeat_ms)
    rows = []
    next_key = 0
    try:
        for n_agents in counts:
            run_class = f"run{n_agents}-{farm.uid}"
            run_class_id = farm.device_class(run_class)
            measurer = farm.measurer(hold, poll_interval=0.01)
            task = measurer.prepare(wl, f"{wl.key}@bench", host_target_dict())
            total = args.per_agent * n_agents
            batch_ids_before = _batch_ids(farm)
            for start in range(0, total, args.batch_size):
                size = min(args.batch_size, total - start)
                inputs = distinct_inputs(task.key, next_key, size)
                next_key += size
                measurer.submit(MeasureBatch(id=f"t{n_agents}:{start}", task=task, inputs=tuple(inputs), timing=timing))
            mine = sorted(_batch_ids(farm) - batch_ids_before)
            _say(f"throughput, {n_agents} agent(s): building {total} kernels in {len(mine)} batches")
            _wait_states(farm, mine, {BatchState.READY, BatchState.DONE}, timeout=600)
            names = [f"bench-{farm.uid}-{n_agents}-{i}" for i in range(n_agents)]
            agents = [farm.start(name, farm.agent_argv(name, run_class)) for name in names]
            farm.wait_healthy(names)
            t0 = time.perf_counter()
            with transaction(farm.sessions) as s:  # hand the built batches to the agents at once
                synthetic_load.move_batches(s, mine, run_class_id)
            results = _collect(measurer, total, timeout=600)
            wall = time.perf_counter() - t0
            errors = sum(r.error_kind is not ErrorKind.NONE for r in results)
            for proc in agents:
                farm.stop(proc)
            measurer.close()
            rate = total / wall
            rows.append({"agents": n_agents, "measured": total, "errors": errors, "secs": wall, "per_sec": rate})
            _say(f"  {total} measured in {wall:.2f} s: {rate:.1f}/s ({errors} errors)")
    finally:
        farm.stop(worker)
    one = next((r["per_sec"] for r in rows if r["agents"] == 1), None)
    for r in rows:
        r["scaling"] = r["per_sec"] / (one * r["agents"]) if one else None
    return rows


def _batch_ids(farm: BenchFarm) -> set[int]:
    from services.db import synthetic_load
    from services.db.session import transaction

    with transaction(farm.sessions) as s:
        return synthetic_load.batch_ids(s, farm.job_id)


def _wait_states(farm: BenchFarm, ids: list[int], states: set, timeout: float) -> None:
    from services.db import synthetic_load
    from services.db.session import transaction

    deadline = time.monotonic() + timeout
    while True:
        with transaction(farm.sessions) as s:
            got = synthetic_load.batch_states(s, ids)
        if all(st in states for st in got):
            return
        if time.monotonic() > deadline:
            raise TimeoutError("batches were not built in time")
        time.sleep(0.1)


# -- 2. dispatch overhead -------------------------------------------------------------------


def _dispatch(farm: BenchFarm, args: argparse.Namespace) -> dict[str, Any]:
    cls = f"dispatch-{farm.uid}"
    farm.device_class(cls)
    name = f"stub-agent-{farm.uid}"
    worker, agent = _start_stand_ins(farm, cls, name)
    try:
        farm.wait_healthy([name])
        measurer = farm.measurer(cls, poll_interval=0.02)
        run = _batch_runner(measurer)
        _say(f"dispatch: stand-in build and run, batches of {DISPATCH_BATCH}")
        run(2)  # warm-up: connections, caches, the first lease
        before = _batch_ids(farm)
        latencies = [run(1) for _ in range(5)]
        phases = _phases(farm, sorted(_batch_ids(farm) - before))
        procs = {"scheduler (this process)": os.getpid(), "lease service": farm.lease_service.pid,
                 "build worker": worker.pid, "agent": agent.pid}  # fmt: skip
        cpu0 = _cpu_by_process(procs)
        pipelined = run(args.dispatch_batches)
        cpu1 = _cpu_by_process(procs)
        n = args.dispatch_batches * DISPATCH_BATCH
        cpu_ms = {k: (cpu1[k] - cpu0[k]) / n * 1e3 for k in cpu0}
        measurer.close()
        if os.environ.get("TUNEFARM_BENCH_SHOW_LOGS"):
            _say(farm.log_tail(agent, 12))
    finally:
        farm.stop(agent)
        farm.stop(worker)
    latency = statistics.median(latencies)
    return {
        "batch": DISPATCH_BATCH,
        "latency_secs_median": latency,
        "latency_ms_per_candidate": latency / DISPATCH_BATCH * 1e3,
        "phases_ms_median": phases,
        "pipelined_batches": args.dispatch_batches,
        "pipelined_secs": pipelined,
        "pipelined_ms_per_candidate": pipelined / (args.dispatch_batches * DISPATCH_BATCH) * 1e3,
        "pipelined_cpu_ms_per_candidate": cpu_ms,
        "cores": os.cpu_count(),
    }


def _start_stand_ins(farm: BenchFarm, cls: str, agent_name: str) -> tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]]:
    """A build worker and an agent for `cls` whose build and run take no time (`stand_ins`)."""
    kernel = farm.root / "kernels" / "stand-in.so"
    kernel.parent.mkdir(parents=True, exist_ok=True)
    kernel.write_bytes(os.urandom(16 * 1024))  # the size of a small built kernel
    code = "import sys; from tunefarm_app.bench.stand_ins import {0}; {0}(sys.argv[1:])"
    worker = farm.start("stub-worker", [sys.executable, "-c", code.format("stand_in_worker"), cls, str(kernel)])
    agent_argv = farm.agent_argv(agent_name, cls)[3:]
    agent = farm.start("stub-agent", [sys.executable, "-c", code.format("stand_in_agent"), *agent_argv])
    return worker, agent


def _batch_runner(measurer) -> Callable[[int], float]:
    """`run(n)`: submit `n` batches of `DISPATCH_BATCH` new candidates at once, collect
    every result; the seconds it took."""
    from tunefarm.measure import MeasureBatch
    from tunefarm.records import TimingConfig
    from tunefarm.target import host_target_dict

    wl = tiny_workload()
    task = measurer.prepare(wl, f"{wl.key}@dispatch", host_target_dict())
    timing = TimingConfig()
    key = 10**7

    def run(n_batches: int) -> float:
        nonlocal key
        t0 = time.perf_counter()
        for b in range(n_batches):
            inputs = distinct_inputs(task.key, key, DISPATCH_BATCH)
            key += DISPATCH_BATCH
            measurer.submit(MeasureBatch(id=f"d{key}:{b}", task=task, inputs=tuple(inputs), timing=timing))
        _collect(measurer, n_batches * DISPATCH_BATCH, timeout=300)
        return time.perf_counter() - t0

    return run


def _cpu_by_process(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of each named process, and of the database and queue servers."""
    return {k: _cpu_secs([pid]) for k, pid in pids.items()} | {"postgres, redis": _cpu_secs(_server_pids())}


def _cpu_secs(pids: Sequence[int]) -> float:
    """User + system CPU seconds of these processes so far (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def _server_pids() -> list[int]:
    """The PostgreSQL and Redis server processes on this machine (their CPU is the
    database's and the queue's share)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/comm"):
        try:
            if stat.read_text().strip().startswith(("postgres", "redis-server")):
                pids.append(int(stat.parent.name))
        except OSError:
            continue
    return pids


def _phases(farm: BenchFarm, batch_ids: list[int]) -> dict[str, float]:
    """Where one batch's time went, from the database's clocks (medians, ms)."""
    from services.db import synthetic_load
    from services.db.session import transaction

    with transaction(farm.sessions) as s:
        rows = synthetic_load.batch_times(s, batch_ids)
    ms = [
        (
            (ready - created).total_seconds() * 1e3,
            (granted - ready).total_seconds() * 1e3,
            (last - granted).total_seconds() * 1e3,
        )
        for created, ready, granted, last in rows
    ]
    names = ("submit_to_built", "built_to_leased", "leased_to_last_result_stored")
    return {n: statistics.median(m[i] for m in ms) for i, n in enumerate(names)} if ms else {}


def bench_signing_env(directory: Path) -> dict[str, str]:
    """A signing key pair of the bench's own: workers sign, agents check, as in a farm."""
    from services.protocol.signing import ensure_key_pair

    private, public = directory / "farm-signing.key", directory / "farm-signing.pub"
    ensure_key_pair(private, public)
    return {"TUNEFARM_SIGNING_KEY_FILE": str(private), "TUNEFARM_AGENT_SIGNING_PUBLIC_KEY": str(public)}


# -- output ---------------------------------------------------------------------------------


def _print(out: dict[str, Any]) -> None:
    if "throughput" in out:
        print("measurements per second (tiny kernels, every batch built beforehand):")
        print(f"  {'agents':>6} {'measured':>8} {'secs':>7} {'per sec':>8} {'vs N x one':>10}")
        for r in out["throughput"]:
            scaling = f"{r['scaling']:.2f}" if r.get("scaling") is not None else "-"
            ok = "" if r["scaling"] is None or r["agents"] == 1 else (" ok" if r["scaling"] >= SCALING_TARGET else " below 0.9")
            print(f"  {r['agents']:>6} {r['measured']:>8} {r['secs']:>7.2f} {r['per_sec']:>8.1f} {scaling:>10}{ok}")
    if "dispatch" in out:
        d = out["dispatch"]
        print(f"dispatch overhead (queue + RPC + database; build and run are stand-ins), batches of {d['batch']}:")
        print(
            f"  one batch at a time: {d['latency_secs_median'] * 1e3:.1f} ms per batch, "
            f"{d['latency_ms_per_candidate']:.3f} ms per candidate (target <= {DISPATCH_TARGET_MS:g} ms)"
        )
        if d["phases_ms_median"]:
            print("    " + ", ".join(f"{k} {v:.1f} ms" for k, v in d["phases_ms_median"].items()))
        print(
            f"  {d['pipelined_batches']} batches at once: {d['pipelined_secs']:.2f} s, "
            f"{d['pipelined_ms_per_candidate']:.3f} ms per candidate on {d['cores']} cores"
        )
        cpu = d["pipelined_cpu_ms_per_candidate"]
        print(f"    CPU per candidate: {sum(cpu.values()):.3f} ms: " + ", ".join(f"{k} {v:.3f}" for k, v in cpu.items()))
