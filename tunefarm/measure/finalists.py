"""Each task's fastest few kernels, measured again together at the end of a run.

A task's best record is the fastest of many measurements taken over the whole run, on a
machine whose speed drifts (other work, clock frequency, the neighbours of a shared host):
the lowest of many noisy times is optimistic, and two records measured minutes apart are
not comparable. So, before the models are built, each task's finalists (its fastest
checked kernels, `tunefarm.search.finalists.finalists_of`) are built once more and timed
again in `rounds` alternating rounds: every round times every task's finalists, each
task's in a rotated order, so that no kernel is always measured first or in a fast
moment. A finalist's time is the median of its rounds (`pick`).

Only the measuring is here; which records are finalists and which one wins are the
search's pure functions (`tunefarm.search.finalists`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tunefarm.measure import MeasureTask
from tunefarm.measure.builder import Builder
from tunefarm.measure.runner import Runner
from tunefarm.records import BuildInput, MeasureRecord, RunInput, TimingConfig


@dataclass(frozen=True)
class Finalist:
    """A task's kernel to measure again: its task (by reference) and its record."""

    task: MeasureTask
    record: MeasureRecord


@dataclass(frozen=True)
class Remeasured:
    """What the final rounds gave: each finalist's time per round (seconds, the median of
    the round's repeats), by (task key, candidate key); a finalist that failed to build
    or run in a round is left out (`failed` says why)."""

    rounds: dict[tuple[str, str], tuple[float, ...]]
    failed: dict[tuple[str, str], str]
    secs: float


def remeasure(
    finalists: Sequence[Finalist],
    builder: Builder,
    runner: Runner,
    *,
    rounds: int,
    timing: TimingConfig,
    build_timeout: float,
    run_timeout: float,
    log: Callable[[str], None] = lambda msg: None,
) -> Remeasured:
    """Build every finalist once, then time them all in `rounds` alternating rounds (see
    the module docstring). Each is checked against its task's reference again in the first
    round (when its task has one); one that fails there is left out."""
    t0 = time.perf_counter()
    builds = builder.build(
        [BuildInput(f.record.key, f.task.workload, f.record.trace, f.task.target, build_timeout) for f in finalists]
    )
    failed: dict[tuple[str, str], str] = {}
    by_task: dict[str, list[tuple[Finalist, str]]] = {}
    for f, b in zip(finalists, builds, strict=True):
        key = (f.task.key, f.record.key)
        if b.error_kind.is_error or b.artifact is None:
            failed[key] = f"build: {b.error_msg or b.error_kind}"
        else:
            by_task.setdefault(f.task.key, []).append((f, b.artifact))
    times: dict[tuple[str, str], list[float]] = {}
    try:
        for r in range(rounds):
            for members in by_task.values():
                shift = r % len(members)
                for f, artifact in members[shift:] + members[:shift]:
                    key = (f.task.key, f.record.key)
                    if key in failed:
                        continue
                    (run,) = runner.run([RunInput(
                        candidate_key=f.record.key, artifact=artifact, task_data=f.task.task_data,
                        n_inputs=f.task.n_inputs, n_outputs=f.task.n_outputs, verify=f.task.verify and r == 0,
                        timing=timing, timeout_secs=run_timeout,
                    )])  # fmt: skip
                    if run.error_kind.is_error or (f.task.verify and r == 0 and not run.verified):
                        failed[key] = f"run: {run.error_msg or run.error_kind}"
                        times.pop(key, None)
                        continue
                    times.setdefault(key, []).append(run.median)
    finally:
        for members in by_task.values():
            for _, artifact in members:
                Path(artifact).unlink(missing_ok=True)
    for key, why in failed.items():
        log(f"final rounds: {key[0]} kernel {key[1]} left out ({why})")
    return Remeasured({k: tuple(v) for k, v in times.items()}, failed, time.perf_counter() - t0)
