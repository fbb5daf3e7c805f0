"""Ansor's learned cost model: gradient-boosted trees with a "pack-sum" objective.

Ansor paper §5.2 and appendix B; TVM ``auto_scheduler/cost_model/xgb_model.py`` and
MetaSchedule ``cost_model/xgb_model.py``.

The model
    A tree ensemble f predicts one value per feature row (per innermost store); the score of a
    program P is the sum over its rows, ``score(P) = sum_{s in P} f(s)``. The training label of
    a measured program is its normalised throughput within its group (tuning task),
    ``y = min_cost(group) / cost`` in (0, 1], 0 for a failed measurement. The loss is

        L = sum_P  w_P * (score(P) - y_P)^2,   w_P = max(y_P, XGBConfig.min_weight)

    The paper weighs each program by y ("loss weighted by normalised throughput"), so the model
    is most accurate on the fast programs the search is after. With w = y alone a failed
    program (y = 0) would carry no weight and the model would never learn that it is bad, so
    every weight is floored at ``min_weight`` (0.05 by default: a failed or very slow program
    counts like a program at 5% of the best throughput). Ansor reaches a similar end by giving
    failed programs a cost of 1e10.

Map of this module
    `XGBConfig`            hyperparameters (one comment per field).
    `XGBCostModel`         the `CostModel`: ``update`` appends to the history and retrains when
                           due (`_should_train`), ``predict`` stacks rows, runs the booster once
                           and sums per program; ``save``/``load`` use one ``.npz`` file.
    `_History`             every measured program, rows stacked in growing arrays so retraining
                           never restacks per program in Python.
    `normalized_throughputs`, `pack_sum`, `pack_sum_loss`, `pack_sum_gradient`,
    `weighted_p_rmse`      the objective and metric, pure numpy (tested against finite
                           differences).

XGBoost has no incremental training, so each training starts from scratch on the whole
history; labels are recomputed each time because min_cost(group) falls as better programs are
found. Early stopping watches the weighted p-rmse on the training set itself, as Ansor does.

Transfer (tune on one device, then another)
    `transferred(label)` gives a model for a new device (class) that starts from this one:
    the same trees, so its first batch is already ranked, and this model's history kept as
    *prior* programs (their groups renamed `label/<group>`, so their labels stay normalised
    among themselves). Once the new device's own measurements arrive it retrains on both,
    a prior program's loss weight multiplied by ``s / (s + n_own)``, where n_own is the
    number of the new device's own programs and s is ``XGBConfig.prior_strength``: at first
    the prior data counts fully, after s own programs half as much, and it fades as the new
    device's data grows. The features describe programs, not machines, so what was learnt
    about which loop structures run fast carries over; the weights let the new device's
    own timings overrule it where the machines differ.

Base (a pretrained model under the device's own trees)
    A model may carry `BaseTrees` (`base_trees.py`): trees trained across many tasks and
    device classes (`pretrain.py`) on rows with a device descriptor appended. Such a model
    scores with the base from the start (no random warm-up), and its own trees are
    trained on the residual: each row's base value is its XGBoost ``base_margin``, so the
    pack-sum objective above sees base + own and the own trees correct the base where the
    device's measurements disagree. The device's own data takes over as it arrives: the
    base counts ``s / (s + m)`` (`base_weight`) in training and scoring, m the own programs
    per task measured so far and s ``XGBConfig.prior_strength`` (in full before the first
    training; half after s programs of each task). Per task, not per model, so that a model
    tuned over a hundred tasks keeps its prior while each task has few programs. The base
    values of a program's rows are computed once,
    when it enters the history, with the descriptor of the device it was measured on (a
    transferred model's prior programs keep theirs). Without a base nothing of this applies:
    own trees on plain rows, random scores during warm-up, as before.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Self

import numpy as np
import xgboost as xgb

from .base import INVALID_SCORE, CostModel, check_update_args, program_row_counts
from .base_trees import BaseTrees
from .random_model import RandomCostModel

logger = logging.getLogger(__name__)

ADAPTIVE_TRAINING_RATIO = 0.2
"""With adaptive training, retrain once the programs added since the last training number at
least this fraction of the programs that training used (MetaSchedule's rule)."""

HESSIAN_FLOOR = 1e-6
"""Smallest per-row hessian handed to XGBoost, which divides by hessian sums."""

OBJECTIVES = ("rank", "pack_sum")
"""What `XGBConfig.objective` may say."""

RANK_MAX_PAIRS = 4096
"""Pairs per task the "rank" objective draws at most (`ranking.ranking_pairs`)."""

_FORMAT = "tunefarm-xgb-cost-model/1"


@dataclass(frozen=True, kw_only=True)
class XGBConfig:
    """Hyperparameters of `XGBCostModel`. Tree parameters are Ansor's (TVM v0.13 `auto_scheduler/cost_model/xgb_model.py`)."""

    max_depth: int = 10  # deepest tree; deep trees fit the interactions between features
    # Smallest loss reduction a split must bring. Once no split does, the training p-rmse
    # stalls and early stopping ends training (after 15-30 trees on our synthetic tests).
    gamma: float = 0.001
    min_child_weight: float = 0.0  # smallest hessian sum in a leaf; 0 lets leaves hold one row
    eta: float = 0.2  # learning rate: shrinks each new tree's contribution
    seed: int = 43  # seeds XGBoost and the random scores given during warm-up
    # One thread: the search runs beside the measurements on a 2-core machine, and a trainer
    # using both cores would slow the search and disturb the timings of the kernels measured
    # at the same time. Retraining on a few thousand rows gains little from threads anyway.
    nthread: int = 1
    # Histogram bins per feature. Split finding costs nodes x features x bins, and trees of
    # depth 10 have up to 1023 nodes, so 64 bins (XGBoost's default is 256) keep retraining
    # fast; most features are log-scaled counts with few distinct values.
    max_bin: int = 64
    num_boost_round: int = 300  # cap on the number of trees (Ansor: 10000; early stopping ends far sooner)
    # Stop when the training p-rmse has not improved for this many trees (the trees after
    # the best are dropped). 10 rather than Ansor's 50: on a detector's 1500 programs (105
    # tasks) the 5-fold held-out pairwise accuracy was 0.8509 with either, and retraining
    # took half the time (the 50 extra trees were most of it).
    early_stopping_rounds: int = 10
    num_warmup_samples: int = 64  # below this many programs, predict gives random scores
    adaptive_training: bool = True  # retrain only when the new data is >= 20% of the last training
    min_weight: float = 0.05  # floor of the loss weight w = max(y, min_weight); see module doc
    # Labels relative to each group's (task's) best, as Ansor: what carries across tasks is
    # how close a program comes to the best of its own task, not its seconds, which
    # differ by orders of magnitude between tasks. False: relative to the best program
    # of all groups (only to measure what the per-task labels bring; the "rank" objective
    # compares programs of one task only, whatever the labels).
    labels_per_group: bool = True
    # A transferred (prior) program weighs prior_strength / (prior_strength + own programs)
    # of an own one (module doc, "Transfer"): 1 before the first own measurement, 1/2 after
    # prior_strength of them. One batch's worth: `tunefarm bench transfer` (haswell to
    # x86-64-v2, 64 trials, 2 seeds) reached the cold run's best in 0.80x its trials with
    # 64 and 0.53x with 16, where the two ISAs' best programs differ.
    prior_strength: float = 16.0
    # What the trees are trained for: "rank" (`ranking.py`: the order of each task's
    # programs, the scores then mapped onto the throughputs by `ranking.affine_fit`, since
    # evolution picks parents in proportion to them) or "pack_sum" (Ansor's weighted squared
    # error on the normalised throughputs). Rank won on held-out programs: ranking each round
    # of a search with a model of the rounds before it (`bench ops`' rolling score), pairwise
    # 0.632 against 0.572 (mean of 11 record files: GEMMs, convolutions, a softmax, BERT's 11
    # tasks), and 5-fold 0.821 against 0.807; cold 128-trial tunings of a GEMM 1024, a 3x3
    # convolution and a 128x768x768 matmul, 2 seeds each, ended 1.015x faster (geomean).
    objective: str = "rank"

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective {self.objective!r}: choose one of {', '.join(OBJECTIVES)}")

    def xgb_params(self) -> dict[str, Any]:
        """The parameter dict for ``xgboost.train``."""
        return {
            "max_depth": self.max_depth,
            "gamma": self.gamma,
            "min_child_weight": self.min_child_weight,
            "eta": self.eta,
            "seed": self.seed,
            "nthread": self.nthread,
            "max_bin": self.max_bin,
            "tree_method": "hist",
            # Rows start from 0 so an empty ensemble scores every program 0.
            "base_score": 0.0,
            # Only our p-rmse is evaluated (and drives early stopping).
            "disable_default_eval_metric": 1,
            "verbosity": 0,
        }


@dataclass(frozen=True)
class TrainingStats:
    """What the latest retraining did, for logs and benchmark reports."""

    num_programs: int  # programs in the history at training time
    num_rows: int  # feature rows trained on
    num_trees: int  # trees kept (up to the best early-stopping round)
    train_loss: float  # the objective's metric on the training set at the best round (p-rmse or rank loss)
    seconds: float  # wall time of the retraining


# --- objective and metric (pure numpy) -------------------------------------------------------


def normalized_throughputs(
    costs: np.ndarray, group_ids: np.ndarray, num_groups: int, *, per_group: bool = True
) -> np.ndarray:
    """Label of each program: min_cost(its group) / its cost, in (0, 1]; 0 for an inf cost.
    Without `per_group`, the minimum is over all programs."""
    best = np.full(num_groups, np.inf)
    np.minimum.at(best, group_ids, costs)
    if not per_group:
        best[:] = best.min(initial=np.inf)
    finite = np.isfinite(costs)
    y = np.zeros(len(costs))
    y[finite] = best[group_ids[finite]] / costs[finite]
    return y


def pack_sum(row_values: np.ndarray, row_program: np.ndarray, num_programs: int) -> np.ndarray:
    """Sum of the row values of each program (0 for a program without rows)."""
    return np.bincount(row_program, weights=row_values, minlength=num_programs)


def pack_sum_loss(row_preds: np.ndarray, row_program: np.ndarray, y: np.ndarray, w: np.ndarray) -> float:
    """L = sum_P w_P * (sum of P's row predictions - y_P)^2."""
    residual = pack_sum(row_preds, row_program, len(y)) - y
    return float(np.sum(w * residual**2))


def pack_sum_gradient(
    row_preds: np.ndarray, row_program: np.ndarray, y: np.ndarray, w: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per-row gradient and hessian of `pack_sum_loss`, the XGBoost custom objective.

    dL/d(row r of P) = 2 w_P (score(P) - y_P), the same for every row of P. The exact hessian
    couples all rows of a program (2 w_P for every pair); XGBoost takes a diagonal, so each row
    gets 2 w_P (floored at `HESSIAN_FLOOR`), as in Ansor.
    """
    residual = pack_sum(row_preds, row_program, len(y)) - y
    grad = 2.0 * w * residual
    hess = np.maximum(2.0 * w, HESSIAN_FLOOR)
    return grad[row_program], hess[row_program]


def prior_weight(own_programs: int, strength: float) -> float:
    """The factor of a prior (transferred) program's loss weight once the device has
    `own_programs` of its own: strength / (strength + own_programs)."""
    return strength / (strength + own_programs) if strength > 0 else 0.0


def base_weight(own_per_task: float, strength: float) -> float:
    """How much a pretrained base counts once there are `own_per_task` own programs per
    task (module doc, "Base"): strength / (strength + own_per_task)."""
    return strength / (strength + own_per_task) if strength > 0 else 0.0


def weighted_p_rmse(row_preds: np.ndarray, row_program: np.ndarray, y: np.ndarray, w: np.ndarray) -> float:
    """sqrt(sum_P w_P (score(P) - y_P)^2 / sum_P w_P): the early-stopping metric ("p-rmse")."""
    return float(np.sqrt(pack_sum_loss(row_preds, row_program, y, w) / np.sum(w)))


# --- history ---------------------------------------------------------------------------------


class _GrowingArray:
    """An array grown along axis 0 with amortised O(1) appends (capacity doubles)."""

    def __init__(self, row_shape: tuple[int, ...], dtype: type) -> None:
        self._data = np.empty((0, *row_shape), dtype=dtype)
        self._size = 0

    def extend(self, values: np.ndarray) -> None:
        end = self._size + len(values)
        if end > len(self._data):
            grown = np.empty((max(end, 2 * len(self._data), 64), *self._data.shape[1:]), self._data.dtype)
            grown[: self._size] = self._data[: self._size]
            self._data = grown
        self._data[self._size : end] = values
        self._size = end

    def view(self) -> np.ndarray:
        """The filled part (C-contiguous, no copy); invalidated by the next `extend`."""
        return self._data[: self._size]


@dataclass(frozen=True)
class _TrainingData:
    rows: np.ndarray  # (R, F) float32, rows of the programs that have rows
    row_program: np.ndarray  # (R,) index of each row's program in y / w
    y: np.ndarray  # normalised throughput per program with rows
    w: np.ndarray  # loss weight per program with rows (prior programs' scaled down)
    margins: np.ndarray | None = None  # (R,) each row's base value (None: the model has no base)
    group_ids: np.ndarray | None = None  # group (task) per program with rows


class _History:
    """Every program passed to `update`: rows, row -> program index, cost and group."""

    def __init__(self) -> None:
        self.num_features: int | None = None  # F, fixed by the first program with rows
        self._rows: _GrowingArray | None = None  # created once F is known
        self._row_program = _GrowingArray((), np.int64)
        self._row_counts = _GrowingArray((), np.int64)
        self._costs = _GrowingArray((), np.float64)
        self._group_ids = _GrowingArray((), np.int64)
        self._prior = _GrowingArray((), np.bool_)  # transferred from another device's model
        self._margins: _GrowingArray | None = None  # each row's base value; None without a base
        self.group_names: list[str] = []
        self._group_index: dict[str, int] = {}

    @property
    def num_programs(self) -> int:
        return len(self._costs.view())

    @property
    def num_prior(self) -> int:
        return int(np.count_nonzero(self._prior.view()))

    @property
    def num_rows(self) -> int:
        return len(self._row_program.view())

    def own_programs_per_task(self) -> float:
        """Own (not prior) programs over the tasks (groups) they belong to; 0 with none."""
        own = ~self._prior.view()
        tasks = len(np.unique(self._group_ids.view()[own]))
        return int(np.count_nonzero(own)) / tasks if tasks else 0.0

    def append(
        self,
        features: Sequence[np.ndarray],
        costs: np.ndarray,
        groups: Sequence[str],
        base: BaseTrees | None = None,
    ) -> None:
        """Add programs; with `base`, their rows' base values (`BaseTrees.row_values`) too."""
        counts = program_row_counts(features)
        rows = self.stack_rows(features, counts)
        start = self.num_programs
        if base is not None:
            local = np.repeat(np.arange(len(counts)), counts)
            self._extend_margins(base.row_values(rows, local, counts))
        elif self._margins is not None:
            self._margins.extend(np.zeros(rows.shape[0], np.float32))
        if rows.shape[0]:
            if self._rows is None:
                self._rows = _GrowingArray(rows.shape[1:], np.float32)
            self._rows.extend(rows)
        self._row_program.extend(np.repeat(np.arange(start, start + len(counts)), counts))
        self._row_counts.extend(counts)
        self._costs.extend(costs)
        self._group_ids.extend(np.array([self._group_id(g) for g in groups], dtype=np.int64))
        self._prior.extend(np.zeros(len(counts), dtype=np.bool_))

    def _extend_margins(self, values: np.ndarray) -> None:
        if self._margins is None:  # rows that came before any base have none
            self._margins = _GrowingArray((), np.float32)
            self._margins.extend(np.zeros(self.num_rows, np.float32))
        self._margins.extend(values)

    def stack_rows(self, features: Sequence[np.ndarray], counts: np.ndarray) -> np.ndarray:
        """Rows of all programs with rows, stacked as one (R, F) float32 array.

        The first program with rows fixes F; any other width raises ValueError.
        """
        matrices = [f for f, n in zip(features, counts, strict=True) if n]
        if not matrices:
            return np.empty((0, self.num_features or 0), dtype=np.float32)
        if any(np.ndim(m) != 2 for m in matrices):
            raise ValueError("each program's features must be a 2-D (n_stores, F) matrix")
        rows = np.concatenate(matrices, axis=0, dtype=np.float32)
        if self.num_features is None:
            self.num_features = rows.shape[1]
        if rows.shape[1] != self.num_features:
            raise ValueError(f"feature width {rows.shape[1]} differs from the model's {self.num_features}")
        return rows

    def training_data(self, min_weight: float, prior_strength: float, per_group: bool = True) -> _TrainingData:
        """Rows and freshly computed labels and weights of every program that has rows."""
        costs = self._costs.view()
        y = normalized_throughputs(costs, self._group_ids.view(), len(self.group_names), per_group=per_group)
        w = np.maximum(y, min_weight)
        prior = self._prior.view()
        if prior.any():
            own = len(prior) - int(np.count_nonzero(prior))
            w = np.where(prior, w * prior_weight(own, prior_strength), w)
        has_rows = self._row_counts.view() > 0
        # Renumber programs so that programs without rows (no loss term) drop out.
        new_index = np.cumsum(has_rows) - 1
        rows = self._rows.view() if self._rows is not None else np.empty((0, 0), np.float32)
        margins = self._margins.view() if self._margins is not None else None
        return _TrainingData(rows, new_index[self._row_program.view()], y[has_rows], w[has_rows], margins,
                             self._group_ids.view()[has_rows])  # fmt: skip

    def arrays(self) -> dict[str, np.ndarray]:
        """The history as plain arrays (for saving)."""
        rows = self._rows.view() if self._rows is not None else np.empty((0, 0), np.float32)
        arrays = {
            "rows": rows,
            "row_counts": self._row_counts.view(),
            "costs": self._costs.view(),
            "group_ids": self._group_ids.view(),
            "group_names": np.array(self.group_names, dtype=str),
            "prior": self._prior.view(),
        }
        if self._margins is not None:
            arrays["margins"] = self._margins.view()
        return arrays

    def keep_last(self, n: int) -> _History:
        """The history of the latest `n` programs only (group names all kept)."""
        if self.num_programs <= n:
            return self
        arrays = self.arrays()
        start = self.num_programs - n
        first_row = int(arrays["row_counts"][:start].sum())
        kept = {key: arrays[key][start:] for key in ("row_counts", "costs", "group_ids", "prior")}
        kept["rows"] = arrays["rows"][first_row:] if arrays["rows"].size else arrays["rows"]
        if "margins" in arrays:
            kept["margins"] = arrays["margins"][first_row:]
        kept["group_names"] = arrays["group_names"]
        return _History.from_arrays(kept, self.num_features)

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], num_features: int | None) -> _History:
        history = cls()
        history.num_features = num_features
        if arrays["rows"].shape[0]:
            history._rows = _GrowingArray(arrays["rows"].shape[1:], np.float32)
            history._rows.extend(arrays["rows"])
        counts = arrays["row_counts"]
        history._row_program.extend(np.repeat(np.arange(len(counts)), counts))
        history._row_counts.extend(counts)
        history._costs.extend(arrays["costs"])
        history._group_ids.extend(arrays["group_ids"])
        history._prior.extend(arrays.get("prior", np.zeros(len(counts), dtype=np.bool_)))
        if "margins" in arrays:
            history._margins = _GrowingArray((), np.float32)
            history._margins.extend(arrays["margins"])
        history.group_names = [str(name) for name in arrays["group_names"]]
        history._group_index = {name: i for i, name in enumerate(history.group_names)}
        return history

    def as_prior(self, label: str) -> _History:
        """A copy whose programs are all prior ones, their groups renamed `label/<group>`."""
        arrays = self.arrays()
        arrays["group_names"] = np.array([f"{label}/{g}" for g in self.group_names], dtype=str)
        arrays["prior"] = np.ones(self.num_programs, dtype=np.bool_)
        return _History.from_arrays(arrays, self.num_features)

    def _group_id(self, group: str) -> int:
        index = self._group_index.get(group)
        if index is None:
            index = self._group_index[group] = len(self.group_names)
            self.group_names.append(group)
        return index


