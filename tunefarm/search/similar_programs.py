"""Seeding a task's search from the best programs of structurally similar tasks.

A model's tasks often repeat one structure at other shapes (the convolutions of a CNN,
the GEMMs of a transformer). When a task starts, the best programs measured for its
similar tasks, in this run or in the records file, are a better start than random
ones: the tile structure that suits a 3x3 convolution of 32 channels usually suits one
of 64. `SimilarPrograms` keeps each task's best measured programs; a task takes those
of the other tasks with a sketch of the same signature (the same derivation steps, so
the same slots) and `ProgramSpace.transfer` rebuilds them on its own extents, tile sizes
refit to the nearest tiling (`TileDomain.nearest`). The programs go into the task's
initial population next to its own best (`EvolutionarySearch.next_batch`), while the
task has fewer programs of its own than the population's seed share.

The same workload measured on another target (another device class: records of the
nearest class in the farm, or of another target in an embedded records file) is the most
similar task of all: its programs come first, so a new class starts from the programs
that won on its nearest class (tune on one device, transfer to another).
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Iterable

from tunefarm.records import MeasureRecord
from tunefarm.search.task import workload_of

PER_TASK = 4
"""Best programs kept per task (and so given by each similar task)."""


class SimilarPrograms:
    """The best measured programs of every task seen, by task."""

    def __init__(self, per_task: int = PER_TASK) -> None:
        self.per_task = per_task
        self._best: dict[str, list[MeasureRecord]] = {}

    def add(self, records: Iterable[MeasureRecord]) -> None:
        """Take measured programs of any task (failures and emulated timings are passed over)."""
        for r in records:
            if not r.is_valid or r.emulated:
                continue
            best = self._best.setdefault(r.task, [])
            if any(b.candidate.key == r.candidate.key for b in best):
                continue
            bisect.insort(best, r, key=lambda b: b.cost)
            del best[self.per_task :]

    def donors(self, task_key: str, signatures: Collection[str], limit: int) -> list[MeasureRecord]:
        """Up to `limit` best programs of tasks other than `task_key` whose sketch signature
        is one of `signatures`: first those of the same workload on other targets, best
        first; then each other task's best, then each one's second, and so on."""
        workload = workload_of(task_key)
        same: list[MeasureRecord] = []
        lists: list[list[MeasureRecord]] = []
        for key, best in sorted(self._best.items()):
            if key == task_key:
                continue
            usable = [r for r in best if r.sketch_sig in signatures]
            if workload_of(key) == workload:
                same += usable
            else:
                lists.append(usable)
        out = sorted(same, key=lambda r: r.cost)
        for rank in range(self.per_task):
            out += [best[rank] for best in lists if rank < len(best)]
        return out[:limit]
