"""`tunefarm bench farm`, the progress endpoint: latency of `GET /v1/jobs/{id}` under
many concurrent pollers, on a job with many measurements.

The job is made up directly in a throw-away database (`seed_job`): a model of `tasks`
tasks, a job with `measurements` measurements in batches of 64 (bulk inserted), their
per-task progress and a curve, as the farm's services would have left them. The API
runs in its own process (uvicorn, one worker, as `tunefarm api` runs it) on loopback;
`pollers` threads poll the job, each once every `interval` seconds (a dashboard or
`tunefarm status --follow` polls every few seconds; 0 polls back to back), for
`duration` seconds after a warm-up. Reported: requests, throughput, p50, p90, p99 and
max latency, for each measurement count (the latency must not grow with it: the
endpoint reads precomputed rows only).
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BATCH = 64
"""Candidates per synthetic batch."""

TARGET_P99_SECS = 0.020
"""The issue's target for the progress endpoint's p99 under 50 concurrent pollers."""


@dataclass(frozen=True)
class SeededJob:
    job_id: int
    team_token: str
    measurements: int


def seed_job(sessions, *, measurements: int, tasks: int = 8, curve_points: int = 60, team_token: str | None = None) -> SeededJob:
    """A team, a model with `tasks` tasks and a running job with `measurements`
    measurements and its precomputed progress, inserted in bulk."""
    from services.db import device_classes, synthetic_load, teams, tokens
    from services.db.session import transaction

    uid = uuid.uuid4().hex[:10]
    with transaction(sessions) as s:
        team = teams.ensure_team(s, name=f"bench-{uid}")
        token = team_token or tokens.issue_team_token(s, team_id=team.id)
        dc = device_classes.ensure_device_class(s, name=f"bench-class-{uid}", target={"kind": "llvm", "num-cores": 2})
        job = synthetic_load.add_job_with_tasks(s, uid=uid, team_id=team.id, device_class_id=dc.id, tasks=tasks,
                                                trial_budget=max(1, measurements), batch_size=BATCH)  # fmt: skip
    best = [math.inf] * tasks
    made = 0
    while made < measurements:
        i = (made // BATCH) % tasks
        n = min(BATCH, measurements - made)
        with transaction(sessions) as s:
            best[i] = min(best[i], *synthetic_load.add_done_batch(s, job, i, made, n))
        made += n
    with transaction(sessions) as s:
        synthetic_load.set_job_totals(s, job, best, measurements, curve_points)
    return SeededJob(job.job_id, token, measurements)


# -- the load ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PollStats:
    measurements: int
    pollers: int
    interval: float
    requests: int
    errors: int
    throughput: float  # requests per second
    p50: float
    p90: float
    p99: float
    max: float

    def row(self) -> str:
        ms = 1e3
        return (f"{self.measurements:>12,} {self.pollers:>7} {self.interval:>8.2f} {self.requests:>8} "
                f"{self.throughput:>8.0f} {self.p50 * ms:>7.2f} {self.p90 * ms:>7.2f} {self.p99 * ms:>7.2f} "
                f"{self.max * ms:>7.2f} {self.errors:>6}")


HEADER = (f"{'measurements':>12} {'pollers':>7} {'interval':>8} {'requests':>8} {'req/s':>8} "
          f"{'p50 ms':>7} {'p90 ms':>7} {'p99 ms':>7} {'max ms':>7} {'errors':>6}")


def poll(url: str | Sequence[str], token: str, *, pollers: int, interval: float, duration: float,
         warmup: float = 2.0, until: threading.Event | None = None) -> tuple[list[float], int]:
    """Latencies of GET `url` from `pollers` threads (keep-alive connections), each
    polling every `interval` seconds, measured for `duration` seconds after `warmup`, or
    until `until` is set. Several URLs: poller i polls the i-th (round robin)."""
    urls = [url] if isinstance(url, str) else list(url)
    import httpx

    latencies: list[float] = []
    errors = 0
    lock = threading.Lock()
    start = time.monotonic()
    t_measure, t_end = start + warmup, start + warmup + duration
    barrier = threading.Barrier(pollers)

    def worker(index: int) -> None:
        nonlocal errors
        mine: list[float] = []
        bad = 0
        with httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=30) as client:
            barrier.wait()
            next_at = time.monotonic() + (interval * index / pollers if interval else 0.0)  # spread the phases
            while True:
                now = time.monotonic()
                if now >= t_end or (until is not None and until.is_set()):
                    break
                if next_at > now:
                    time.sleep(next_at - now)
                t0 = time.perf_counter()
                try:
                    ok = client.get(urls[index % len(urls)]).status_code == 200
                except httpx.HTTPError:
                    ok = False
                dt = time.perf_counter() - t0
                if time.monotonic() >= t_measure:
                    mine.append(dt)
                    bad += not ok
                next_at += interval
        with lock:
            latencies.extend(mine)
            errors += bad

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(pollers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return latencies, errors


def stats_of(latencies: Sequence[float], errors: int, *, measurements: int, pollers: int, interval: float,
             duration: float) -> PollStats:
    import numpy as np

    arr = np.asarray(latencies) if latencies else np.asarray([math.nan])
    return PollStats(measurements, pollers, interval, len(latencies), errors, len(latencies) / duration,
                     float(np.percentile(arr, 50)), float(np.percentile(arr, 90)), float(np.percentile(arr, 99)),
                     float(arr.max()))


# -- the benchmark -------------------------------------------------------------------------------


def run_progress_bench(
    *,
    measurement_counts: Sequence[int] = (1_000, 100_000),
    pollers: int = 50,
    intervals: Sequence[float] = (1.0, 0.0),
    duration: float = 10.0,
    api_workers: int = 1,
    database_server: str | None = None,
    log=print,
) -> dict[str, Any]:
    """Seed a job per measurement count in a throw-away database, serve the API, poll.
    Returns {"rows": [PollStats as dicts], "target_p99_secs": ...}."""
    from services.db.database_admin import with_database
    from services.db.migrate import create_database, drop_database, upgrade
    from services.db.session import make_session_factory
    from services.db.settings import DatabaseSettings

    url = with_database(database_server or DatabaseSettings().database_url, f"tunefarm_bench_{uuid.uuid4().hex[:12]}")
    create_database(url)
    rows: list[PollStats] = []
    api = None
    try:
        upgrade(url)
        sessions = make_session_factory(url)
        seeded = []
        token = None
        for n in measurement_counts:
            t0 = time.perf_counter()
            job = seed_job(sessions, measurements=n)
            token = token or job.team_token
            seeded.append(job)
            log(f"seeded job {job.job_id} with {n:,} measurements in {time.perf_counter() - t0:.1f} s")
        sessions.kw["bind"].dispose()
        api, base = start_api(url, workers=api_workers)
        log(f"api at {base} ({api_workers} uvicorn worker{'s' if api_workers > 1 else ''}); {pollers} pollers")
        log(HEADER)
        for job in seeded:
            for interval in intervals:
                # every seeded job belongs to its own team: poll with its token
                lat, errors = poll(f"{base}/v1/jobs/{job.job_id}", job.team_token, pollers=pollers, interval=interval,
                                   duration=duration)
                st = stats_of(lat, errors, measurements=job.measurements, pollers=pollers, interval=interval,
                              duration=duration)
                rows.append(st)
                log(st.row())
    finally:
        if api is not None:
            api.terminate()
            try:
                api.wait(timeout=10)
            except subprocess.TimeoutExpired:
                api.kill()
        drop_database(url)
    return {"rows": [r.__dict__ for r in rows], "target_p99_secs": TARGET_P99_SECS, "api_workers": api_workers}


def start_api(
    database_url: str, *, workers: int = 1, artifact_root: Path | None = None, port: int | None = None,
    timeout: float = 60.0,
) -> tuple[subprocess.Popen, str]:
    """`tunefarm api` in a child process on loopback (`port`, default a free one); returns
    it and its URL once it answers (within `timeout` seconds)."""
    import tempfile
    import urllib.request

    if port is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    root = artifact_root or Path(tempfile.mkdtemp(prefix="tunefarm-bench-api-"))
    env = {**os.environ, "TUNEFARM_DATABASE_URL": database_url, "TUNEFARM_API_BIND": f"127.0.0.1:{port}",
           "TUNEFARM_ARTIFACT_ROOT": str(root), "TUNEFARM_API_WORKERS": str(workers)}
    proc = subprocess.Popen([sys.executable, "-m", "tunefarm_app.cli", "api"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(base + "/healthz", timeout=1) as r:
                if r.status == 200:
                    return proc, base
        except Exception:
            time.sleep(0.2)
        if proc.poll() is not None:
            raise RuntimeError("the API exited during start-up")
    proc.kill()
    raise RuntimeError(f"the API did not come up within {timeout:.0f} s")


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m tunefarm_app.bench.farm_progress")
    p.add_argument("--measurements", default="1000,100000", help="comma-separated measurement counts")
    p.add_argument("--pollers", type=int, default=50)
    p.add_argument("--intervals", default="1,0", help="seconds between a poller's requests (0: back to back)")
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--api-workers", type=int, default=1)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    result = run_progress_bench(
        measurement_counts=[int(x) for x in a.measurements.split(",")],
        pollers=a.pollers,
        intervals=[float(x) for x in a.intervals.split(",")],
        duration=a.duration,
        api_workers=a.api_workers,
    )
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


# -- `tunefarm bench farm` ------------------------------------------------------------------------


def add_arguments(parser) -> None:
    """The progress part's flags of `tunefarm bench farm`."""
    parser.add_argument("--skip-progress", action="store_true", help="skip the progress endpoint's latency")
    parser.add_argument("--progress-measurements", default="1000,100000",
                        help="measurements of the polled jobs (comma-separated; default 1000,100000)")
    parser.add_argument("--pollers", type=int, default=50, help="concurrent pollers of the progress endpoint (default 50)")
    parser.add_argument("--poll-intervals", default="1,0",
                        help="seconds between a poller's requests, comma-separated (0: back to back; default 1,0)")
    parser.add_argument("--progress-secs", type=float, default=10.0, help="seconds measured per setting (default 10)")


def from_args(args, log=lambda msg: print(msg, file=sys.stderr, flush=True)) -> dict[str, Any]:
    return run_progress_bench(
        measurement_counts=[int(x) for x in str(args.progress_measurements).split(",") if x.strip()],
        pollers=args.pollers,
        intervals=[float(x) for x in str(args.poll_intervals).split(",") if x.strip()],
        duration=args.progress_secs,
        log=log,
    )


def print_table(result: dict[str, Any]) -> None:
    rows = [PollStats(**r) for r in result["rows"]]
    target = result["target_p99_secs"] * 1e3
    workers = result.get("api_workers", 1)
    print(f"progress endpoint GET /v1/jobs/{{id}} ({workers} uvicorn worker(s); p99 target <= {target:g} ms at 50 pollers):")
    print("  " + HEADER)
    for r in rows:
        print("  " + r.row())
