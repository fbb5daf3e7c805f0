"""Which task of a model (or several models) gets the next tuning round (Ansor paper §6).

`TaskScheduler` is the interface; `GradientScheduler` is Ansor's gradient-based strategy,
`RoundRobinScheduler` the baseline. `make_scheduler` builds one by name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .base import (
    DeadReason,
    Decision,
    DecisionReason,
    LatencyEstimate,
    Objective,
    TaskInfo,
    TaskProgress,
    TaskScheduler,
    TaskSchedulerConfig,
    similarity_tag,
)
from .gradient import GradientScheduler, task_gradient
from .round_robin import RoundRobinScheduler

STRATEGIES: Mapping[str, type[TaskScheduler]] = {
    "gradient": GradientScheduler,
    "round-robin": RoundRobinScheduler,
}
"""Strategy name -> scheduler class, for `make_scheduler` and command-line choices."""


def make_scheduler(
    strategy: str,
    tasks: Sequence[TaskInfo],
    *,
    config: TaskSchedulerConfig | None = None,
    targets: Mapping[str, float] | None = None,
) -> TaskScheduler:
    """A scheduler of the named strategy ("gradient" or "round-robin") over ``tasks``."""
    try:
        cls = STRATEGIES[strategy]
    except KeyError:
        raise ValueError(
            f"unknown task-scheduler strategy {strategy!r} (choose from {list(STRATEGIES)})"
        ) from None
    return cls(tasks, config=config, targets=targets)


__all__ = [
    "STRATEGIES",
    "Decision",
    "DecisionReason",
    "DeadReason",
    "GradientScheduler",
    "LatencyEstimate",
    "Objective",
    "RoundRobinScheduler",
    "TaskSchedulerConfig",
    "TaskInfo",
    "TaskScheduler",
    "TaskProgress",
    "make_scheduler",
    "similarity_tag",
    "task_gradient",
]
