"""Which of a task's kernels go to the final rounds, and which one the models take after.

At the end of a run each task's fastest few checked kernels are measured again together
(`tunefarm.measure.finalists.remeasure`): the best record alone is the lowest of many
noisy times, taken minutes apart. These are the pure parts: `finalists_of` names them,
`pick` chooses by the medians of their final rounds.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from tunefarm.records import MeasureRecord
from tunefarm.search.config import FinalConfig


def finalists_of(records: Sequence[MeasureRecord], config: FinalConfig) -> list[MeasureRecord]:
    """A task's fastest checked kernels (one record per program, fastest first), at most
    `config.kernels`, each within `config.within` of the fastest; none when the rounds
    are off. A lone one is a finalist too: measured again beside its task's alternatives
    (a Winograd program against the direct one), their times compare fairly."""
    if config.rounds < 1 or config.kernels < 1:
        return []
    best: dict[str, MeasureRecord] = {}
    for r in records:
        if r.is_valid and r.verified and (r.key not in best or r.cost < best[r.key].cost):
            best[r.key] = r
    ranked = sorted(best.values(), key=lambda r: r.cost)
    if not ranked:
        return []
    return [r for r in ranked[: config.kernels] if r.cost <= ranked[0].cost * config.within]


@dataclass(frozen=True)
class FinalPick:
    """A task's final choice: the kernel its records ranked first, the one the final rounds
    chose (its record carrying its round times as `costs`), and every finalist's median."""

    task: str
    by_record: MeasureRecord
    chosen: MeasureRecord
    medians: Mapping[str, float]  # candidate key -> median of its rounds (seconds)

    @property
    def changed(self) -> bool:
        return self.chosen.key != self.by_record.key

    def as_report(self) -> dict:
        return {
            "finalists": len(self.medians),
            "changed": self.changed,
            "record_seconds": self.by_record.cost,
            "final_seconds": self.chosen.cost,
            "by_record_final_seconds": self.medians.get(self.by_record.key),
        }


def pick(task: str, finalists: Sequence[MeasureRecord], rounds: Mapping[str, Sequence[float]]) -> FinalPick | None:
    """The finalist with the lowest median over its final rounds (`rounds`: candidate key ->
    its times; a finalist without any was left out); None when none has any. The chosen
    record's `costs` become its round times, measured now."""
    timed = [r for r in finalists if rounds.get(r.key)]
    if not finalists or not timed:
        return None
    medians = {r.key: statistics.median(rounds[r.key]) for r in timed}
    winner = min(timed, key=lambda r: medians[r.key])
    chosen = replace(winner, costs=tuple(rounds[winner.key]), timestamp=time.time())
    return FinalPick(task, finalists[0], chosen, medians)
