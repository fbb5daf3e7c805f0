"""Whoever reaches Redis cannot run code on a build worker: build jobs are JSON naming
`build_batch` and a batch id, and a build worker (`services.worker.build_job`) refuses
anything else in its queues without importing or running it, and logs it.

Each attack writes into a build queue as someone with Redis access would (a plain RQ
client, or raw Redis commands) and checks that a marker file the payload would create is
not there after the worker has emptied the queue."""

from __future__ import annotations

import logging
import os
import pickle
import uuid
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

rq = pytest.importorskip("rq")

from rq.job import JobStatus  # noqa: E402
from rq.serializers import JSONSerializer  # noqa: E402

from services.common.queues import BUILD_JOB, build_job_id, build_queue_name  # noqa: E402
from services.worker import jobs  # noqa: E402
from services.worker.build_job import BuildJob, build_queue, fetch_build_job  # noqa: E402
from services.worker.build_worker import build_worker  # noqa: E402
from services.worker.settings import WorkerSettings  # noqa: E402
from tunefarm.measure.builder import Builder  # noqa: E402


class NoBuilds(Builder):
    """A builder no test here reaches (a refused job builds nothing)."""

    def build(self, inputs):
        raise AssertionError("a refused job reached the builder")

    def close(self) -> None:
        pass


class TouchOnUnpickle:
    """A pickle that creates a file when it is loaded: what a forged payload would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def touch_marker(job, connection, *args) -> None:
    """A callback a forged job names (importable as `test_build_jobs.touch_marker`)."""
    Path(job.description).touch()


@dataclass
class Queues:
    redis: object
    prefix: str
    device_class: str

    @property
    def name(self) -> str:
        return build_queue_name(self.device_class, self.prefix)

    def work(self) -> None:
        """Empty the class's build queue in this process, as `tunefarm worker` does."""
        build_worker(self.redis, [self.device_class], self.prefix).work(burst=True, with_scheduler=False)

    def failed_with(self, job_id: str) -> str:
        job = fetch_build_job(self.redis, job_id)
        assert job.get_status(refresh=False) == JobStatus.FAILED
        return job.latest_result().exc_string


@pytest.fixture(scope="module")
def worker_context(database_url, db_sessions, tmp_path_factory):
    settings = WorkerSettings(database_url=database_url, artifact_root=tmp_path_factory.mktemp("artifacts"))
    jobs.configure(settings, builder=NoBuilds(), sessions=db_sessions)
    yield
    jobs.shutdown()


@pytest.fixture
def queues(redis_conn, worker_context) -> Iterator[Queues]:
    prefix = f"tfjobs{uuid.uuid4().hex[:10]}"
    yield Queues(redis_conn, prefix, "cls")
    for key in redis_conn.scan_iter(f"*{prefix}*"):
        redis_conn.delete(key)


def test_os_system_enqueued_with_a_plain_rq_client_is_refused_unrun(queues, tmp_path, caplog):
    marker = tmp_path / "ran"
    job = rq.Queue(queues.name, connection=queues.redis).enqueue("os.system", f"touch {marker}")  # pickle, RQ's default
    with caplog.at_level(logging.ERROR, logger="tunefarm.worker"):
        queues.work()
    assert not marker.exists()
    assert "RefusedJob" in queues.failed_with(job.id) and "not JSON" in queues.failed_with(job.id)
    assert f"refused job {job.id} from queue {queues.name}" in caplog.text


@pytest.mark.parametrize(
    ("func", "args", "kwargs", "why"),
    [
        ("os.system", ["touch {marker}"], {}, "'os.system'"),
        ("subprocess.call", [["touch", "{marker}"]], {}, "'subprocess.call'"),
        (BUILD_JOB, ["touch {marker}"], {}, "one argument, a batch id"),
        (BUILD_JOB, [1, 2], {}, "one argument, a batch id"),
        (BUILD_JOB, [True], {}, "one argument, a batch id"),
        (BUILD_JOB, [1], {"x": 1}, "a batch id and nothing else"),
    ],
)
def test_json_jobs_other_than_a_build_are_refused_unrun(queues, tmp_path, caplog, func, args, kwargs, why):
    marker = tmp_path / "ran"
    args = [a.format(marker=marker) if isinstance(a, str) else a for a in args]
    args = [[x.format(marker=marker) for x in a] if isinstance(a, list) else a for a in args]
    queue = rq.Queue(queues.name, connection=queues.redis, serializer=JSONSerializer)
    job = queue.enqueue(func, *args, **kwargs)
    with caplog.at_level(logging.ERROR, logger="tunefarm.worker"):
        queues.work()
    assert not marker.exists()
    exc = queues.failed_with(job.id)
    assert "RefusedJob" in exc and why in exc, exc
    assert f"refused job {job.id}" in caplog.text


