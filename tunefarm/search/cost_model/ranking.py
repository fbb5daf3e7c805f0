"""A pairwise ranking objective for pack-sum trees (LambdaRank-style, as TLP trains with).

The search only needs the order of the programs of one task, not their throughput. The
ranking loss says so directly: for every pair (i, j) of programs of one group where i is
faster beyond the measurement noise,

    L = sum_pairs  w_ij * log(1 + exp(-(score_i - score_j))),   w_ij = |y_i - y_j|

with score = pack-sum of the row predictions and y the normalised throughputs. The pair
weight is LambdaRank's idea without its position discount: swapping a fast program with a
slow one costs more than swapping two slow ones (a failed program has y = 0). Without the
discount the loss is a fixed function of the scores, so its gradient is exact (tested
against finite differences).

Pairs are drawn once per training (`ranking_pairs`): every pair of a group when it has at
most `max_pairs` of them, else `max_pairs` drawn with a seeded generator, so a large
group does not drown the others and training is deterministic. A pair whose costs differ
by less than the noise (`|ln y_i - ln y_j| <= max(floor, hypot(noise_i, noise_j))`, as
`metrics.pairwise_beyond_noise`) is no pair: no measurement says which is faster.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .xgb import HESSIAN_FLOOR, pack_sum


@dataclass(frozen=True)
class Pairs:
    """Ordered pairs of programs: `better[k]` is faster than `worse[k]`, weighing `weight[k]`."""

    better: np.ndarray  # int64 program indices
    worse: np.ndarray
    weight: np.ndarray  # float64


def ranking_pairs(
    y: np.ndarray,
    group_ids: np.ndarray,
    *,
    noise: np.ndarray | None = None,
    floor: float = 0.0,
    max_pairs: int = 4096,
    seed: int = 0,
) -> Pairs:
    """The pairs of the ranking loss (module doc) among programs with labels `y`
    (normalised throughputs, 0 for a failure) in groups `group_ids`."""
    rng = np.random.default_rng(seed)
    y = np.asarray(y, dtype=np.float64)
    spread = np.zeros(len(y)) if noise is None else np.asarray(noise, dtype=np.float64)
    better, worse = [], []
    order = np.argsort(group_ids, kind="stable")
    bounds = np.flatnonzero(np.diff(group_ids[order])) + 1
    for members in np.split(order, bounds):
        n = len(members)
        if n < 2:
            continue
        if n * (n - 1) // 2 <= max_pairs:
            a, b = np.triu_indices(n, k=1)
        else:
            a, b = rng.integers(0, n, size=(2, max_pairs))
            keep = a != b
            a, b = a[keep], b[keep]
        i, j = members[a], members[b]
        with np.errstate(divide="ignore", invalid="ignore"):
            gap = np.abs(np.log(y[i]) - np.log(y[j]))  # inf against a failure, nan for two failures
        beyond = np.nan_to_num(gap, nan=0.0) > np.maximum(floor, np.hypot(spread[i], spread[j]))
        i, j = i[beyond], j[beyond]
        i_better = y[i] > y[j]
        better.append(np.where(i_better, i, j))
        worse.append(np.where(i_better, j, i))
    if not better:
        empty = np.zeros(0, dtype=np.int64)
        return Pairs(empty, empty, np.zeros(0))
    hi, lo = np.concatenate(better).astype(np.int64), np.concatenate(worse).astype(np.int64)
    return Pairs(hi, lo, np.abs(y[hi] - y[lo]))


def pairwise_rank_loss(row_preds: np.ndarray, row_program: np.ndarray, num_programs: int, pairs: Pairs) -> float:
    """L = sum_pairs w * log(1 + exp(-(score_better - score_worse)))."""
    scores = pack_sum(row_preds, row_program, num_programs)
    margin = scores[pairs.better] - scores[pairs.worse]
    return float(np.sum(pairs.weight * np.logaddexp(0.0, -margin)))


def pairwise_rank_gradient(
    row_preds: np.ndarray, row_program: np.ndarray, num_programs: int, pairs: Pairs
) -> tuple[np.ndarray, np.ndarray]:
    """Per-row gradient and (diagonal) hessian of `pairwise_rank_loss`.

    With d = score_better - score_worse, dL/d score_better = -w sigma(-d) and
    dL/d score_worse = +w sigma(-d); d^2L/d score^2 = w sigma(d) sigma(-d) for both. A row's
    are its program's (pack-sum), the hessian floored at `HESSIAN_FLOOR`.
    """
    scores = pack_sum(row_preds, row_program, num_programs)
    margin = scores[pairs.better] - scores[pairs.worse]
    push = pairs.weight / (1.0 + np.exp(np.clip(margin, -50, 50)))  # w * sigma(-d)
    curvature = push / (1.0 + np.exp(-np.clip(margin, -50, 50)))  # w * sigma(-d) * sigma(d)
    grad = np.bincount(pairs.worse, weights=push, minlength=num_programs) - np.bincount(
        pairs.better, weights=push, minlength=num_programs
    )
    hess = np.bincount(pairs.better, weights=curvature, minlength=num_programs) + np.bincount(
        pairs.worse, weights=curvature, minlength=num_programs
    )
    return grad[row_program], np.maximum(hess, HESSIAN_FLOOR)[row_program]


def rank_objective(row_program: np.ndarray, num_programs: int, pairs: Pairs):
    """XGBoost's custom objective and metric (the loss per unit of pair weight) for `pairs`."""
    total = float(pairs.weight.sum())

    def objective(row_preds: np.ndarray, _) -> tuple[np.ndarray, np.ndarray]:
        return pairwise_rank_gradient(row_preds, row_program, num_programs, pairs)

    def metric(row_preds: np.ndarray, _) -> tuple[str, float]:
        return "rank-loss", pairwise_rank_loss(row_preds, row_program, num_programs, pairs) / total

    return objective, metric


def affine_fit(scores: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[float, float]:
    """(a, b) minimising sum w (a * score + b - y)^2, with a > 0 (a map that keeps the
    order); (1, 0) when the scores are all equal."""
    sw = float(np.sum(w))
    mean_s, mean_y = float(np.sum(w * scores)) / sw, float(np.sum(w * y)) / sw
    var = float(np.sum(w * (scores - mean_s) ** 2))
    if var <= 0:
        return 1.0, mean_y - mean_s
    a = float(np.sum(w * (scores - mean_s) * (y - mean_y))) / var
    a = max(a, 1e-6)
    return a, mean_y - a * mean_s
