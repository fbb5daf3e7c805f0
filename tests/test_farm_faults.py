"""The farm under faults: every process on loopback (`farm up`: api, lease service,
scheduler, two RQ build workers, two CPU agents) on a PostgreSQL cluster and a Redis of
the tests' own (`private_services`; the machine's shared servers are never touched), a
tiny ONNX model, and in each test one job (two in the last) that must finish with every
candidate measured exactly once while something breaks in the middle of it:

- Redis killed and started again empty (no persistence): the batches it lost are
  enqueued again from PostgreSQL;
- Redis killed while a worker builds, and started again only once the worker finished
  the build and waits for it: the worker records the job and goes on (the same process);
- PostgreSQL restarted (an immediate shutdown: every connection dropped): every
  process rides it out;
- the build worker building a batch killed (SIGKILL): another worker builds it;
- the lease service killed (SIGKILL) and started again: agents reconnect, their leases
  complete or expire and are leased again;
- two jobs on one class with two agents: both progress, neither waits for the other.

The tests share one farm and run in order; the last checks no process died on the way.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("grpc")
pytest.importorskip("rq")

import httpx  # noqa: E402
from farm_fixtures import (  # noqa: E402
    assert_measured_exactly_once,
    measured,
    running_farm,
    service_unavailable,
    team_client,
    wait_for_job,
)
from onnx_models import tiny_onnx  # noqa: E402
from private_services import PrivatePostgres, PrivateRedis, ServiceMissing, private_directory  # noqa: E402
from sqlalchemy import select  # noqa: E402

from services.db.models import Batch, Lease, Measurement  # noqa: E402
from services.db.session import make_session_factory, transaction  # noqa: E402
from services.db.states import BatchState, LeaseState  # noqa: E402
from tunefarm_app.farm_local import LocalFarm  # noqa: E402

pytestmark = pytest.mark.slow

TRIALS = 16  # 4 tasks, batches of 4: four batches per job (Winograd alternatives off: start_job)
JOB_TIMEOUT = 600.0  # a guard: an idle machine takes a small part of it
POLL_SECS = 0.05


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    try:
        postgres = PrivatePostgres(private_directory("tunefarm-faults-pg-"))
        redis = PrivateRedis(tmp_path_factory.mktemp("redis"))
    except ServiceMissing as exc:
        service_unavailable(f"the fault tests need their own servers: {exc}")
    postgres.init()
    postgres.start()
    redis.start()
    try:
        yield postgres, redis
    finally:
        redis.kill()
        postgres.remove()


@pytest.fixture(scope="module")
def farm(servers, tmp_path_factory):
    postgres, redis = servers
    with running_farm(
        redis_url=redis.url,
        state_dir=tmp_path_factory.mktemp("farm"),
        database_url=postgres.url,
        workers=2,
        agents=2,
        extra_env={
            "TUNEFARM_POLL_INTERVAL_SECS": "0.1",
            "TUNEFARM_BUILD_CHECK_SECS": "1",  # builds nobody is doing are noticed within a second
            "TUNEFARM_BUILD_PROCESSES": "1",
            # One batch in flight per agent (two for a job alone, one each for two jobs):
            # later batches are proposed after the first results, so faults hit mid-job.
            "TUNEFARM_BATCHES_PER_AGENT": "1",
            "TUNEFARM_CHECK_TUNED_MODEL": "false",  # the e2e tests check tuned models
            "TUNEFARM_HEARTBEAT_INTERVAL_SECS": "1",
            "TUNEFARM_LEASE_SECS": "6",
            "TUNEFARM_SWEEP_INTERVAL_SECS": "0.5",
            "TUNEFARM_AGENT_RECONNECT_MAX_SECS": "1",
            "TUNEFARM_COST_MODEL_WARMUP": "8",
        },
    ) as running:
        yield running


@pytest.fixture(scope="module")
def sessions(farm: LocalFarm):
    factory = make_session_factory(farm.config.database_url)
    yield factory
    factory.kw["bind"].dispose()


@pytest.fixture(scope="module")
def client(farm: LocalFarm):
    with team_client(farm) as c:
        yield c


@pytest.fixture(scope="module")
def model_id(client, tmp_path_factory) -> int:
    tiny = tiny_onnx(tmp_path_factory.mktemp("model") / "tiny.onnx")
    return client.upload_model(tiny, {"x": [1, 3, 8, 8]})["id"]


def start_job(farm: LocalFarm, client, model_id: int, seed: int, trials: int = TRIALS) -> int:
    """A job on the model's own tasks: what breaks here is the farm, not the search, and
    Winograd alternatives (tuned through the farm in test_farm_e2e) would make each job
    twice the batches, some of them slow to build."""
    return client.create_job(model_id=model_id, device_class=farm.info["device_class"], trial_budget=trials, seed=seed,
                             winograd=False)["id"]  # fmt: skip


def until(what: str, check, timeout: float = JOB_TIMEOUT):
    """Poll `check()` until it returns something true; that value."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(POLL_SECS)


