"""Pretraining a base cost model across tasks and device classes (TenSet-style).

The embedded model starts each device class from nothing; a base trained on what the
project has measured (a `tunefarm dataset` file: one row per measured program) ranks a
new task, or a new class, from its first batch (`base_trees.py`, `XGBCostModel(base=)`).

1. `training_programs(rows)`: the dataset rows of one device family (`device_family`:
   one feature layout) as programs. A group is a device class and a task, so labels are
   normalised per task per class (a program's throughput over the best of its task on its
   class). Each program carries its class's device descriptor (`device_descriptor` of the
   row's target; a target without "num-cores" takes the row's `cores`). A program measured
   twice (same group, identical feature matrix) is one program: the median of its finite
   costs, the larger of its noises and the spread between its measurements.
2. `pretrain(programs, config)`: XGBoost pack-sum trees on the rows with the descriptor
   appended, with one of two objectives (`PretrainConfig.objective`):
   - "squared": today's weighted squared error on normalised throughput (`xgb.py`);
   - "rank": the pairwise ranking loss within groups (`ranking.py`), then one affine map
     onto the label scale (`BaseTrees.scale`/`offset`: the search and the own trees need
     one), fitted by weighted least squares on the training programs.
   Early stopping watches the training loss (as `XGBCostModel` does); `num_boost_round`
   caps the trees, and so the file's size. The base's `info` records what it learnt
   from: the classes (and each one's target), the numbers of programs and tasks, and the
   workloads themselves, by name and by key (`workload_identity`), so that an evaluation
   can tell a held-out workload from one it was trained on (`trained_workloads`).
3. `split_by_workload` / `held_out_workloads`: held-out evaluation is by workload (every
   class's programs of a held-out workload leave training; named by workload name, task
   key or workload key), never by random rows: rows of one search are near twins. `ranking_report` scores held-out programs with their own
   class's descriptor: pairwise accuracy beyond the noise (`metrics.pairwise_beyond_noise`,
   pooled over groups) and recall@k (mean over groups with more than k programs).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import xgboost as xgb

from tunefarm.errors import UsageError
from tunefarm.search.features import feature_width
from tunefarm.search.task import workload_of

from .base_trees import BaseTrees, row_values
from .descriptor import DESCRIPTOR_VERSION, DESCRIPTOR_WIDTH, device_descriptor, device_family
from .distinct_programs import distinct_programs, merged_cost
from .metrics import NO_PAIRS, NOISE_FLOOR, PairCounts, pairwise_beyond_noise, recall_at_k
from .ranking import Pairs, affine_fit, rank_objective, ranking_pairs
from .xgb import normalized_throughputs, pack_sum, pack_sum_gradient, weighted_p_rmse

OBJECTIVES = ("squared", "rank")

RECALL_K = 8
"""k of the reported recall@k (as `tunefarm bench` reports it)."""


class DatasetError(UsageError):
    """Dataset rows that cannot be trained on (none, mixed layouts, malformed)."""


@dataclass(frozen=True)
class PretrainConfig:
    """Hyperparameters of `pretrain`; the tree parameters are `XGBConfig`'s."""

    objective: str = "rank"  # "squared" or "rank" (module doc); rank ranked held-out workloads better
    max_depth: int = 8
    gamma: float = 0.001
    min_child_weight: float = 1.0
    eta: float = 0.2
    max_bin: int = 64
    num_boost_round: int = 200  # cap on the trees (and so on the shipped file's size)
    early_stopping_rounds: int = 20
    min_weight: float = 0.05  # squared objective: floor of the loss weight, as XGBConfig.min_weight
    max_pairs: int = 4096  # rank objective: pairs drawn per group at most
    seed: int = 43
    nthread: int = 1

    def xgb_params(self) -> dict[str, Any]:
        return {
            "max_depth": self.max_depth, "gamma": self.gamma, "min_child_weight": self.min_child_weight,
            "eta": self.eta, "seed": self.seed, "nthread": self.nthread, "max_bin": self.max_bin,
            "tree_method": "hist", "base_score": 0.0, "disable_default_eval_metric": 1, "verbosity": 0,
        }  # fmt: skip


