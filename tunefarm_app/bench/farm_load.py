"""`tunefarm bench farm-load`: the farm with many agents and jobs at once.

Real pieces: PostgreSQL (a throw-away database), Redis (queues of the bench's own
prefix), the lease service (`python -m services.lease`, its default
settings, as deployed), RQ build workers running the product's `build_batch`, the API
(`tunefarm api`), and one `FarmMeasurer` per job (the scheduler's measurer: batches into
Postgres and RQ, results back from Postgres), driven by this process with each job
keeping the scheduler's fair share of batches in flight.

Stand-ins, at the protocol level: builds take no time (every candidate "builds" into one
16 KB file: `stand_ins.stand_in_worker`), and the agents are simulated (`load_agents`: N
asyncio agents in one process that register, heartbeat, lease, fetch their batches'
files and report a fixed cost per candidate without running anything). What is measured
is the farm around the kernels: leases and results per second, the progress endpoint
`GET /v1/jobs/{id}` (p50, p99) under that load, and that nothing is lost: every
candidate of every batch has exactly one measurement and came back to its job once.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from tunefarm.errors import UsageError
from tunefarm_app.bench import farm_progress
from tunefarm_app.bench.farm import BenchFarm, distinct_inputs, tiny_workload

KERNELS = "stand-in: builds name one 16 KB file, simulated agents report a fixed cost (nothing is compiled or run)"


def add_command(bsub) -> None:
    p = bsub.add_parser(
        "farm-load", help="many simulated agents x many jobs: lease throughput, progress endpoint p50/p99, nothing lost"
    )
    p.add_argument("--agents", type=int, default=200, help="simulated agents (default 200)")
    p.add_argument("--jobs", type=int, default=10, help="jobs measured at the same time (default 10)")
    p.add_argument("--batches-per-job", type=int, default=20, help="batches each job submits (default 20)")
    p.add_argument("--batch-size", type=int, default=8, help="candidates per batch (default 8)")
    p.add_argument("--workers", type=int, default=2, help="RQ build workers (stand-in builds; default 2)")
    p.add_argument("--agent-processes", type=int, default=2, help="processes the simulated agents run in (default 2)")
    p.add_argument("--pollers", type=int, default=20, help="clients polling the jobs' progress (default 20)")
    p.add_argument("--poll-interval", type=float, default=0.5, help="seconds between a poller's requests (default 0.5)")
    p.add_argument("--no-fetch", action="store_true", help="agents do not fetch their batches' files")
    p.add_argument("--timeout", type=float, default=600.0, help="give up after this many seconds of load (default 600)")
    p.add_argument("--json", type=Path, help="write the results as JSON here")


def run_farm_load_bench(args: argparse.Namespace) -> int:
    for flag in ("agents", "jobs", "batches_per_job", "batch_size", "workers", "agent_processes", "pollers"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be at least 1")
    with BenchFarm(lease_env={}) as farm:
        result = _run(farm, args)
    print_result(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0 if result["lost"]["ok"] else 1


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- setting up -----------------------------------------------------------------------------


def _seed_jobs(farm: BenchFarm, class_id: int, n_jobs: int, budget: int) -> tuple[str, list[int]]:
    """A team with a token, a model, `n_jobs` running jobs on the class."""
    from services.db import synthetic_load, teams, tokens
    from services.db.session import transaction

    with transaction(farm.sessions) as s:
        team = teams.ensure_team(s, name=f"load-{farm.uid}")
        token = tokens.issue_team_token(s, team_id=team.id, label="bench farm-load")
        job_ids = synthetic_load.add_model_and_jobs(s, team_id=team.id, device_class_id=class_id, name="load",
                                                    n_jobs=n_jobs, trial_budget=budget, running=True)  # fmt: skip
        return token, job_ids


def _wait_ready(farm: BenchFarm, class_id: int, n_agents: int, queue: str, n_workers: int, procs: list,
                timeout: float = 300.0) -> None:
    """Until the simulated agents have registered and the build workers listen."""
    from rq import Queue, Worker

    from services.db import synthetic_load
    from services.db.session import transaction

    deadline = time.monotonic() + timeout
    while True:
        with transaction(farm.sessions) as s:
            got = synthetic_load.agents_in_class(s, class_id)
        listening = Worker.count(connection=farm.redis, queue=Queue(queue, connection=farm.redis))
        if got >= n_agents and listening >= n_workers:
            return
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{' '.join(map(str, proc.args))[:80]} exited:\n{farm.log_tail(proc)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"after {timeout:.0f} s: {got} of {n_agents} simulated agents registered, "
                               f"{listening} of {n_workers} build workers listening")  # fmt: skip
        time.sleep(0.2)


# -- the load -------------------------------------------------------------------------------


class _Driver:
    """This process's part of the scheduler: each job keeps `in_flight` batches out
    (submitted through its `FarmMeasurer`) until it has submitted `batches` of them, and
    collects its results."""

    def __init__(self, farm: BenchFarm, class_name: str, job_ids: list[int], args: argparse.Namespace, in_flight: int):
        from services.scheduler.farm_measurer import FarmMeasurer
        from tunefarm.target import host_target_dict

        self.args = args
        self.in_flight = in_flight
        wl = tiny_workload()
        self.measurers = [
            FarmMeasurer(farm.sessions, farm.redis, artifact_root=farm.root, job_id=j, device_class=class_name,
                         queue_prefix=farm.prefix, poll_interval=0.02)  # fmt: skip
            for j in job_ids
        ]
        self.tasks = [m.prepare(wl, f"{wl.key}@load", host_target_dict()) for m in self.measurers]
        self.submitted = [0] * len(job_ids)
        self.results: list[list[Any]] = [[] for _ in job_ids]
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.timed_out = False
        self.secs = math.nan

    def total(self) -> int:
        return self.args.batches_per_job * self.args.batch_size

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # reported by the caller
            self.error = exc
        finally:
            self.done.set()

    def _run(self) -> None:
        from tunefarm.measure import MeasureBatch
        from tunefarm.records import TimingConfig

        a = self.args
        size, total, next_key = a.batch_size, self.total(), 0
        t0 = time.perf_counter()
        deadline = time.monotonic() + a.timeout
        while any(len(r) < total for r in self.results):
            for j, (m, task) in enumerate(zip(self.measurers, self.tasks)):
                while self.submitted[j] < a.batches_per_job and m.pending < self.in_flight * size:
                    inputs = distinct_inputs(task.key, next_key, size)
                    next_key += size
                    m.submit(MeasureBatch(id=f"{j}:{self.submitted[j]}", task=task, inputs=tuple(inputs),
                                          timing=TimingConfig()))  # fmt: skip
                    self.submitted[j] += 1
                self.results[j] += m.collect(timeout=0.0)
            if time.monotonic() > deadline:
                self.timed_out = True  # reported with what came back so far
                break
            time.sleep(0.02)
        self.secs = time.perf_counter() - t0

    def close(self) -> None:
        for m in self.measurers:
            m.close()


def _run(farm: BenchFarm, args: argparse.Namespace) -> dict[str, Any]:
    from services.common.queues import build_queue_name
    from services.scheduler.service import fair_share
    from services.scheduler.settings import SchedulerSettings

    class_name = f"load-{farm.uid}"
    class_id = farm.device_class(class_name)
    budget = args.batches_per_job * args.batch_size
    team_token, job_ids = _seed_jobs(farm, class_id, args.jobs, budget)
    # The farm's processes stop with `farm` (BenchFarm.__exit__); the API here.
    api, base = farm_progress.start_api(farm.url, artifact_root=farm.root, timeout=300)
    driver = None
    try:
        workers, agents = _start_processes(farm, class_name, args)
        queue = build_queue_name(class_name, farm.prefix)
        _wait_ready(farm, class_id, args.agents, queue, args.workers, [*agents, *workers])
        in_flight = fair_share(SchedulerSettings().batches_per_agent, args.agents, args.jobs)
        _say(f"{args.agents} simulated agents registered; {args.jobs} jobs x {args.batches_per_job} batches of "
             f"{args.batch_size}, {in_flight} batches in flight per job (the scheduler's fair share)")  # fmt: skip
        driver = _Driver(farm, class_name, job_ids, args, in_flight)
        thread = threading.Thread(target=driver.run, name="load-driver", daemon=True)
        t0 = time.monotonic()
        thread.start()
        urls = [f"{base}/v1/jobs/{j}" for j in job_ids]
        latencies, errors = farm_progress.poll(urls, team_token, pollers=args.pollers, interval=args.poll_interval,
                                               duration=args.timeout, warmup=1.0, until=driver.done)  # fmt: skip
        poll_secs = max(1e-9, time.monotonic() - t0 - 1.0)
        thread.join()
        if driver.error is not None:
            raise driver.error
        counts: Counter[str] = Counter()
        for proc in agents:
            farm.stop(proc)  # SIGTERM: it prints its counts
            counts.update(_agent_counts(proc))
        progress = farm_progress.stats_of(latencies, errors, measurements=budget * args.jobs, pollers=args.pollers,
                                          interval=args.poll_interval, duration=poll_secs)  # fmt: skip
        return {
            "agents": args.agents, "jobs": args.jobs, "batches_per_job": args.batches_per_job,
            "batch_size": args.batch_size, "in_flight_per_job": in_flight, "build_workers": args.workers,
            "fetch": not args.no_fetch, "kernels": KERNELS, "cores": os.cpu_count(),
            "secs": driver.secs, "timed_out": driver.timed_out, **_throughput(farm, job_ids, driver.secs),
            "agent_processes": len(agents), "agent_counts": dict(counts), "progress": progress.__dict__,
            "lost": _lost(farm, job_ids, driver),
        }  # fmt: skip
    finally:
        if driver is not None:
            driver.close()
        api.terminate()
        api.wait(timeout=30)


def _start_processes(farm: BenchFarm, class_name: str, args: argparse.Namespace) -> tuple[list, list]:
    """The stand-in build workers (`stand_ins.stand_in_worker`) and the processes of the
    simulated agents (`load_agents`), the agents shared out among them."""
    kernel = farm.root / "kernels" / "stand-in.so"
    kernel.parent.mkdir(parents=True, exist_ok=True)
    kernel.write_bytes(os.urandom(16 * 1024))
    code = "import sys; from tunefarm_app.bench.stand_ins import stand_in_worker; stand_in_worker(sys.argv[1:])"
    workers = [farm.start(f"stand-in-worker-{i}", [sys.executable, "-c", code, class_name, str(kernel)])
               for i in range(args.workers)]  # fmt: skip
    shares = [len(range(i, args.agents, args.agent_processes)) for i in range(args.agent_processes)]
    agents = [farm.start(f"load-agents-{i}", [
        sys.executable, "-m", "tunefarm_app.bench.load_agents", "--server", f"127.0.0.1:{farm.port}",
        "--device-class", class_name, "--agents", str(n), "--name-prefix", f"load-{farm.uid}-{i}",
        *(["--no-fetch"] if args.no_fetch else []),
    ]) for i, n in enumerate(shares) if n]  # fmt: skip
    return workers, agents


def _agent_counts(proc) -> dict[str, int]:
    lines = [line for line in Path(proc.log_path).read_text(errors="replace").splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def _throughput(farm: BenchFarm, job_ids: list[int], secs: float) -> dict[str, Any]:
    """Leases and results per second over the load, from the database."""
    from services.db import synthetic_load
    from services.db.session import transaction
    from services.db.states import LeaseState

    with transaction(farm.sessions) as s:
        leases = Counter(synthetic_load.lease_states(s, job_ids))
        results = synthetic_load.measurement_count(s, job_ids)
    n_leases = sum(leases.values())
    return {
        "leases": n_leases, "leases_expired": leases.get(LeaseState.EXPIRED, 0), "leases_per_sec": n_leases / secs,
        "results": results, "results_per_sec": results / secs,
    }  # fmt: skip


def _lost(farm: BenchFarm, job_ids: list[int], driver: _Driver) -> dict[str, Any]:
    """Every candidate of every batch measured exactly once; each job got each of its
    results back once, none an error."""
    from services.db import synthetic_load
    from services.db.session import transaction
    from tunefarm.records import ErrorKind

    with transaction(farm.sessions) as s:
        per_candidate = Counter(synthetic_load.measurements_per_candidate(s, job_ids))
        not_done = synthetic_load.batches_not_done(s, job_ids)
    submitted = driver.total() * len(job_ids)
    returned = [r for rs in driver.results for r in rs]
    keys = Counter((j, r.key) for j, rs in enumerate(driver.results) for r in rs)
    out = {
        "candidates": sum(per_candidate.values()),
        "measured_once": per_candidate.get(1, 0),
        "unmeasured": per_candidate.get(0, 0),
        "measured_more_than_once": sum(n for k, n in per_candidate.items() if k > 1),
        "batches_not_done": not_done,
        "results_returned": len(returned),
        "results_returned_twice": sum(1 for n in keys.values() if n > 1),
        "error_results": sum(r.error_kind is not ErrorKind.NONE for r in returned),
    }
    out["ok"] = (
        not driver.timed_out
        and out["candidates"] == out["measured_once"] == submitted == len(keys) == out["results_returned"]
        and out["batches_not_done"] == 0
        and out["error_results"] == 0
    )
    return out


# -- output ---------------------------------------------------------------------------------


def print_result(r: dict[str, Any]) -> None:
    p = r["progress"]
    c = r["agent_counts"]
    lost = r["lost"]
    print(f"farm under load: {r['agents']} simulated agents x {r['jobs']} jobs, {r['batches_per_job']} batches of "
          f"{r['batch_size']} per job ({r['in_flight_per_job']} in flight per job), {r['build_workers']} build workers, "
          f"{r['cores']} cores")  # fmt: skip
    print(f"  kernels: {r['kernels']}; agents fetch files: {'yes' if r['fetch'] else 'no'}; "
          f"agents in {r['agent_processes']} processes")
    if r["timed_out"]:
        print(f"  TIMED OUT after {r['secs']:.0f} s (--timeout): {lost['results_returned']} of "
              f"{r['jobs'] * r['batches_per_job'] * r['batch_size']} results back; the figures are up to then")
    print(f"  {lost['candidates']} candidates submitted, measured over {r['secs']:.1f} s")
    print(f"  leases:  {r['leases']} ({r['leases_per_sec']:.1f}/s), {r['leases_expired']} expired and leased again")
    print(f"  results: {r['results']} ({r['results_per_sec']:.1f}/s)")
    if c:
        print(f"  agents:  {c.get('registered', 0)} registered, {c.get('empty_polls', 0)} empty lease polls, "
              f"{c.get('heartbeats', 0)} heartbeats, {c.get('lost_leases', 0)} leases lost, "
              f"{c.get('rpc_errors', 0)} RPC errors, {c.get('fetched_bytes', 0) / 1e6:.1f} MB fetched")  # fmt: skip
    print(f"  progress endpoint GET /v1/jobs/{{id}}, {p['pollers']} pollers every {p['interval']:g} s during the load: "
          f"{p['requests']} requests, p50 {p['p50'] * 1e3:.1f} ms, p99 {p['p99'] * 1e3:.1f} ms, "
          f"max {p['max'] * 1e3:.1f} ms, {p['errors']} errors")  # fmt: skip
    print(f"  nothing lost: {'yes' if lost['ok'] else 'NO'} ({lost['measured_once']} of {lost['candidates']} candidates "
          f"measured exactly once, {lost['unmeasured']} unmeasured, {lost['measured_more_than_once']} more than once, "
          f"{lost['batches_not_done']} batches not done; {lost['results_returned']} results back to their jobs, "
          f"{lost['results_returned_twice']} twice, {lost['error_results']} errors)")  # fmt: skip