def batch_in(sessions, job_id: int, *states: BatchState) -> int | None:
    with transaction(sessions) as s:
        return s.scalar(
            select(Batch.id).where(Batch.job_id == job_id, Batch.state.in_(states)).order_by(Batch.id).limit(1)
        )


def log_of(farm: LocalFarm, name: str) -> str:
    return Path(farm.processes[name].log).read_text(errors="replace")


def workers_of(farm: LocalFarm) -> list[str]:
    return [name for name in farm.processes if name.startswith("worker-")]


def signal_workers(farm: LocalFarm, sig: int) -> None:
    for name in workers_of(farm):
        os.killpg(farm.processes[name].pid, sig)


def test_redis_restarted_with_its_data_lost(farm, servers, client, model_id, sessions):
    _, redis = servers
    job_id = start_job(farm, client, model_id, seed=1)
    until("the first results", lambda: measured(sessions, job_id))
    import redis as redis_client
    from rq.job import Job

    from services.common.queues import build_job_id

    def queued() -> int | None:  # the batch is stored first, its build job enqueued next
        batch_id = batch_in(sessions, job_id, BatchState.PROPOSED)
        if batch_id is None:
            return None
        with redis_client.Redis.from_url(redis.url) as conn:
            return batch_id if Job.exists(build_job_id(batch_id, farm.config.queue_prefix), connection=conn) else None

    # The workers are frozen, so the next batch's build job certainly waits in Redis...
    signal_workers(farm, signal.SIGSTOP)
    try:
        waiting = until("a batch whose build job waits in Redis", queued)
        redis.kill()  # ...and is lost with every queue and worker registration
        redis.start()
    finally:
        signal_workers(farm, signal.SIGCONT)  # they find their connections to Redis broken
    job = wait_for_job(client, job_id, timeout=JOB_TIMEOUT)
    assert_measured_exactly_once(sessions, job)
    assert f"the build of batch {waiting} was lost: its build job is gone from Redis" in log_of(farm, "scheduler")


def test_redis_restarted_while_a_worker_builds(farm, servers, client, model_id, sessions):
    """A worker busy building when Redis goes away finishes the build, waits for Redis
    (RQ writes the job's heartbeat and result then: with redis-py's few retries the
    worker quit on them, "found an unhandled exception"), and serves its queue again once
    Redis is back: the same process, every candidate measured once."""
    _, redis = servers
    pids = {name: farm.processes[name].pid for name in workers_of(farm)}
    job_id = start_job(farm, client, model_id, seed=7)

    def frozen_mid_build() -> int | None:
        """A batch being built while the workers are frozen (SIGSTOP: they stay mid-build)."""
        if batch_in(sessions, job_id, BatchState.BUILDING) is None:
            return None
        signal_workers(farm, signal.SIGSTOP)
        batch_id = batch_in(sessions, job_id, BatchState.BUILDING)
        if batch_id is None:  # stored before the workers stopped
            signal_workers(farm, signal.SIGCONT)
        return batch_id

    batch_id = until("a batch being built", frozen_mid_build)
    redis.kill()
    signal_workers(farm, signal.SIGCONT)
    built = re.compile(rf"batch {batch_id}: \d+ built")

    def after_the_build(name: str) -> str:
        """What the worker `name` logged after it built the batch ("" before)."""
        text = log_of(farm, name)
        found = built.search(text)
        return text[found.end() :] if found else ""

    def builder_waiting() -> str | None:
        """The worker that built the batch, once it waits for Redis (or has exited)."""
        for name in workers_of(farm):
            if after_the_build(name) and ("does not answer" in after_the_build(name) or not farm.alive(name)):
                return name
        return None

    try:
        builder = until("the build to end while Redis is away", builder_waiting)
    finally:
        redis.start()
    job = wait_for_job(client, job_id, timeout=JOB_TIMEOUT)
    assert_measured_exactly_once(sessions, job)
    until("the worker to find Redis again", lambda: "answers again" in after_the_build(builder) or not farm.alive(builder))
    assert farm.alive(builder), log_of(farm, builder)[-3000:]
    assert {name: farm.processes[name].pid for name in workers_of(farm)} == pids  # none was started again