@dataclass(frozen=True)
class TrainingPrograms:
    """Distinct measured programs of one device family, each with its class's descriptor."""

    features: list[np.ndarray]  # (n_stores, F) float32 each
    costs: np.ndarray  # median seconds; inf for a failure
    noise: np.ndarray  # relative spread
    groups: list[str]  # "<class>/<task>"
    classes: list[str]
    workloads: list[str]
    descriptors: np.ndarray  # (P, DESCRIPTOR_WIDTH) float32
    family: str
    feature_version: int
    class_targets: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # class -> its target dict

    def __len__(self) -> int:
        return len(self.features)

    def subset(self, keep: np.ndarray) -> TrainingPrograms:
        index = np.flatnonzero(keep)
        return replace(
            self,
            features=[self.features[i] for i in index], costs=self.costs[index], noise=self.noise[index],
            groups=[self.groups[i] for i in index], classes=[self.classes[i] for i in index],
            workloads=[self.workloads[i] for i in index], descriptors=self.descriptors[index],
        )  # fmt: skip

    def trained_class_targets(self) -> dict[str, dict[str, Any]]:
        """The target of each class the programs were measured on."""
        return {c: dict(self.class_targets[c]) for c in sorted(set(self.classes)) if c in self.class_targets}

    def workload_keys(self) -> list[str]:
        """The identities (`workload_identity`) of the programs' workloads, sorted."""
        return sorted({workload_identity(workload_of(g.split("/", 1)[1])) for g in self.groups})

    def summary(self) -> dict[str, Any]:
        per_class: dict[str, int] = {}
        for c in self.classes:
            per_class[c] = per_class.get(c, 0) + 1
        return {
            "programs": len(self), "tasks": len({g.split("/", 1)[1] for g in self.groups}),
            "workloads": len(set(self.workloads)), "classes": dict(sorted(per_class.items())),
        }  # fmt: skip


def training_programs(rows: Iterable[Mapping[str, Any]], *, family: str | None = None) -> TrainingPrograms:
    """The distinct programs of the dataset rows of `family` (module doc, 1); with no
    family, the one family the rows have. Raises DatasetError."""
    rows = list(rows)
    if not rows:
        raise DatasetError("the dataset has no rows")
    targets: dict[tuple[str, int], dict[str, Any]] = {}
    families: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        try:
            target = _row_target(row, targets)
        except (KeyError, TypeError, ValueError) as exc:
            raise DatasetError(f"a dataset row has no usable target ({type(exc).__name__}: {exc})") from None
        families.setdefault(device_family(target), []).append(row)
    if family is None:
        if len(families) > 1:
            raise DatasetError(f"the dataset holds device families {', '.join(sorted(families))}: choose one")
        family = next(iter(families))
    mine = families.get(family)
    if not mine:
        raise DatasetError(f"the dataset has no row of device family {family!r} (it has {', '.join(sorted(families))})")
    versions = {int(r["feature_version"]) for r in mine}
    if len(versions) != 1:
        raise DatasetError(f"the {family} rows have features of versions {sorted(versions)}: one layout per model")
    version = versions.pop()
    width = feature_width(version)
    descriptors: dict[str, np.ndarray] = {}
    class_targets: dict[str, dict[str, Any]] = {}
    features, groups, costs, noise, row_descriptors = [], [], [], [], []
    for row in mine:
        f = np.asarray(row["features"], dtype=np.float32)
        if f.ndim != 2 or f.shape[1] != width or not f.shape[0]:
            raise DatasetError(f"a row of task {row.get('task')!r} has features of shape {f.shape}, "
                               f"not (stores, {width}) of version {version}")  # fmt: skip
        target = _row_target(row, targets)
        key = json.dumps(target, sort_keys=True)
        if key not in descriptors:
            descriptors[key] = device_descriptor(target)
        class_targets.setdefault(str(row["device_class"]), target)
        features.append(f)
        groups.append(f"{row['device_class']}/{row['task']}")
        costs.append(float(row["cost"]) if row.get("cost") is not None else math.inf)
        noise.append(float(row.get("noise") or 0.0))
        row_descriptors.append(descriptors[key])
    members = distinct_programs(features, groups)
    merged = [merged_cost([costs[i] for i in idx], [noise[i] for i in idx]) for idx in members]
    first = [idx[0] for idx in members]
    return TrainingPrograms(
        features=[features[i] for i in first],
        costs=np.array([c for c, _ in merged]),
        noise=np.array([n for _, n in merged]),
        groups=[groups[i] for i in first],
        classes=[str(mine[i]["device_class"]) for i in first],
        workloads=[str(mine[i]["workload"]) for i in first],
        descriptors=np.stack([row_descriptors[i] for i in first]).astype(np.float32),
        family=family,
        feature_version=version,
        class_targets=class_targets,
    )


