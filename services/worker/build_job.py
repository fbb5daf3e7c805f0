"""A build job as it lies in Redis, and the RQ job class that holds both sides to it.

Whoever reaches the farm's Redis can write jobs into its queues, and RQ's defaults would
run them: a job's data is a pickle (unpickling runs code) naming any importable callable,
and a job may name callbacks to import and call, or webhooks to send. The farm's build
jobs are therefore JSON of one shape,

    ["services.worker.jobs.build_batch", null, [<batch id>], {}]

(RQ's `(function, instance, args, kwargs)`), and every side reads and writes them through
`BuildJob`, which

- loads a job's data, meta and result with JSON only: a pickle is refused, never loaded;
- runs `build_batch(batch_id)` itself for a job of that shape and nothing else: a job
  naming another function, other arguments, callbacks or webhooks is failed with
  `RefusedJob` and a log line before anything is imported or run.

The enqueuer (the scheduler's `FarmMeasurer`) writes jobs with `build_queue`; the worker
(`tunefarm worker`, `services.worker.build_worker`) reads them through it too. Jobs queued
by an older farm (pickled) are refused like forged ones; the scheduler's batch check then
sees their builds failed and enqueues them again, as JSON.
"""

from __future__ import annotations

import logging
from typing import Any, NoReturn

from rq.job import Job
from rq.queue import Queue
from rq.serializers import JSONSerializer

from services.common.queues import BUILD_JOB, build_queue_name
from services.worker.exceptions import RefusedJob

log = logging.getLogger("tunefarm.worker")

SERIALIZER = JSONSerializer
"""How build jobs (data, meta, results) are written to Redis: JSON, never pickle."""


class BuildJob(Job):
    """An RQ job that can only be a build job (module docstring)."""

    def __init__(self, id: str | None = None, connection: Any = None, serializer: Any = None):
        # Whatever serializer a caller passes (RQ passes its worker's), JSON it is.
        super().__init__(id, connection=connection, serializer=SERIALIZER)
        self._refusal: str | None = None  # why the job is not a build job, once known
        self._logged = False

    def restore(self, raw_data: Any) -> None:
        """Read the job from Redis, dropping what RQ would import or call for it."""
        super().restore(raw_data)
        named = [what for what, value in (
            ("a success callback", self._success_callback_name),
            ("a failure callback", self._failure_callback_name),
            ("a stopped callback", self._stopped_callback_name),
            ("webhooks", self.webhooks),
        ) if value]  # fmt: skip
        self._success_callback_name = self._failure_callback_name = self._stopped_callback_name = None
        self._success_callback = self._failure_callback = self._stopped_callback = None
        self.webhooks = []
        self._refusal = f"it names {' and '.join(named)}, which build jobs never have" if named else None

    def _deserialize_data(self) -> None:
        if self._refusal:
            self._refuse()
        try:
            payload = SERIALIZER.loads(self.data)
            self._func_name, self._instance, self._args, self._kwargs = check_payload(payload)
        except ValueError:  # json's errors and UnicodeDecodeError
            self._refusal = "its payload is not JSON (a pickled job: queued by an older farm, or forged)"
            self._refuse()
        except RefusedJob as refused:
            self._refusal = str(refused)
            self._refuse()

    @property
    def batch_id(self) -> int:
        """The batch this job builds; `RefusedJob` unless the job is exactly a build job."""
        if self._refusal:
            self._refuse()
        return int(self.args[0])

    def _execute(self) -> Any:
        from services.worker.jobs import build_batch

        return build_batch(self.batch_id)

    def _refuse(self) -> NoReturn:
        """Fail the job as refused (logged once; a refused job is not tried again)."""
        if not self._logged:
            self._logged = True
            log.error("refused job %s from queue %s: %s; nothing was run", self.id, self.origin, self._refusal)
        self.retries_left = None
        raise RefusedJob(self._refusal)


def check_payload(payload: Any) -> tuple[str, None, list[int], dict[str, Any]]:
    """`payload` as RQ's (function, instance, args, kwargs) when it is a build job's;
    `RefusedJob` naming what is wrong otherwise."""
    if not (isinstance(payload, list) and len(payload) == 4):
        raise RefusedJob("its payload is not [function, instance, args, kwargs]")
    func_name, instance, args, kwargs = payload
    if func_name != BUILD_JOB:
        raise RefusedJob(f"it names {str(func_name)[:200]!r}; build workers run {BUILD_JOB} only")
    if instance is not None or kwargs != {}:
        raise RefusedJob(f"{BUILD_JOB} takes a batch id and nothing else")
    if not (isinstance(args, list) and len(args) == 1 and type(args[0]) is int and args[0] > 0):
        raise RefusedJob(f"{BUILD_JOB} takes one argument, a batch id (a positive integer)")
    return func_name, None, args, {}


def build_queue(connection: Any, device_class: str, prefix: str) -> Queue:
    """The class's build queue, holding `BuildJob`s in JSON (enqueuer and worker alike)."""
    return Queue(build_queue_name(device_class, prefix), connection=connection, job_class=BuildJob, serializer=SERIALIZER)


def fetch_build_job(connection: Any, job_id: str) -> BuildJob:
    """A build job by id, read as JSON (`rq.exceptions.NoSuchJobError` when Redis has none)."""
    return BuildJob.fetch(job_id, connection=connection)


def build_job_status(connection: Any, job_id: str) -> tuple[str | None, str]:
    """A build job's RQ status (None: Redis has no such job, or none it can read) and, for
    a failed one, why. Whoever reaches Redis may have written anything into the job's hash
    (an unknown status, an undecodable result): such a job reads as lost, never as an
    exception in its reader. Raises `redis.RedisError` when Redis is away."""
    from redis import RedisError
    from rq.exceptions import NoSuchJobError
    from rq.job import JobStatus

    try:
        job = fetch_build_job(connection, job_id)
        status = job.get_status(refresh=False)
        if status == JobStatus.FAILED:
            latest = job.latest_result()
            lines = ((latest.exc_string or "") if latest is not None else "").strip().splitlines()
            return str(status.value), str(lines[-1])[:500] if lines else "failed"
    except NoSuchJobError:
        return None, "its build job is gone from Redis"
    except RedisError:
        raise
    except Exception as exc:  # noqa: BLE001 (anything in an untrusted hash)
        return None, f"its build job in Redis is unreadable ({type(exc).__name__})"
    value = status.value if status is not None else None
    return value, f"its build job is {value} and no worker is building it"
