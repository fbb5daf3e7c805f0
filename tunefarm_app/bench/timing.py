"""Timing the two tuners' best kernels the same way: tunefarm's `LocalRunner` (one isolated
process, the target's cores as TVM threads), the same `BENCH_TIMING`, the same task data,
and the output checked against the workload's reference before any timing.

The kernels of one op are timed in alternation, `TIMING_PASSES` times each, and each keeps
the best of its per-pass medians: on a shared machine noise only ever slows a kernel down,
and alternating spreads a slow spell over both tuners.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from tunefarm.measure.runner import LocalRunner
from tunefarm.records import RunInput, TimingConfig, median_cost
from tunefarm.workloads import Workload

BENCH_TIMING = TimingConfig(repeat=7, min_repeat_ms=50.0, flush_cache=True)
"""How the bench times each best kernel (per pass): 7 repeats of >= 50 ms, caches flushed."""

TIMING_PASSES = 3
"""Alternating passes over an op's kernels; each kernel keeps its best median."""

RUN_TIMEOUT_SECS = 120.0
"""Time limit of one pass of one kernel."""


@dataclass(frozen=True)
class KernelTiming:
    secs: float | None  # best per-pass median seconds per call; None when it failed
    note: str = ""  # why it failed ("" when it did not)


class KernelTimer:
    """Times exported kernels (function "main") on task data, one at a time."""

    def __init__(self, num_threads: int):
        self._runner = LocalRunner(num_threads=num_threads)

    def close(self) -> None:
        self._runner.close()

    def __enter__(self) -> KernelTimer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def time(self, kernels: dict[str, Path], workload: Workload, task_data: Path) -> dict[str, KernelTiming]:
        """Time each named library; a failure (wrong output, crash...) ends that kernel's passes."""
        best = {name: math.inf for name in kernels}
        failed: dict[str, str] = {}
        for _ in range(TIMING_PASSES):
            for name, lib in kernels.items():
                if name in failed:
                    continue
                result = self._runner.run([self._input(name, lib, workload, task_data)])[0]
                if result.error_kind.is_error:
                    failed[name] = f"{result.error_kind}: {result.error_msg}"
                else:
                    best[name] = min(best[name], median_cost(result.costs))
        return {
            name: KernelTiming(None, failed[name]) if name in failed else KernelTiming(best[name])
            for name in kernels
        }

    @staticmethod
    def _input(name: str, lib: Path, workload: Workload, task_data: Path) -> RunInput:
        return RunInput(
            candidate_key=name,
            artifact=str(lib),
            task_data=str(task_data),
            n_inputs=len(workload.inputs),
            n_outputs=len(workload.outputs),
            verify=True,
            timing=BENCH_TIMING,
            timeout_secs=RUN_TIMEOUT_SECS,
        )