def _row_target(row: Mapping[str, Any], cache: dict[tuple[str, int], dict[str, Any]]) -> dict[str, Any]:
    """The row's target dict; "num-cores" from the row's `cores` when the target has none."""
    key = (str(row["target"]), int(row.get("cores") or 0))
    if key not in cache:
        target = json.loads(key[0])
        if not isinstance(target, dict) or "kind" not in target:
            raise ValueError(f"target {key[0]!r} is not a target dict")
        if "num-cores" not in target and key[1] > 0 and target.get("kind") == "llvm":
            target = {**target, "num-cores": key[1]}
        cache[key] = target
    return cache[key]


# --- held-out split --------------------------------------------------------------------------


def held_out_workloads(programs: TrainingPrograms, fraction: float) -> list[str]:
    """About `fraction` of the workloads, chosen by a hash of their names (the same
    workloads for the same dataset, whatever the row order), at least one when
    fraction > 0 and at least one left to train on."""
    names = sorted(set(programs.workloads))
    if fraction <= 0 or len(names) < 2:
        return []
    by_hash = sorted(names, key=lambda n: hashlib.sha1(n.encode()).hexdigest())
    count = min(max(1, round(fraction * len(names))), len(names) - 1)
    return sorted(by_hash[:count])


def workload_identity(workload_key: str) -> str:
    """A workload's computation, whatever inputs are constant: its key (`Workload.key`,
    "name#hash[+const...]", or a task key's workload part) without the constants."""
    name, sep, rest = workload_key.rpartition("#")
    return f"{name}{sep}{rest.split('+', 1)[0]}" if sep else workload_key


def held_out_mask(programs: TrainingPrograms, held_out: Collection[str]) -> np.ndarray:
    """Which programs are of a workload named in `held_out`: by its name, its task key or
    its workload key (constant inputs or not: `workload_identity`)."""
    names = set(held_out) | {workload_identity(n) for n in held_out}
    return np.array([
        w in names or task in names or workload_identity(workload_of(task)) in names
        for w, task in ((w, g.split("/", 1)[1]) for w, g in zip(programs.workloads, programs.groups))
    ], dtype=bool)  # fmt: skip


def trained_workloads(info: Mapping[str, Any]) -> set[str] | None:
    """The workloads a pretrained base learnt from, as its metadata (`BaseTrees.info`)
    records them: their names and identities (`workload_identity`); None for a file that
    does not record them (written before it did)."""
    names, keys = info.get("workload_names"), info.get("workload_keys")
    if not isinstance(names, list) or not isinstance(keys, list):
        return None
    return {str(n) for n in names} | {workload_identity(str(k)) for k in keys}


