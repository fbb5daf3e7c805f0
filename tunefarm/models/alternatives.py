"""Alternatives of a model's tasks: other programs that compute a task's outputs from its
parameters by another algorithm. Today that is Winograd F(m x m, 3 x 3) for a task whose
fused function holds one 3x3 stride-1 convolution (`tunefarm.winograd_sites`).

The search tunes each alternative as a task of its own, in one group with the task
(`TaskInfo.group`): the task scheduler counts the fastest of the group in the model's
latency and spends rounds on an alternative only while it could beat that. Each
alternative's kernels are checked against the task's own unscheduled output (its
`Workload.reference_mod`), so an algorithm whose rounding strays beyond the check's
tolerance never has a valid measurement and is never chosen. After the search the model
takes, per task, the fastest member with a valid measurement (`choose`), and the build
puts that member's scheduled function where the task's was (`scheduled_function_of`).

    alternatives_of(workload)      -> the alternatives' workloads (named task name + suffix)
    choose(task_key, members)      -> `Choice`: which member the model takes
    schedule_key(task, schedules)  -> the key a task's schedule is under in a build's map
                                      (its own, or its chosen alternative's)
    member_workload(task, key)     -> the workload that key names: the task's or an
                                      alternative's, made again from the task
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tunefarm.records import MeasureRecord
from tunefarm.search.config import batch_size_for
from tunefarm.workloads.base import Workload

ALGORITHMS = ("winograd",)
"""The algorithms a task may have alternatives by (`tunefarm tune --no-winograd` drops one)."""

DIRECT = "direct"
"""The algorithm name of a task's own program."""


def alternatives_of(workload: Workload, algorithms: Sequence[str] = ALGORITHMS) -> tuple[Workload, ...]:
    """The task's alternatives by each of `algorithms`: workloads with the task's
    parameters, constants and FLOPs, named `<task name>+<algorithm><variant>`."""
    from tunefarm.winograd_sites import winograd_alternatives

    return winograd_alternatives(workload) if "winograd" in algorithms else ()


def rounds_with_alternatives(trials: int, n_tasks: int, largest: int = 32) -> int | None:
    """Measurements per round for `n_tasks`, a model's tasks and their alternatives
    together (`batch_size_for` them all, at most `largest`); None when `trials` in such
    rounds do not give each of them a round: alternatives would then only cost their
    preparation (the model's own tasks warm up first), so a run tunes none."""
    batch_size = batch_size_for(trials, n_tasks, largest)
    return batch_size if trials >= batch_size * n_tasks else None


def algorithm_of(task_name: str, member_name: str) -> str:
    """"direct" for the task itself, else what its alternative's name adds ("winograd4")."""
    return DIRECT if member_name == task_name else member_name[len(task_name) + 1 :]


def is_alternative_key(task_name: str, key: str) -> bool:
    """Whether a workload key names an alternative of the task named `task_name`."""
    return key.startswith(task_name + "+") and any(
        key[len(task_name) + 1 :].startswith(a) for a in ALGORITHMS
    )


def schedule_key(task: Any, schedules: Mapping[str, Any]) -> str | None:
    """The key of `task`'s schedule in `schedules` (workload key -> trace): its own key, or
    an alternative's when the search chose one; None when it has none (default build)."""
    if schedules.get(task.key) is not None:
        return task.key
    return next(
        (k for k, v in schedules.items() if v is not None and is_alternative_key(task.name, k)), None
    )


def member_workload(task: Any, key: str) -> Workload | None:
    """The workload `key` names among `task` and its alternatives (None: none of them, e.g.
    a schedule from a version that made other alternatives)."""
    if key == task.key:
        return task.workload
    return next((a for a in alternatives_of(task.workload) if a.key == key), None)


@dataclass(frozen=True)
class Member:
    """One program of a task's group as the search left it."""

    name: str  # the workload's name
    key: str  # the workload's key
    best: MeasureRecord | None  # its fastest valid measurement
    trials: int


@dataclass(frozen=True)
class Choice:
    """Which member of its group a task's model takes, and what the others reached."""

    task_key: str
    chosen: Member | None  # None: no member has a valid measurement
    algorithm: str  # of the chosen member ("direct" when none is)
    members: tuple[Member, ...]  # the task first, then its alternatives

    @property
    def schedule_key(self) -> str | None:
        """The workload key under which the chosen schedule goes to the build."""
        return self.chosen.key if self.chosen is not None else None

    def as_report(self) -> list[dict[str, Any]]:
        """Each member's algorithm, best time and trials, for the report's task row."""
        task_name = self.members[0].name
        return [
            {
                "algorithm": algorithm_of(task_name, m.name),
                "best_seconds": m.best.cost if m.best else None,
                "trials": m.trials,
                "chosen": m is self.chosen,
            }
            for m in self.members
        ]


def choose(task_key: str, members: Sequence[Member]) -> Choice:
    """The fastest member with a valid measurement (the task itself on a tie)."""
    measured = [m for m in members if m.best is not None]
    chosen = min(measured, key=lambda m: m.best.cost) if measured else None  # type: ignore[union-attr]
    algorithm = algorithm_of(members[0].name, chosen.name) if chosen is not None else DIRECT
    return Choice(task_key, chosen, algorithm, tuple(members))


def choices(
    groups: Mapping[str, Sequence[str]], members: Mapping[str, Member]
) -> dict[str, Choice]:
    """`choose` for every task: `groups` maps a task's workload key to its group's workload
    keys (the task first), `members` a workload key to what the search left of it (an
    alternative the search could not take, being absent, is no member)."""
    return {key: choose(key, [members[k] for k in keys if k in members]) for key, keys in groups.items()}