def test_postgres_restarted(farm, servers, client, model_id, sessions):
    postgres, _ = servers
    job_id = start_job(farm, client, model_id, seed=2)
    until("the first results", lambda: measured(sessions, job_id))
    before = log_of(farm, "scheduler").count("database trouble")
    postgres.stop()
    try:
        until("the scheduler to notice", lambda: log_of(farm, "scheduler").count("database trouble") > before)
        # Meanwhile the API answers, with 503 and a JSON body.
        with httpx.Client(headers={"authorization": f"Bearer {farm.info['team_token']}"}, timeout=10) as http:
            response = http.get(f"{farm.info['api_url']}/v1/jobs/{job_id}")
        assert response.status_code == 503 and response.json()["error"]
    finally:
        postgres.start()
    job = wait_for_job(client, job_id, timeout=JOB_TIMEOUT)
    assert_measured_exactly_once(sessions, job)


def test_a_build_worker_killed_mid_build(farm, servers, client, model_id, sessions):
    from rq.job import Job

    from services.common.queues import build_job_id

    _, redis = servers
    workers = {farm.worker_name(name): name for name in workers_of(farm)}
    job_id = start_job(farm, client, model_id, seed=3)

    def building() -> tuple[int, str] | None:
        batch_id = batch_in(sessions, job_id, BatchState.BUILDING)
        if batch_id is None:
            return None
        import redis as redis_client

        with redis_client.Redis.from_url(redis.url) as conn:
            worker = Job.fetch(build_job_id(batch_id, farm.config.queue_prefix), connection=conn).worker_name
        return (batch_id, workers[worker]) if worker in workers else None

    batch_id, worker = until("a batch being built", building)
    farm.stop(worker, sig=signal.SIGKILL)  # the worker and its build processes
    job = wait_for_job(client, job_id, timeout=JOB_TIMEOUT)
    assert_measured_exactly_once(sessions, job)
    assert f"the build of batch {batch_id} was lost" in log_of(farm, "scheduler")
    farm.start(worker)  # under a name of its own: RQ still has the dead worker's


def test_the_lease_service_killed_and_restarted(farm, client, model_id, sessions):
    job_id = start_job(farm, client, model_id, seed=4)

    def leased() -> int | None:
        with transaction(sessions) as s:
            return s.scalar(
                select(Lease.id).join(Batch, Batch.id == Lease.batch_id)
                .where(Batch.job_id == job_id, Lease.state == LeaseState.ACTIVE).limit(1)
            )  # fmt: skip

    lease_id = until("a batch being measured", leased)
    farm.stop("lease-service", sig=signal.SIGKILL)
    farm.start("lease-service")
    job = wait_for_job(client, job_id, timeout=JOB_TIMEOUT)
    assert_measured_exactly_once(sessions, job)
    with transaction(sessions) as s:
        assert s.get(Lease, lease_id).state in (LeaseState.FINISHED, LeaseState.EXPIRED)


def test_two_jobs_share_the_agents_fairly(farm, client, model_id, sessions):
    trials = TRIALS  # four batches each, one of each job in flight at a time
    jobs = [start_job(farm, client, model_id, seed=seed, trials=trials) for seed in (5, 6)]
    done = [wait_for_job(client, job_id, timeout=JOB_TIMEOUT) for job_id in jobs]
    for job in done:
        assert_measured_exactly_once(sessions, job, trials)
    with transaction(sessions) as s:
        leases = [job for job, in s.execute(
            select(Batch.job_id).join(Lease, Lease.batch_id == Batch.id)
            .where(Batch.job_id.in_(jobs)).order_by(Lease.granted_at, Lease.id)
        )]  # fmt: skip
        stored = s.execute(
            select(Measurement.job_id, Measurement.created_at).where(Measurement.job_id.in_(jobs))
            .order_by(Measurement.created_at, Measurement.id)
        ).all()  # fmt: skip
    # Until the first job got its last batch, both jobs got leases, interleaved: neither
    # waited for the other to end. (How evenly depends on when each job's scheduler has its
    # next batch ready, which a loaded machine changes; the lease queue's turns are checked
    # exactly in test_fair_share.)
    first_done = min(max(i for i, job in enumerate(leases) if job == j) for j in jobs)
    while_both = Counter(leases[: first_done + 1])
    assert min(while_both[j] for j in jobs) >= 2, leases
    switches = sum(a != b for a, b in zip(leases, leases[1:]))
    assert switches >= 3, leases
    # When the first job had all its measurements, the other had at least a batch of its own.
    seen: Counter[int] = Counter()
    for job_id, _ in stored:
        seen[job_id] += 1
        if seen[job_id] == trials:
            break
    assert min(seen[j] for j in jobs) >= trials // 4, seen


def test_every_process_survived(farm):
    dead = [name for name in farm.processes if not farm.alive(name)]
    assert not dead, {name: log_of(farm, name)[-2000:] for name in dead}