def split_by_workload(programs: TrainingPrograms, held_out: Collection[str]) -> tuple[TrainingPrograms, TrainingPrograms]:
    """(training programs, held-out programs): a program is held out when its workload
    is named in `held_out` (`held_out_mask`). Raises DatasetError when a side is empty."""
    names = set(held_out)
    out = held_out_mask(programs, names)
    if not out.any():
        raise DatasetError(f"no workload of the dataset is named in the held-out list ({', '.join(sorted(names))})")
    if out.all():
        raise DatasetError("every workload is held out: nothing left to train on")
    return programs.subset(~out), programs.subset(out)


# --- training --------------------------------------------------------------------------------


@dataclass(frozen=True)
class PretrainResult:
    base: BaseTrees  # descriptor zeros: set per target when loaded
    num_trees: int
    train_loss: float  # the objective's metric at the best round
    seconds: float


@dataclass(frozen=True)
class StackedRows:
    rows: np.ndarray  # (R, F + D): rows with their program's descriptor appended
    row_program: np.ndarray
    counts: np.ndarray


def stack_rows(programs: TrainingPrograms) -> StackedRows:
    counts = np.array([f.shape[0] for f in programs.features], dtype=np.int64)
    row_program = np.repeat(np.arange(len(counts)), counts)
    rows = np.concatenate(programs.features, axis=0).astype(np.float32, copy=False)
    return StackedRows(np.concatenate([rows, programs.descriptors[row_program]], axis=1), row_program, counts)


def task_labels(programs: TrainingPrograms) -> tuple[np.ndarray, np.ndarray]:
    """(group index, label) of each program: its group (class + task) and its normalised
    throughput within that group."""
    group_names = sorted(set(programs.groups))
    index = {g: i for i, g in enumerate(group_names)}
    group_ids = np.array([index[g] for g in programs.groups], dtype=np.int64)
    return group_ids, normalized_throughputs(programs.costs, group_ids, len(group_names))


def task_pairs(programs: TrainingPrograms, group_ids: np.ndarray, y: np.ndarray, *, max_pairs: int, seed: int) -> Pairs:
    """The ranking loss's pairs (`ranking.ranking_pairs`, beyond the noise). Raises
    DatasetError when there is none."""
    pairs = ranking_pairs(y, group_ids, noise=programs.noise, floor=NOISE_FLOOR, max_pairs=max_pairs, seed=seed)
    if not len(pairs.weight):
        raise DatasetError("no two programs of one task differ beyond the noise: nothing to rank")
    return pairs


def pretrain(programs: TrainingPrograms, config: PretrainConfig = PretrainConfig()) -> PretrainResult:
    """Base trees trained on `programs` (module doc, 2)."""
    if config.objective not in OBJECTIVES:
        raise UsageError(f"objective {config.objective!r}: choose one of {', '.join(OBJECTIVES)}")
    if not len(programs):
        raise DatasetError("no program to train on")
    start = time.perf_counter()
    group_ids, y = task_labels(programs)
    w = np.maximum(y, config.min_weight)
    data = stack_rows(programs)
    n = len(programs)
    if config.objective == "rank":
        pairs = task_pairs(programs, group_ids, y, max_pairs=config.max_pairs, seed=config.seed)
        objective, metric = rank_objective(data.row_program, n, pairs)
    else:

        def objective(preds: np.ndarray, _: xgb.DMatrix) -> tuple[np.ndarray, np.ndarray]:
            return pack_sum_gradient(preds, data.row_program, y, w)

        def metric(preds: np.ndarray, _: xgb.DMatrix) -> tuple[str, float]:
            return "p-rmse", weighted_p_rmse(preds, data.row_program, y, w)

    dtrain = xgb.DMatrix(data.rows, nthread=config.nthread)
    booster = xgb.train(
        config.xgb_params(), dtrain, num_boost_round=config.num_boost_round, evals=[(dtrain, "tr")],
        obj=objective, custom_metric=metric, early_stopping_rounds=config.early_stopping_rounds, verbose_eval=False,
    )  # fmt: skip
    best = booster.best_iteration
    trees = booster[: best + 1]
    trees.set_param({"nthread": 1})
    scale, offset = 1.0, 0.0
    if config.objective == "rank":
        scores = pack_sum(trees.inplace_predict(data.rows).astype(np.float64), data.row_program, n)
        scale, offset = affine_fit(scores, y, w)
    base = BaseTrees(
        booster=trees, descriptor=np.zeros(DESCRIPTOR_WIDTH, np.float32), scale=scale, offset=offset,
        info={
            "objective": config.objective, "family": programs.family, "feature_version": programs.feature_version,
            "feature_width": feature_width(programs.feature_version), "descriptor_version": DESCRIPTOR_VERSION,
            "descriptor_width": DESCRIPTOR_WIDTH, "num_trees": best + 1, **programs.summary(),
            "workload_names": sorted(set(programs.workloads)), "workload_keys": programs.workload_keys(),
            "class_targets": programs.trained_class_targets(),
        },
    )  # fmt: skip
    return PretrainResult(base, best + 1, float(booster.best_score), time.perf_counter() - start)