def test_a_build_jobs_payload_swapped_for_a_pickle_is_refused_unrun(queues, tmp_path, caplog):
    marker = tmp_path / "ran"
    job = build_queue(queues.redis, queues.device_class, queues.prefix).enqueue(
        BUILD_JOB, 7, job_id=build_job_id(7, queues.prefix)
    )
    queues.redis.hset(job.key, "data", pickle.dumps((BUILD_JOB, None, (TouchOnUnpickle(marker),), {})))
    with caplog.at_level(logging.ERROR, logger="tunefarm.worker"):
        queues.work()
    assert not marker.exists()
    assert "not JSON" in queues.failed_with(job.id)
    assert f"refused job {job.id}" in caplog.text
    # The scheduler reads the job with the same class: the pickle is not loaded there either.
    assert fetch_build_job(queues.redis, job.id).get_status(refresh=False) == JobStatus.FAILED
    assert not marker.exists()


def test_pickled_meta_and_result_are_never_loaded(queues, tmp_path):
    marker = tmp_path / "ran"
    job = build_queue(queues.redis, queues.device_class, queues.prefix).enqueue(BUILD_JOB, 9)
    queues.redis.hset(job.key, mapping={"meta": pickle.dumps(TouchOnUnpickle(marker)),
                                        "result": pickle.dumps(TouchOnUnpickle(marker))})  # fmt: skip
    fetch_build_job(queues.redis, job.id)
    assert not marker.exists()


@pytest.mark.parametrize("field", ["success_callback_name", "failure_callback_name", "stopped_callback_name"])
def test_a_build_job_naming_a_callback_is_refused_and_the_callback_never_runs(queues, tmp_path, caplog, field):
    marker = tmp_path / "ran"
    job = build_queue(queues.redis, queues.device_class, queues.prefix).enqueue(
        BUILD_JOB, 11, description=str(marker)
    )
    queues.redis.hset(job.key, field, f"{__name__}.touch_marker")
    with caplog.at_level(logging.ERROR, logger="tunefarm.worker"):
        queues.work()
    assert not marker.exists()
    assert "callback, which build jobs never have" in queues.failed_with(job.id)
    assert f"refused job {job.id}" in caplog.text


def test_a_refused_job_is_not_retried(queues, tmp_path):
    marker = tmp_path / "ran"
    queue = rq.Queue(queues.name, connection=queues.redis, serializer=JSONSerializer)
    job = queue.enqueue("os.system", f"touch {marker}", retry=rq.Retry(max=3))
    queues.work()
    assert queues.failed_with(job.id)
    assert not marker.exists() and rq.Queue(queues.name, connection=queues.redis).count == 0


def test_a_build_job_reaches_build_batch(queues):
    """The one job that runs: its batch does not exist, which `build_batch` reports."""
    job = build_queue(queues.redis, queues.device_class, queues.prefix).enqueue(BUILD_JOB, 2**40)
    data = queues.redis.hget(job.key, "data")
    assert JSONSerializer.loads(zlib.decompress(data)) == [BUILD_JOB, None, [2**40], {}]  # in Redis: JSON (zlib'd)
    queues.work()
    exc = queues.failed_with(job.id)
    assert "BatchNotFound" in exc and f"batch {2**40} does not exist" in exc


def test_a_build_job_class_forces_json_whatever_serializer_it_is_given(redis_conn):
    from rq.serializers import DefaultSerializer

    assert BuildJob(connection=redis_conn, serializer=DefaultSerializer).serializer is JSONSerializer


@pytest.mark.parametrize(
    "garbage",
    [{"status": "no-such-status"}, {"status": "failed", "last_heartbeat": "not a time"}],
    ids=["status", "failed-garbage"],
)
def test_a_build_job_whose_hash_holds_garbage_reads_as_lost(queues, garbage):
    """Whoever reaches Redis may write anything into a job's hash: the scheduler reads
    such a job as lost (and builds the batch again), never as an exception."""
    from services.worker.build_job import build_job_status

    job = build_queue(queues.redis, queues.device_class, queues.prefix).enqueue(BUILD_JOB, 11)
    assert build_job_status(queues.redis, job.id)[0] == "queued"
    queues.redis.hset(job.key, mapping=garbage)
    status, why = build_job_status(queues.redis, job.id)
    assert status in (None, "failed"), (status, why)
    assert build_job_status(queues.redis, "tfnothing-build-1") == (None, "its build job is gone from Redis")


def test_a_worker_that_follows_the_database_builds_for_a_class_made_after_it_started(queues, caplog):
    """`tunefarm worker --every-class` (farm up's shared workers): a board's class created
    after the worker started gets its builds (they waited for a worker started by hand)."""
    classes = [queues.device_class]
    job = build_queue(queues.redis, "board-made-later", queues.prefix).enqueue(BUILD_JOB, 2**40)
    started_alone = build_worker(queues.redis, list(classes), queues.prefix)
    started_alone.work(burst=True, with_scheduler=False)
    assert fetch_build_job(queues.redis, job.id).get_status(refresh=False) == JobStatus.QUEUED  # nobody builds it

    worker = build_worker(queues.redis, list(classes), queues.prefix, every_class=lambda: classes)
    worker.follow_secs = 0.0
    classes.append("board-made-later")  # `farm device-class` after the worker started
    with caplog.at_level("INFO"):
        worker.work(burst=True, with_scheduler=False)
    assert "BatchNotFound" in queues.failed_with(job.id)  # it reached build_batch
    assert "building for the new device class board-made-later too" in caplog.text
    assert [q.name for q in worker.queues] == [queues.name, build_queue_name("board-made-later", queues.prefix)]
