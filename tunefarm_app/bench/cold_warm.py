"""A cold tuning run against a warm one of the same workload: trials to reach the cold run's final latency.

The figure of merit of `tunefarm bench transfer` (warm: the cost model of another class)
and `tunefarm bench pretrained` (warm: the pretrained model): the bar is the cold run's
final best latency, within a tolerance; each run's trials to reach it are counted in the
workload's own measurements, in order. A warm run that never reaches it counts as one
trial more than the budget, so its ratio is a lower bound.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from tunefarm.errors import UsageError


@dataclass(frozen=True)
class Reach:
    """Two runs of one workload measured against the cold one's final best."""

    cold_best: float  # seconds: the cold run's final best latency (the bar, before the tolerance)
    warm_best: float  # seconds: the warm run's final best latency
    cold_trials: int  # trials the cold run needed to reach the bar
    warm_trials: int | None  # ... the warm run (None: not within the budget)
    budget: int

    @property
    def ratio(self) -> float:
        return trials_ratio(self.warm_trials, self.cold_trials, self.budget)


def trials_to_reach(costs: list[float], bar: float) -> int | None:
    """1-based index of the first cost at or below `bar` (None: none is)."""
    return next((i + 1 for i, c in enumerate(costs) if c <= bar), None)


def trials_ratio(warm_trials: int | None, cold_trials: int, budget: int) -> float:
    """warm / cold trials (a warm run that never reached the bar counts as budget + 1)."""
    warm = warm_trials if warm_trials is not None else budget + 1
    return warm / cold_trials


def measured_costs(state) -> list[float]:
    """A task's costs in measurement order (inf for a failed measurement), from its search's state."""
    return [r.cost if r.is_valid else math.inf for r in state.records]


def reach(workload: str, cold: list[float], warm: list[float], *, tolerance: float, budget: int) -> Reach:
    """The trials each run needed to come within `tolerance` of the cold run's final best.
    Raises UsageError when the cold run found no valid kernel (there is no bar)."""
    cold_best = min(cold, default=math.inf)
    if not math.isfinite(cold_best):
        raise UsageError(f"{workload}: the cold run found no valid kernel")
    bar = cold_best * (1 + tolerance)
    cold_trials = trials_to_reach(cold, bar)
    assert cold_trials is not None  # its own best is under the bar
    return Reach(cold_best, min(warm, default=math.inf), cold_trials, trials_to_reach(warm, bar), budget)


def geomean(values: Iterable[float]) -> float:
    """Geometric mean of the finite positive values (NaN: none)."""
    finite = [v for v in values if math.isfinite(v) and v > 0]
    return math.exp(sum(math.log(v) for v in finite) / len(finite)) if finite else math.nan


def ms(secs: float) -> str:
    return f"{secs * 1e3:.4f} ms" if math.isfinite(secs) else "-"


def parse_seeds(spec: str) -> list[int]:
    """`--seeds 1,2,3` -> [1, 2, 3]. Raises UsageError."""
    try:
        seeds = [int(s) for s in spec.split(",") if s.strip()]
    except ValueError:
        raise UsageError(f"--seeds: not a comma-separated list of integers: {spec!r}") from None
    if not seeds or any(s < 1 for s in seeds):
        raise UsageError("--seeds: give at least one seed, each at least 1")
    return seeds
