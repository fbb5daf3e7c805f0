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
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
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


@dataclass(frozen=True)
class Latency:
    """Seconds per inference over `runs` timed single inferences on `threads` threads."""

    mean: float
    median: float  # p50
    p90: float
    p99: float
    threads: int
    samples: tuple[float, ...] = field(default=(), repr=False)

    @property
    def runs(self) -> int:
        return len(self.samples)

    @staticmethod
    def of(samples: Sequence[float], threads: int) -> Latency:
        arr = np.asarray(samples, dtype=np.float64)
        p50, p90, p99 = (float(x) for x in np.percentile(arr, [50, 90, 99]))
        return Latency(float(arr.mean()), p50, p90, p99, int(threads), tuple(float(s) for s in arr))

    def as_report(self) -> dict[str, Any]:
        """The latency as the report stores it (the samples left out)."""
        return {"mean": self.mean, "median": self.median, "p90": self.p90, "p99": self.p99,
                "threads": self.threads, "runs": self.runs}


def time_calls(
    call: Callable[[], Any],
    *,
    runs: int | None = None,
    warmup_calls: int = WARMUP_CALLS,
    warmup_secs: float = WARMUP_SECS,
    budget_secs: float = BUDGET_SECS,
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
        if runs is None and len(samples) >= MIN_RUNS and t1 >= deadline:
            break
    return samples