# --- evaluation ------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankingReport:
    """How well scores rank held-out programs within their groups (class + task)."""

    pairwise: float  # over pairs beyond the noise, pooled over groups; NaN without pairs
    pairs: int
    dropped: int  # pairs within the noise
    recall: float  # recall@RECALL_K, mean over groups with more than RECALL_K valid programs
    groups: int
    programs: int
    per_class: Mapping[str, tuple[float, float]]  # class -> (pairwise, recall)

    def as_report(self) -> dict[str, Any]:
        return {
            "pairwise": self.pairwise, "pairs": self.pairs, "dropped": self.dropped, "recall_at_k": self.recall,
            "k": RECALL_K, "groups": self.groups, "programs": self.programs,
            "per_class": {c: {"pairwise": p, "recall_at_k": r} for c, (p, r) in self.per_class.items()},
        }  # fmt: skip


def base_scores(base: BaseTrees, programs: TrainingPrograms) -> np.ndarray:
    """The base's score of each program, with the descriptor of the program's own class."""
    data = stack_rows(programs)
    values = row_values(base.booster, data.rows, data.row_program, data.counts, base.scale, base.offset)
    return pack_sum(values.astype(np.float64), data.row_program, len(programs))


def ranking_report(scores: np.ndarray, programs: TrainingPrograms) -> RankingReport:
    """`scores` (one per program) against the programs' costs, per group (module doc, 3)."""
    group = np.array(programs.groups, dtype=object)
    pooled: PairCounts = NO_PAIRS
    by_class: dict[str, tuple[PairCounts, list[float]]] = {}
    recalls: list[float] = []
    for g in dict.fromkeys(programs.groups):
        mine = group == g
        costs = programs.costs[mine]
        counts = pairwise_beyond_noise(scores[mine], costs, programs.noise[mine])
        pooled = pooled + counts
        cls = g.split("/", 1)[0]
        pairs, class_recalls = by_class.get(cls, (NO_PAIRS, []))
        if int(np.isfinite(costs).sum()) > RECALL_K:
            r = recall_at_k(scores[mine], costs, RECALL_K)
            recalls.append(r)
            class_recalls = [*class_recalls, r]
        by_class[cls] = (pairs + counts, class_recalls)
    return RankingReport(
        pairwise=pooled.accuracy, pairs=pooled.compared, dropped=pooled.dropped, recall=_mean(recalls),
        groups=len(set(programs.groups)), programs=len(programs),
        per_class={c: (p.accuracy, _mean(r)) for c, (p, r) in sorted(by_class.items())},
    )  # fmt: skip


def _mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else math.nan
