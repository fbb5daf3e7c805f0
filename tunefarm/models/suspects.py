"""Which tuned task's kernel makes a model fail its output check.

Every kernel was checked on its own when it was measured, yet a model built from records
can still fail (records from another run, a kernel right on the task's test inputs and
wrong on the model's real ranges). Before a failed model is reported, the tasks are
bisected: the model is built again with only some tasks' tuned schedules (the others keep
TVM's default build) and checked again, halving the candidates each time:

    none tuned fails          -> the conversion itself, not a kernel: no task is named
    the first half fails      -> the culprit is in it
    else the second half fails -> the culprit is in that one
    else                      -> only the two together fail: both halves are named

That costs about 2 log2(n) builds of the model for n tuned tasks; `max_builds` caps it
(the candidates left when it runs out are named).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

MAX_BUILDS = 10
"""Builds one bisection may spend."""


@dataclass(frozen=True)
class Suspects:
    """The tasks to suspect (names), and how they were found."""

    tasks: tuple[str, ...]
    builds: int
    reason: str  # one sentence for the report

    def as_report(self) -> dict:
        return {"tasks": list(self.tasks), "builds": self.builds, "reason": self.reason}


def find_suspects(
    tuned: Sequence[str], fails: Callable[[Sequence[str]], bool], *, max_builds: int = MAX_BUILDS
) -> Suspects:
    """Bisect `tuned` (task names with a tuned schedule): `fails(subset)` builds the model
    with only `subset` tuned and says whether it fails the check."""
    builds = 1
    if fails(()):
        return Suspects((), builds, "TVM's untuned build fails the check too: the model's conversion, not a tuned kernel")
    candidates = list(tuned)
    while len(candidates) > 1 and builds < max_builds:
        half, rest = candidates[: len(candidates) // 2], candidates[len(candidates) // 2 :]
        builds += 1
        if fails(half):
            candidates = half
            continue
        builds += 1
        if fails(rest):
            candidates = rest
            continue
        return Suspects(tuple(candidates), builds, "each half alone passes: these tasks fail only together")
    if len(candidates) == 1:
        return Suspects(tuple(candidates), builds, "the model fails with this task's tuned kernel alone")
    return Suspects(tuple(candidates), builds, f"narrowed to {len(candidates)} tasks in {builds} builds (the limit)")
