"""Measurements of one program taken as one sample: the cost model's held-out figures and
its pretraining both count a program once, however often it was measured.

    distinct_programs(features, groups)  the measurements of each distinct program (same
                                         group, identical feature matrix), first seen first
    merged_cost(costs, noise)            its median cost and its noise
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def distinct_programs(features: Sequence[np.ndarray], groups: Sequence[str]) -> list[list[int]]:
    """Indices of the measurements of each distinct program, in order of first sight."""
    index: dict[tuple[str, tuple[int, ...], bytes], int] = {}
    members: list[list[int]] = []
    for i, (f, g) in enumerate(zip(features, groups, strict=True)):
        a = np.ascontiguousarray(f)
        key = (g, a.shape, a.tobytes())
        if key not in index:
            index[key] = len(members)
            members.append([])
        members[index[key]].append(i)
    return members


def merged_cost(costs: Sequence[float], noise: Sequence[float]) -> tuple[float, float]:
    """One program's measurements as one: the median of its valid (finite, positive) costs,
    inf when none; its noise, the larger of the relative spread recorded with each
    measurement and the spread between its measurements."""
    valid = [c for c in costs if math.isfinite(c) and c > 0]
    cost = float(np.median(valid)) if valid else math.inf
    between = float(np.std(valid, ddof=1) / np.mean(valid)) if len(valid) > 1 else 0.0
    return cost, max(max(noise, default=0.0), between)
