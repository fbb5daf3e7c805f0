"""How a build worker talks to Redis: every command waits for a Redis that went away (a
restart) instead of failing, until the worker is asked to stop.

RQ's worker loop retries only its dequeue while Redis is away. Every other Redis call of
the worker raises into it, and redis-py's default retry (ten tries within a few seconds)
covers a blip, not a restart. The one that ended busy workers (RQ 2.x): the build job
returns, `BaseWorker.perform_job` writes the job's heartbeat (`handle_execution_ended`),
takes the ConnectionError for the job's own failure, writes the heartbeat again in its
failure branch, and that ConnectionError leaves `perform_job` for `work()`'s catch-all:
"found an unhandled exception, quitting". The suspension check and the registry upkeep
at the top of RQ's loop, the heartbeat after each job and the worker's registration
raise into the same catch-all.

So the worker's own connection pool retries every command (`WaitForRedis`, the pool's
redis-py `Retry`): a failed command reconnects and is sent again after 0.5 s, 1 s, 2 s,
... up to `MAX_WAIT_SECS` between tries, for as long as Redis is away. A build that
finished meanwhile is recorded once Redis answers; a build job Redis lost with its data
is the scheduler's to enqueue again (`FarmMeasurer._check_batches`). The waits end when
the worker is stopping (SIGTERM: RQ's warm shutdown), so that a worker being stopped does
not wait for a Redis that may never come back, and on a refused password (waiting does
not bring the right one).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from redis import ConnectionPool, Redis
from redis.backoff import ExponentialBackoff
from redis.exceptions import AuthenticationError
from redis.retry import Retry

log = logging.getLogger("tunefarm.worker")

T = TypeVar("T")

FIRST_WAIT_SECS = 0.5
"""The wait before the first retry of a command; each next wait doubles..."""

MAX_WAIT_SECS = 5.0
"""...up to this: a Redis back after a restart is found within this long."""

NOTE_EVERY_SECS = 60.0
"""While Redis stays away, the worker says it still waits this often (first: at once)."""


class WaitForRedis(Retry):
    """The retry policy of a build worker's connection pool (module docstring). One
    object for every connection of the pool (deep copies are this object: redis-py
    copies a pool's policy into each connection, and this one holds its worker's
    `stopping`). The worker's main thread says when it starts waiting for Redis and when
    Redis answers again; the RQ command listener's thread waits as well, silently."""

    def __init__(self, stopping: Callable[[], bool], address: str):
        super().__init__(ExponentialBackoff(cap=MAX_WAIT_SECS, base=FIRST_WAIT_SECS / 2), retries=-1)
        self._stopping = stopping
        self._address = address
        self._noted_at = -math.inf
        self._came_back = threading.Event()

    def __deepcopy__(self, memo: dict[int, Any]) -> WaitForRedis:
        return self

    def call_with_retry(
        self,
        do: Callable[[], T],
        fail: Callable[..., Any],
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> T:
        """`do()`, retried after each supported error (ConnectionError, TimeoutError) with
        `fail(error)` in between (redis-py's callback: it drops the broken connection),
        for as long as it takes unless the worker is stopping or Redis refused the password."""
        failures = 0
        while True:
            try:
                result = do()
            except self._supported_errors as error:
                if is_retryable is not None and not is_retryable(error):
                    raise
                failures += 1
                if with_failure_count:
                    fail(error, failures)
                else:
                    fail(error)
                if isinstance(error, AuthenticationError) or self._stopping():
                    raise
                wait = self._backoff.compute(failures)
                self._note_waiting(error, failures, wait)
                time.sleep(wait)
            else:
                if failures:
                    self._note_back(failures)
                return result

    def came_back(self) -> bool:
        """Whether Redis answered again after a wait since the last call (cleared here)."""
        if not self._came_back.is_set():
            return False
        self._came_back.clear()
        return True

    def _note_waiting(self, error: Exception, failures: int, wait: float) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        now = time.monotonic()
        if failures == 1 or now - self._noted_at >= NOTE_EVERY_SECS:
            self._noted_at = now
            log.warning(
                "Redis at %s does not answer (%s); the worker waits for it (next try in %.1f s)",
                self._address, error, wait,
            )  # fmt: skip

    def _note_back(self, failures: int) -> None:
        self._came_back.set()
        if threading.current_thread() is threading.main_thread():
            self._noted_at = -math.inf
            log.info("Redis at %s answers again (after %d failed tries); the worker goes on", self._address, failures)


def waiting_client(connection: Redis, policy: WaitForRedis) -> Redis:
    """A client of the Redis `connection` talks to (same address, credentials, TLS), on a
    pool of its own whose commands wait for Redis by `policy`."""
    pool = connection.connection_pool
    kwargs = {**pool.connection_kwargs, "retry": policy}
    return Redis(connection_pool=ConnectionPool(connection_class=pool.connection_class, **kwargs))


def address_of(connection: Redis) -> str:
    """host:port of the Redis `connection` talks to (never its password), for log lines."""
    kwargs = connection.connection_pool.connection_kwargs
    if kwargs.get("path"):
        return str(kwargs["path"])
    return f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}"
