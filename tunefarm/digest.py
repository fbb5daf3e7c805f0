"""Output digests: a small fingerprint of a kernel's outputs.

When a task has a reference, every kernel's output is compared to it in full on the device
(`tunefarm.measure.runner`). When it has none (the unscheduled program did not finish in
time), kernels are checked against each other instead, and shipping whole outputs from a
remote agent would cost too much: the runner returns a digest, the search compares digests.

Layout, per output in order: the sum, the sum of absolute values, then `SAMPLES` elements
at fixed positions (spread over the flattened output; the same positions for every kernel
of the task). All as float64. Two digests agree when every sampled element agrees within
the output check's tolerances and the sums agree within a tolerance scaled by the
absolute sum (float32 rounding differs between schedules of one computation).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

SAMPLES = 16
"""Elements sampled per output."""

RTOL = 1e-3
"""Relative tolerance of an element (the runner's output check uses the same)."""

SUM_RTOL = 1e-3
"""Tolerance of a sum, relative to the output's sum of absolute values."""


def digest(outputs: Sequence[np.ndarray]) -> tuple[float, ...]:
    out: list[float] = []
    for arr in outputs:
        flat = np.asarray(arr).reshape(-1).astype(np.float64)
        out.append(float(flat.sum()) if flat.size else 0.0)
        out.append(float(np.abs(flat).sum()) if flat.size else 0.0)
        idx = sample_positions(flat.size)
        values = flat[idx] if flat.size else np.zeros(SAMPLES)
        out.extend(float(v) for v in values)
    return tuple(out)


def sample_positions(size: int) -> np.ndarray:
    """SAMPLES positions spread evenly over [0, size), the same for every kernel."""
    if size <= 0:
        return np.zeros(SAMPLES, dtype=np.int64)
    return (np.arange(SAMPLES, dtype=np.int64) * 7919 + size // 3) % size


def agree(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether two digests of the same task describe the same outputs (NaN never agrees)."""
    if len(a) != len(b) or not a:
        return False
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if np.isnan(x).any() or np.isnan(y).any():
        return False
    per = 2 + SAMPLES
    for start in range(0, len(x), per):
        sx, sy = x[start : start + per], y[start : start + per]
        abs_sum = max(abs(sx[1]), abs(sy[1]), 1e-30)
        scale = max(1.0, float(np.max(np.abs(sy[2:]), initial=0.0)))
        if abs(sx[0] - sy[0]) > SUM_RTOL * abs_sum + 1e-6:
            return False
        if abs(sx[1] - sy[1]) > SUM_RTOL * abs_sum + 1e-6:
            return False
        if not np.all(np.abs(sx[2:] - sy[2:]) <= 1e-3 * scale + RTOL * np.abs(sy[2:])):
            return False
    return True
