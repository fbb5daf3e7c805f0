"""The build worker: an RQ `SimpleWorker` on the build queues of device classes that runs
`BuildJob`s only (`services.worker.build_job`) and rides out a Redis restart.

Its connection is its own, with a pool whose commands wait for a Redis that went away
(`services.worker.redis_wait`): a worker busy building when Redis restarts finishes the
build, waits for Redis, records the job and goes on serving its queues, in the same
process with its warm build processes. A Redis that lost its data also lost the worker's
registration; the first heartbeat after Redis came back registers it again (RQ does so
for workers that fork, not for a SimpleWorker), so `rq info` and `Worker.all` see it.
See `services.worker.jobs` for why a SimpleWorker.
"""

from __future__ import annotations

from typing import Any

from redis import Redis
from rq import SimpleWorker, worker_registration

from services.worker.build_job import SERIALIZER, BuildJob, build_queue
from services.worker.redis_wait import WaitForRedis, address_of, log, waiting_client


class BuildWorker(SimpleWorker):
    """A SimpleWorker on `device_classes`' build queues (module docstring)."""

    def __init__(self, connection: Redis, device_classes: list[str], prefix: str, *, name: str | None = None):
        self.redis_wait = WaitForRedis(stopping=self.stopping, address=address_of(connection))
        own = waiting_client(connection, self.redis_wait)
        queues = [build_queue(own, c, prefix) for c in device_classes]
        super().__init__(queues, connection=own, name=name, job_class=BuildJob, serializer=SERIALIZER)

    def stopping(self) -> bool:
        """Whether the worker was asked to stop (SIGTERM or SIGINT: RQ's warm shutdown)."""
        return getattr(self, "_shutdown_requested_date", None) is not None

    def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
        super().heartbeat(timeout, pipeline)
        if pipeline is None and self.birth_date is not None and self.redis_wait.came_back():
            self._register_again_if_forgotten()

    def _register_again_if_forgotten(self) -> None:
        if self.connection.hexists(self.key, "birth"):
            return
        with self.connection.pipeline() as pipeline:
            pipeline.hset(self.key, mapping=self.serialize())
            pipeline.expire(self.key, self.worker_ttl + 60)
            worker_registration.register(self, pipeline)
            pipeline.execute()
        log.info("Redis had lost this worker's registration (restarted without its data): registered again")


def build_worker(connection: Redis, device_classes: list[str], prefix: str, *, name: str | None = None) -> BuildWorker:
    """A `BuildWorker` on the classes' build queues, reaching the Redis `connection` talks to."""
    return BuildWorker(connection, device_classes, prefix, name=name)