# --- the model -------------------------------------------------------------------------------


class XGBCostModel(CostModel):
    """Ansor's pack-sum XGBoost model; random scores until `num_warmup_samples` programs,
    unless it has a `base` (module doc, "Base"): then the base's scores."""

    def __init__(self, config: XGBConfig | None = None, *, base: BaseTrees | None = None) -> None:
        self._config = config or XGBConfig()
        self._history = _History()
        self._random = RandomCostModel(self._config.seed)  # answers during warm-up
        self._base = base
        self._base_weight = 1.0  # how much the base counts (module doc, "Base"), set at training
        self._booster: xgb.Booster | None = None
        # (a, b): the scores are a * pack-sum + b; (1, 0) but for the "rank" objective
        self._calibration = (1.0, 0.0)
        self._trained_on = 0
        self._last_training: TrainingStats | None = None
        # What the owner wants kept with the model (JSON-serialisable), e.g. the feature
        # version and target the programs were described and measured with.
        self.metadata: dict[str, Any] = {}

    @property
    def config(self) -> XGBConfig:
        return self._config

    @property
    def num_samples(self) -> int:
        return self._history.num_programs

    @property
    def feature_width(self) -> int | None:
        """Columns of the feature rows it learned from (None before any)."""
        return self._history.num_features

    @property
    def trained_on(self) -> int:
        """Programs the current own trees were trained on; 0 before any (predictions are
        then random, or the base's)."""
        return self._trained_on

    @property
    def ranks(self) -> bool:
        """Own trees trained, or a base to score with from the start."""
        return self._trained_on > 0 or self._base is not None

    @property
    def base_weight(self) -> float:
        """How much its base counts in its scores (module doc, "Base"): 1 until its own
        trees are first trained, then s / (s + own programs per task) of that training."""
        return self._base_weight

    @property
    def base(self) -> BaseTrees | None:
        """The pretrained trees under its own ones (module doc, "Base"), or None."""
        return self._base

    @property
    def num_prior(self) -> int:
        """Programs of the history transferred from another device's model (`transferred`)."""
        return self._history.num_prior

    def transferred(self, label: str, descriptor: np.ndarray | None = None) -> XGBCostModel:
        """A model for another device that starts from this one (module doc, "Transfer"):
        this one's trees and, as prior programs under groups `label/...`, its history.
        Its base, if it has one, is kept, scoring for the device `descriptor` describes
        (the prior programs keep the base values of the device they were measured on)."""
        base = self._base
        if base is not None and descriptor is not None:
            base = base.with_descriptor(descriptor)
        model = type(self)(self._config, base=base)
        model._history = self._history.as_prior(label)
        if self._booster is not None:
            model._booster = xgb.Booster(model_file=bytearray(self._booster.save_raw("ubj")))
            model._booster.set_param({"nthread": self._config.nthread})
            model._calibration = self._calibration
        model._trained_on = self._trained_on
        return model

    @property
    def last_training(self) -> TrainingStats | None:
        """Statistics of the latest retraining in this process (None if none happened)."""
        return self._last_training

    @property
    def num_features(self) -> int | None:
        """Width of the feature rows it was given (None before the first program with rows)."""
        return self._history.num_features

    def trim_history(self, max_programs: int) -> None:
        """Forget all but the latest `max_programs` programs, so that retraining on the
        history stays bounded; the current trees are kept until the next retraining."""
        self._history = self._history.keep_last(max_programs)
        self._trained_on = min(self._trained_on, self._history.num_programs)

    def update(
        self, features: Sequence[np.ndarray], costs: Sequence[float], groups: Sequence[str], *, train: bool = True
    ) -> None:
        """Record the batch, then (with `train`) retrain from scratch on the whole history if due."""
        cost_array = check_update_args(features, costs, groups)
        if len(features):
            self._history.append(features, cost_array, groups, self._base)
        if train and self._trained_on < self._history.num_programs and self._should_train():
            self._train()

    def predict(self, features: Sequence[np.ndarray]) -> np.ndarray:
        """Sum of per-row predictions per program, one booster call (and one of the base's,
        if it has one) for the whole batch."""
        if self._booster is None and self._base is None:
            return self._random.predict(features)
        counts = program_row_counts(features)
        rows = self._history.stack_rows(features, counts)
        scores = np.full(len(features), INVALID_SCORE)
        if rows.shape[0]:
            program = np.repeat(np.arange(len(counts)), counts)
            row_preds = np.zeros(rows.shape[0], np.float64)
            if self._base is not None:
                row_preds += self._base_weight * self._base.row_values(rows, program, counts)
            if self._booster is not None:
                row_preds += self._booster.inplace_predict(rows)
            valid = counts > 0
            a, b = self._calibration
            scores[valid] = a * pack_sum(row_preds, program, len(counts))[valid] + b
        return scores

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write one ``.npz`` file (no pickles): the config as JSON, the trees in XGBoost's UBJSON
        format, the whole history (rows, row counts, costs, groups) and the warm-up generator
        state. The file is replaced atomically; ``path`` is used as given (no suffix added).
        """
        arrays = self._history.arrays()
        state = {
            "format": _FORMAT,
            "config": dataclasses.asdict(self._config),
            "num_features": self._history.num_features,
            "trained_on": self._trained_on,
            "base_weight": self._base_weight,
            "calibration": list(self._calibration),
            "rng_state": self._random.rng_state(),
            "metadata": self.metadata,
        }
        booster = np.empty(0, np.uint8)
        if self._booster is not None:
            booster = np.frombuffer(self._booster.save_raw("ubj"), np.uint8)
        if self._base is not None:
            state["base"] = self._base.state()
            arrays["base_trees"] = self._base.tree_bytes()
        directory = os.path.dirname(os.path.abspath(path))
        with tempfile.NamedTemporaryFile(dir=directory, suffix=".tmp", delete=False) as f:
            try:
                np.savez(f, state=np.array(json.dumps(state)), booster=booster, **arrays)
            except BaseException:
                f.close()
                os.unlink(f.name)
                raise
        os.replace(f.name, path)

    @staticmethod
    def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
        """The `metadata` of a saved model, without loading its trees and history."""
        with np.load(path, allow_pickle=False) as data:
            state = json.loads(str(data["state"]))
        if state.get("format") != _FORMAT:
            raise ValueError(f"{os.fspath(path)} is not a saved XGBCostModel")
        return dict(state.get("metadata") or {})

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Self:
        with np.load(path, allow_pickle=False) as data:
            arrays = {key: data[key] for key in data.files}
        state = json.loads(str(arrays.pop("state")))
        if state.get("format") != _FORMAT:
            raise ValueError(f"{os.fspath(path)} is not a saved XGBCostModel")
        base_trees = arrays.pop("base_trees", None)
        config = XGBConfig(**state["config"])
        base = None
        if state.get("base") is not None and base_trees is not None:
            base = BaseTrees.from_saved(state["base"], base_trees, config.nthread)
        model = cls(config, base=base)
        model._history = _History.from_arrays(arrays, state["num_features"])
        model._random.set_rng_state(state["rng_state"])
        model._trained_on = int(state["trained_on"])
        model._base_weight = float(state.get("base_weight", 1.0))
        a, b = state.get("calibration", (1.0, 0.0))
        model._calibration = (float(a), float(b))
        model.metadata = dict(state.get("metadata") or {})
        booster_bytes = arrays["booster"]
        if booster_bytes.size:
            model._booster = xgb.Booster(model_file=bytearray(booster_bytes.tobytes()))
            model._booster.set_param({"nthread": model._config.nthread})
        return model

    def _should_train(self) -> bool:
        n = self._history.num_programs
        if n < self._config.num_warmup_samples:
            return False
        if self._booster is None or not self._config.adaptive_training:
            return True  # going past warm-up, or retraining after every batch
        return n - self._trained_on >= ADAPTIVE_TRAINING_RATIO * self._trained_on

    def _objective(self, data: _TrainingData):
        """XGBoost's custom objective and metric for `XGBConfig.objective` ("rank" falls back
        to pack-sum while no two programs of a task differ beyond the noise)."""
        if self._config.objective == "rank":
            from .metrics import NOISE_FLOOR
            from .ranking import rank_objective, ranking_pairs

            pairs = ranking_pairs(data.y, data.group_ids, floor=NOISE_FLOOR, max_pairs=RANK_MAX_PAIRS,
                                  seed=self._config.seed)  # fmt: skip
            if len(pairs.weight):
                return rank_objective(data.row_program, len(data.y), pairs)

        def objective(row_preds: np.ndarray, _: xgb.DMatrix) -> tuple[np.ndarray, np.ndarray]:
            return pack_sum_gradient(row_preds, data.row_program, data.y, data.w)

        def metric(row_preds: np.ndarray, _: xgb.DMatrix) -> tuple[str, float]:
            return "p-rmse", weighted_p_rmse(row_preds, data.row_program, data.y, data.w)

        return objective, metric

    def _fit_calibration(self, data: _TrainingData, margins: np.ndarray | None) -> tuple[float, float]:
        """The map of the trained scores onto the training programs' throughputs ("rank");
        (1, 0) for pack-sum, whose scores are throughputs already."""
        if self._config.objective != "rank":
            return 1.0, 0.0
        from .ranking import affine_fit

        row_preds = self._booster.inplace_predict(data.rows).astype(np.float64)
        if margins is not None:
            row_preds += margins
        return affine_fit(pack_sum(row_preds, data.row_program, len(data.y)), data.y, data.w)

    def _train(self) -> None:
        start = time.perf_counter()
        data = self._history.training_data(
            self._config.min_weight, self._config.prior_strength, self._config.labels_per_group
        )
        if not data.rows.shape[0]:
            return  # only invalid programs so far: nothing to learn from

        objective, metric = self._objective(data)
        margins = data.margins
        if margins is not None:
            weight = base_weight(self._history.own_programs_per_task(), self._config.prior_strength)
            margins = margins * np.float32(weight)
        dtrain = xgb.DMatrix(data.rows, base_margin=margins, nthread=self._config.nthread)
        booster = xgb.train(
            self._config.xgb_params(),
            dtrain,
            num_boost_round=self._config.num_boost_round,
            evals=[(dtrain, "tr")],
            obj=objective,
            custom_metric=metric,
            early_stopping_rounds=self._config.early_stopping_rounds,
            verbose_eval=False,
        )
        # Keep the trees up to the best round only, so prediction and the saved file agree.
        best = booster.best_iteration
        self._booster = booster[: best + 1]
        self._booster.set_param({"nthread": self._config.nthread})
        self._calibration = self._fit_calibration(data, margins)
        if margins is not None:
            self._base_weight = weight
        self._trained_on = self._history.num_programs
        self._last_training = TrainingStats(
            num_programs=self._trained_on,
            num_rows=int(data.rows.shape[0]),
            num_trees=best + 1,
            train_loss=float(booster.best_score),
            seconds=time.perf_counter() - start,
        )
        logger.info("cost model retrained: %s", self._last_training)
