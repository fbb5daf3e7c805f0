"""The build worker: an RQ `SimpleWorker` on the build queues of device classes that runs
`BuildJob`s only (`services.worker.build_job`) and rides out a Redis restart.

Its connection is its own, with a pool whose commands wait for a Redis that went away
(`services.worker.redis_wait`): a worker busy building when Redis restarts finishes the
build, waits for Redis, records the job and goes on serving its queues, in the same
process with its warm build processes. A Redis that lost its data also lost the worker's
registration; the first heartbeat after Redis came back registers it again (RQ does so
for workers that fork, not for a SimpleWorker), so `rq info` and `Worker.all` see it.
See `services.worker.jobs` for why a SimpleWorker.

A worker that follows the database (`every_class`: `tunefarm worker` without
`--device-class`, or with `--every-class`, as `farm up`'s shared workers run) also takes
the build queue of every class created after it started: it asks at most every
`follow_secs` (its wait for a job is cut to that), and a new class's queue goes after
the ones it has, so the classes it was started for keep their turn first.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from redis import Redis
from rq import SimpleWorker, worker_registration

from services.worker.build_job import SERIALIZER, BuildJob, build_queue
from services.worker.redis_wait import WaitForRedis, address_of, log, waiting_client


class BuildWorker(SimpleWorker):
    """A SimpleWorker on `device_classes`' build queues (module docstring)."""

    def __init__(
        self,
        connection: Redis,
        device_classes: list[str],
        prefix: str,
        *,
        name: str | None = None,
        every_class: Callable[[], list[str]] | None = None,
        follow_secs: float = 15.0,
    ):
        self.redis_wait = WaitForRedis(stopping=self.stopping, address=address_of(connection))
        own = waiting_client(connection, self.redis_wait)
        queues = [build_queue(own, c, prefix) for c in device_classes]
        self.prefix = prefix
        self.every_class = every_class
        self.follow_secs = follow_secs
        self._next_look = 0.0
        super().__init__(queues, connection=own, name=name, job_class=BuildJob, serializer=SERIALIZER)

    @property
    def dequeue_timeout(self) -> int:
        """How long one wait for a job lasts: RQ's, or at most `follow_secs` when following
        the database (the loop asks for new classes between waits)."""
        wait = super().dequeue_timeout
        return min(wait, max(1, int(self.follow_secs))) if self.every_class else wait

    def stopping(self) -> bool:
        """Whether the worker was asked to stop (SIGTERM or SIGINT: RQ's warm shutdown)."""
        return getattr(self, "_shutdown_requested_date", None) is not None

    def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
        super().heartbeat(timeout, pipeline)
        if pipeline is None and self.birth_date is not None and self.redis_wait.came_back():
            self._register_again_if_forgotten()
        if pipeline is None and self.every_class is not None:
            self.serve_new_classes()

    def serve_new_classes(self) -> list[str]:
        """Add the build queues of classes created since the last look (at most every
        `follow_secs`); the classes added. A database that cannot be asked now is asked
        again at the next look."""
        if self.every_class is None or time.monotonic() < self._next_look:
            return []
        self._next_look = time.monotonic() + self.follow_secs
        try:
            names = self.every_class()
        except Exception as exc:  # noqa: BLE001 (a database restart: the worker goes on building)
            log.warning("could not look for new device classes (%s); looking again in %.0f s", exc, self.follow_secs)
            return []
        known = {q.name for q in self.queues}
        new = {c: q for c in names if (q := build_queue(self.connection, c, self.prefix)).name not in known}
        if new:
            self.queues = [*self.queues, *new.values()]
            self._ordered_queues = [*self._ordered_queues, *new.values()]
            log.info("building for the new device class%s %s too", "es" if len(new) > 1 else "", ", ".join(new))
        return list(new)

    def _register_again_if_forgotten(self) -> None:
        if self.connection.hexists(self.key, "birth"):
            return
        with self.connection.pipeline() as pipeline:
            pipeline.hset(self.key, mapping=self.serialize())
            pipeline.expire(self.key, self.worker_ttl + 60)
            worker_registration.register(self, pipeline)
            pipeline.execute()
        log.info("Redis had lost this worker's registration (restarted without its data): registered again")


def build_worker(
    connection: Redis,
    device_classes: list[str],
    prefix: str,
    *,
    name: str | None = None,
    every_class: Callable[[], list[str]] | None = None,
) -> BuildWorker:
    """A `BuildWorker` on the classes' build queues, reaching the Redis `connection` talks
    to; with `every_class` (the database's class names), on every later class's too."""
    return BuildWorker(connection, device_classes, prefix, name=name, every_class=every_class)
