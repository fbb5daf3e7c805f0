"""The model importers every upload goes through: a small pool of child processes shared
by all teams, at most a few of them per team.

One importer for the whole farm makes every team wait behind the slowest upload of any
other team. The pool keeps `size` children (`tunefarm.isolation.IsolatedWorker`, each
with its address space capped at `memory_limit_bytes`, started when first needed), and
counts each team's uploads in progress (waiting for an importer or importing):

- a team with `per_team` uploads in progress gets `TooManyRequests` (429) at once for
  another one: it waits its turn on its own side (`Retry-After`), and never holds a
  request thread of the API while it does;
- an upload within its team's limit waits for an idle importer, at most `wait_secs`
  (`ServiceUnavailable`, 503, after that: the farm is overloaded, not the team);
- with `size` > `per_team`, another team's upload always finds an importer that the
  busiest team cannot take.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from services.api.exceptions import ServiceUnavailable, TooManyRequests
from tunefarm.isolation import WITHOUT_TORCH, IsolatedWorker

RETRY_AFTER_SECS = 5
"""What a team over its limit is told to wait before trying again."""

IMPORTER_ENV = {"MALLOC_ARENA_MAX": "2"}
"""glibc reserves 64 MiB of address space per thread arena; the cap is on address space."""


class IntakePool:
    def __init__(
        self,
        *,
        size: int,
        per_team: int,
        wait_secs: float,
        memory_limit_bytes: int | None,
        preload: list[str],
    ):
        if size < 1 or per_team < 1:
            raise ValueError("an intake pool needs at least one importer and one upload per team")
        self.per_team = per_team
        self.wait_secs = wait_secs
        self._workers = [
            # an upload is untrusted input to the importer: it runs without the API's secrets;
            # it imports ONNX graphs with TVM only (no torch: `WITHOUT_TORCH`)
            IsolatedWorker(preload=preload, name=f"model-intake-{i}", memory_limit_bytes=memory_limit_bytes,
                           env=IMPORTER_ENV, scrub_secrets=True, blocked_imports=WITHOUT_TORCH)
            for i in range(size)
        ]
        self._idle = list(self._workers)
        self._in_progress: Counter[int] = Counter()
        self._changed = threading.Condition()

    @property
    def workers(self) -> tuple[IsolatedWorker, ...]:
        return tuple(self._workers)

    def in_progress(self, team_id: int) -> int:
        """The team's uploads waiting for an importer or importing."""
        with self._changed:
            return self._in_progress[team_id]

    @contextmanager
    def admit(self, team_id: int) -> Iterator[None]:
        """One upload of the team in progress until the block ends. Raises
        `TooManyRequests` when the team has `per_team` already."""
        with self._changed:
            if self._in_progress[team_id] >= self.per_team:
                raise TooManyRequests(
                    f"your team already has {self._in_progress[team_id]} model upload(s) being imported, the most "
                    f"this farm takes in at once per team ({self.per_team}); try again when it is done",
                    retry_after_secs=RETRY_AFTER_SECS,
                )
            self._in_progress[team_id] += 1
        try:
            yield
        finally:
            with self._changed:
                self._in_progress[team_id] -= 1
                if not self._in_progress[team_id]:
                    del self._in_progress[team_id]

    @contextmanager
    def importer(self) -> Iterator[IsolatedWorker]:
        """An idle importer, held until the block ends (for an admitted upload). Raises
        `ServiceUnavailable` when none became idle within `wait_secs`."""
        worker = self._take_idle()
        try:
            yield worker
        finally:
            with self._changed:
                self._idle.append(worker)
                self._changed.notify_all()

    def _take_idle(self) -> IsolatedWorker:
        deadline = time.monotonic() + self.wait_secs
        with self._changed:
            while not self._idle:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ServiceUnavailable(
                        f"all {len(self._workers)} model importers of this farm stayed busy for "
                        f"{self.wait_secs:g} s; try again shortly",
                        retry_after_secs=RETRY_AFTER_SECS,
                    )
                self._changed.wait(left)
            return self._idle.pop()

    def close(self) -> None:
        for worker in self._workers:
            worker.close()
