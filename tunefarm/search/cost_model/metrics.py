"""Ranking quality of a cost model's scores against measured costs (Ansor paper §7.5).

`pairwise_beyond_noise` and `spearman` are what held-out evaluations report: pairs of
programs whose costs differ by less than the measurement noise are not counted.

Both metrics compare programs of one group (tuning task) only: costs of different tasks are not
comparable. Programs whose measurement failed (infinite cost) are dropped first: a failure has
no rank to predict. Scores are "higher = faster"; costs are seconds, "lower = faster".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

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


# --- ranking beyond measurement noise --------------------------------------------------------

NOISE_FLOOR = 0.03
"""Smallest relative cost gap a pair must have to be compared: timings of one kernel on a
shared machine move by a few percent between runs, so a 3% gap is below what a single
measurement can tell apart even when its repeats agree closely."""


@dataclass(frozen=True)
class PairCounts:
    """Pairwise ranking of one group's programs, pairs within the noise left out."""

    correct: float  # pairs ordered right by the scores (a score tie counts half)
    compared: int  # pairs whose costs differ by more than the noise
    dropped: int  # pairs of finite costs within the noise (not compared)

    @property
    def accuracy(self) -> float:
        return self.correct / self.compared if self.compared else math.nan

    def __add__(self, other: PairCounts) -> PairCounts:
        return PairCounts(self.correct + other.correct, self.compared + other.compared, self.dropped + other.dropped)


NO_PAIRS = PairCounts(0.0, 0, 0)


def relative_spread(repeats: Sequence[Sequence[float]]) -> np.ndarray:
    """Each record's measurement noise: the relative standard deviation of its repeated
    timings (sample std over mean; 0 with fewer than two finite repeats)."""
    out = np.zeros(len(repeats))
    for i, costs in enumerate(repeats):
        c = np.asarray(costs, dtype=np.float64)
        c = c[np.isfinite(c) & (c > 0)]
        if len(c) >= 2:
            out[i] = float(np.std(c, ddof=1) / np.mean(c))
    return out


def pairwise_beyond_noise(
    pred_scores: ArrayLike, true_costs: ArrayLike, noise: ArrayLike, *, floor: float = NOISE_FLOOR
) -> PairCounts:
    """Pairwise ranking accuracy with pairs inside the measurement noise dropped.

    A pair (i, j) of finite costs is compared only when its costs differ by more than the
    noise: ``|ln c_i - ln c_j| > max(floor, sqrt(noise_i^2 + noise_j^2))``, where
    ``noise`` is each program's relative spread (`relative_spread` of its repeats) and
    ``floor`` a fixed relative gap (`NOISE_FLOOR`, 3%). Otherwise no measurement says
    which of the two is faster, and counting the pair would reward or punish the model
    for a coin toss. Every pair is enumerated (a held-out fold is small).
    """
    scores = np.asarray(pred_scores, dtype=np.float64).ravel()
    costs = np.asarray(true_costs, dtype=np.float64).ravel()
    spread = np.broadcast_to(np.asarray(noise, dtype=np.float64), costs.shape).ravel()
    if not scores.shape == costs.shape == spread.shape:
        raise ValueError(f"{len(scores)} scores, {len(costs)} costs and {len(spread)} noise values")
    finite = np.isfinite(costs)
    scores, costs, spread = scores[finite], costs[finite], spread[finite]
    i, j = np.triu_indices(len(costs), k=1)
    gap = np.abs(np.log(costs[i]) - np.log(costs[j]))
    within = gap <= np.maximum(floor, np.hypot(spread[i], spread[j]))
    i, j = i[~within], j[~within]
    i_faster = costs[i] < costs[j]
    i_higher = scores[i] > scores[j]
    i_lower = scores[i] < scores[j]
    correct = np.where(i_faster, i_higher, i_lower) + 0.5 * (~i_higher & ~i_lower)
    return PairCounts(float(np.sum(correct)), int(len(i)), int(np.sum(within)))


def spearman(pred_scores: ArrayLike, true_costs: ArrayLike) -> float:
    """Spearman rank correlation of the scores with the speed (1 / cost) of the programs
    with a finite cost: 1 when the scores order them exactly as their costs do. NaN with
    fewer than three such programs or when scores or costs are all equal."""
    scores, costs = _finite(pred_scores, true_costs)
    if len(costs) < 3 or np.all(scores == scores[0]) or np.all(costs == costs[0]):
        return math.nan
    import scipy.stats  # 0.6 s: only where a ranking is scored, not at every process's start

    return float(scipy.stats.spearmanr(scores, -costs).statistic)
