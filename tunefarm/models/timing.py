"""How a whole model's latency is measured: one function for the tuned model and for
onnxruntime, used by `tunefarm tune`, `tunefarm run`, `tunefarm bench models` and the
farm's model runs, so that their numbers can be compared.

`time_calls(call)` times single inferences with `time.perf_counter_ns` around each
Python call (what a caller of the library sees: the Relax VM's dispatch and output
allocation for TVM, `InferenceSession.run` for onnxruntime), after a warm-up:

- warm-up: untimed calls for at least `WARMUP_SECS` (and at least `WARMUP_CALLS`), so
  that lazily created thread pools, first-touch page faults and caches are behind it
  whatever the model's size (a fixed count of 3 calls is 0.1 ms for a 40 us model and
  several seconds for a large one);
- samples: as many single inferences as fit in `BUDGET_SECS`, at least `MIN_RUNS` and at
  most `MAX_RUNS` (or exactly `runs` when given);
- `Latency`: mean, p50, p90 and p99 of the samples, and the thread count.

The thread count is the same for both: TVM's pool gets `TVM_NUM_THREADS` (set in the
child process that runs the model; `tvm.runtime.num_threads()` confirms it) and
onnxruntime `intra_op_num_threads` (one inter-op thread).

`time_interleaved(blocks)` compares several contenders (the tuned model, onnxruntime,
another build) on a shared, noisy machine: each keeps its own process, and the samples
are taken in `ROUNDS` rounds of one block per contender, the order reversed every other
round, each block followed by a pause until the contender's process uses no CPU (its
thread pool spins on for 0.1-0.2 s after its last call: TVM's here; a fixed 50 ms pause
was too short, and the next contender's block ran up to 2x slower) and `SETTLE_SECS`
more. A noisy minute then hits every contender alike, and the per-round p50s
(`Latency.round_medians`) show how much a ratio moves from round to round
(`round_ratios`)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

WARMUP_SECS = 0.3
"""Untimed calls before the samples, in seconds."""

WARMUP_CALLS = 3
"""Untimed calls at least (a slow model's warm-up is a few calls, not WARMUP_SECS)."""

BUDGET_SECS = 1.0
"""Time spent on samples when their number is not given."""

MIN_RUNS = 20
"""Samples at least (a slow model takes longer than BUDGET_SECS)."""

MAX_RUNS = 2000
"""Samples at most."""

ROUNDS = 5
"""Blocks per contender in `time_interleaved`."""

SETTLE_SECS = 0.05
"""Pause after each block of `time_interleaved` (after the block's own wait for its
process to be idle, `IsolatedWorker.wait_idle`)."""


@dataclass(frozen=True)
class Latency:
    """Seconds per inference over `runs` timed single inferences on `threads` threads."""

    mean: float
    median: float  # p50
    p90: float
    p99: float
    threads: int
    samples: tuple[float, ...] = field(default=(), repr=False)
    round_medians: tuple[float, ...] = ()  # p50 of each block of `time_interleaved`; () otherwise

    @property
    def runs(self) -> int:
        return len(self.samples)

    @staticmethod
    def of(samples: Sequence[float], threads: int, round_medians: Sequence[float] = ()) -> Latency:
        arr = np.asarray(samples, dtype=np.float64)
        p50, p90, p99 = (float(x) for x in np.percentile(arr, [50, 90, 99]))
        return Latency(float(arr.mean()), p50, p90, p99, int(threads), tuple(float(s) for s in arr),
                       tuple(float(m) for m in round_medians))  # fmt: skip

    def as_report(self) -> dict[str, Any]:
        """The latency as the report stores it (the samples left out)."""
        report = {"mean": self.mean, "median": self.median, "p90": self.p90, "p99": self.p99,
                  "threads": self.threads, "runs": self.runs}  # fmt: skip
        if self.round_medians:
            report["round_medians"] = list(self.round_medians)
        return report


def round_ratios(slower: Mapping[str, Any], faster: Mapping[str, Any]) -> list[float]:
    """Per round of `time_interleaved`, `slower`'s p50 over `faster`'s (two reports of
    `Latency.as_report`, or [] when either was not timed in rounds)."""
    a, b = slower.get("round_medians") or [], faster.get("round_medians") or []
    return [x / y for x, y in zip(a, b) if y > 0] if len(a) == len(b) else []


def speedup(base: Mapping[str, Any] | None, tuned: Mapping[str, Any] | None) -> float | None:
    """How many times faster `tuned` runs than `base` (two reports of `Latency.as_report`);
    None when either is missing or has no p50.

    Timed together in rounds (`time_interleaved`): the median of the per-round ratios
    (`round_ratios`), each of two blocks that ran next to each other. On a shared machine
    whose speed comes in phases (a model's samples falling into two clusters, e.g. 0.6 ms
    and 1.1 ms, for every engine alike), the p50 of all samples pooled lands in whichever
    cluster holds more of an engine's samples, and its ratio can be off by 1.6x when
    every round agrees within 10%. Otherwise: `base`'s p50 over `tuned`'s."""
    if not base or not tuned or not base.get("median") or not tuned.get("median"):
        return None
    per_round = round_ratios(base, tuned)
    if per_round:
        return float(np.median(per_round))
    return base["median"] / tuned["median"]


def time_calls(
    call: Callable[[], Any],
    *,
    runs: int | None = None,
    warmup_calls: int = WARMUP_CALLS,
    warmup_secs: float = WARMUP_SECS,
    budget_secs: float = BUDGET_SECS,
    min_runs: int = MIN_RUNS,
) -> list[float]:
    """Seconds of each timed call of `call` (see the module docstring)."""
    clock = time.perf_counter_ns
    start, calls = clock(), 0
    while calls < warmup_calls or (clock() - start) < warmup_secs * 1e9:
        call()
        calls += 1
    samples: list[float] = []
    want = runs if runs is not None else MAX_RUNS
    deadline = clock() + budget_secs * 1e9
    while len(samples) < want:
        t0 = clock()
        call()
        t1 = clock()
        samples.append((t1 - t0) * 1e-9)
        if runs is None and len(samples) >= min_runs and t1 >= deadline:
            break
    return samples


Block = Callable[[int | None, float, float, int], tuple[list[float], int]]
"""One block of a contender in `time_interleaved`: called as (runs, budget_secs,
warmup_secs, min_runs) with `time_calls`' meaning, it returns the samples and the
thread count they ran on."""


def time_interleaved(
    blocks: Mapping[str, Block],
    *,
    runs: int | None = None,
    rounds: int = ROUNDS,
    budget_secs: float = BUDGET_SECS,
    settle_secs: float = SETTLE_SECS,
) -> dict[str, Latency]:
    """Each contender's latency, sampled in `rounds` alternating blocks (see the module
    docstring): `runs` samples in all (split over the rounds) or `budget_secs` of them,
    the first block of each after a full warm-up, the others after one call."""
    names = list(blocks)
    samples: dict[str, list[float]] = {n: [] for n in names}
    medians: dict[str, list[float]] = {n: [] for n in names}
    threads: dict[str, int] = {}
    if runs is not None:
        rounds = max(1, min(rounds, runs))
    min_per_block = max(1, math.ceil(MIN_RUNS / rounds))
    for r in range(rounds):
        # `runs` split as evenly as whole blocks allow
        per_block = None if runs is None else runs * (r + 1) // rounds - runs * r // rounds
        for name in names if r % 2 == 0 else reversed(names):
            got, threads[name] = blocks[name](per_block, budget_secs / rounds, WARMUP_SECS if r == 0 else 0.0,
                                              min_per_block)  # fmt: skip
            samples[name].extend(got)
            medians[name].append(float(np.median(got)))
            time.sleep(settle_secs)
    return {n: Latency.of(samples[n], threads[n], medians[n]) for n in names}
