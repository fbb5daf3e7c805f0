"""Ranking quality of a cost model's scores against measured costs (Ansor paper §7.5).

Both metrics compare programs of one group (tuning task) only: costs of different tasks are not
comparable. Programs whose measurement failed (infinite cost) are dropped first: a failure has
no rank to predict. Scores are "higher = faster"; costs are seconds, "lower = faster".
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import ArrayLike


def pairwise_accuracy(
    pred_scores: ArrayLike, true_costs: ArrayLike, *, max_pairs: int = 1_000_000, seed: int = 0
) -> float:
    """Fraction of pairs with different costs whose scores order them correctly.

    A pair (i, j) with cost_i < cost_j is correct when score_i > score_j; a tie in score counts
    as half correct, so a constant predictor scores 0.5 (chance). Every pair is checked when
    there are at most ``max_pairs``; otherwise ``max_pairs`` pairs are drawn with a generator
    seeded by ``seed`` (deterministic). NaN when no pair has different finite costs.
    """
    scores, costs = _finite(pred_scores, true_costs)
    n = len(costs)
    if n * (n - 1) // 2 <= max_pairs:
        i, j = np.triu_indices(n, k=1)
    else:
        rng = np.random.default_rng(seed)
        i, j = rng.integers(0, n, size=(2, max_pairs))
    different = costs[i] != costs[j]
    i, j = i[different], j[different]
    if not len(i):
        return math.nan
    i_faster = costs[i] < costs[j]
    i_higher = scores[i] > scores[j]
    i_lower = scores[i] < scores[j]
    correct = np.where(i_faster, i_higher, i_lower) + 0.5 * (~i_higher & ~i_lower)
    return float(np.mean(correct))


def recall_at_k(pred_scores: ArrayLike, true_costs: ArrayLike, k: int) -> float:
    """|top-k programs by score ∩ top-k programs by cost| / k.

    Ties are broken by position (stable sort), so the result is deterministic. When fewer than
    ``k`` programs have a finite cost, k shrinks to their number (so a perfect ranking still
    gives 1.0); NaN when none has.
    """
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    scores, costs = _finite(pred_scores, true_costs)
    k = min(k, len(costs))
    if k == 0:
        return math.nan
    by_score = np.argsort(-scores, kind="stable")[:k]
    by_cost = np.argsort(costs, kind="stable")[:k]
    return len(np.intersect1d(by_score, by_cost)) / k


def _finite(pred_scores: ArrayLike, true_costs: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    scores = np.asarray(pred_scores, dtype=np.float64).ravel()
    costs = np.asarray(true_costs, dtype=np.float64).ravel()
    if scores.shape != costs.shape:
        raise ValueError(f"{len(scores)} scores for {len(costs)} costs")
    measured = np.isfinite(costs)
    return scores[measured], costs[measured]
