"""The cost model's ranking accuracy on measurements it has not seen (Ansor paper §7.5).

Programs first: a program measured twice (the same candidate again, or another candidate
that lowers to identical features) is one sample (`deduplicate`: the median of its
costs), so no fold can hold a program whose twin it was trained on.

Two splits:
- k-fold (`FOLDS`), seeded, over the programs in random order. Each fold is scored by a
  fresh `XGBCostModel` trained on the other folds, all tasks of the file together as the
  tuning's shared model is. Random folds over an evolutionary trajectory still put a
  program's parent (a near twin) in training: an optimistic number.
- rolling (`rolling_splits`): what the search does. The records in measurement order
  fall into rounds (a run of one task's records, as the task scheduler measures them,
  cut into the tuning's batches: one task tuned alone is one long run, whose batches
  were each chosen by the model of the batches before it); each round is ranked by a
  model trained on every record measured before it.
A split that trains on the first 80% and scores the last 20% would score the search's
winners only: the last measurements are the programs the search converged on, nearly
equally fast, whose order is mostly noise (winner's curse); `time_ordered_split` is kept
to show the difference (tests).

Reported per task:
- pairwise accuracy over the held-out pairs whose costs differ by more than the
  measurement noise (`pairwise_beyond_noise`: the larger of 3% and the two records'
  combined relative std of repeats), with the number of pairs dropped as within it;
- Spearman rank correlation of scores with speed (mean over folds);
- recall@`RECALL_K` (mean over the folds with more than k valid held-out programs).
Failed measurements are in the training folds (the model learns they are bad) and are
left out of the metrics (a failure has no rank). Pairs are only formed within a fold
(one model's scores) and within a task (costs of different tasks are not comparable).

The tuning model only starts learning after its warm-up; here it trains on whatever
the training folds hold, so small budgets give a number too (a noisy one).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from tunefarm.records import MeasureRecord
from tunefarm.search.cost_model import XGBConfig, XGBCostModel, recall_at_k
from tunefarm.search.cost_model.distinct_programs import distinct_programs, merged_cost
from tunefarm.search.cost_model.metrics import (
    NO_PAIRS,
    PairCounts,
    pairwise_beyond_noise,
    relative_spread,
    spearman,
)
from tunefarm.search.task import SearchTask, make_task
from tunefarm.store import JsonlRecordStore
from tunefarm.workloads import Workload

FOLDS = 5
"""Folds of the cross-validation: each record is held out once, scored by a model
trained on the other four fifths."""

RECALL_K = 8
"""k of the reported recall@k."""

MIN_HELD_OUT = 5
"""Fewest valid measurements of a task worth a pairwise accuracy."""

Split = tuple[np.ndarray, np.ndarray]
"""Indices of the training records and of the held-out ones."""


@dataclass(frozen=True)
class HeldOutAccuracy:
    pairwise: float  # over pairs beyond the noise; NaN when there is none
    spearman: float  # mean over folds; NaN when no fold gives one
    recall: float  # recall@RECALL_K, mean over folds with more than RECALL_K valid programs
    pairs: int  # pairs compared (beyond the noise), all folds
    dropped: int  # pairs within the measurement noise, not compared
    n_train: int  # records of the task the models were trained on, per fold (mean)
    n_test: int  # valid held-out measurements of the task, all folds


def kfold_splits(n: int, folds: int, seed: int) -> list[Split]:
    """`folds` splits of `n` records in a seeded random order; each record is held out once."""
    order = np.random.default_rng(seed).permutation(n)
    parts = np.array_split(order, min(folds, n)) if n else []
    return [
        (np.sort(np.concatenate([p for k, p in enumerate(parts) if k != i])), np.sort(test))
        for i, test in enumerate(parts)
    ]


def time_ordered_split(n: int, train_fraction: float = 0.8) -> list[Split]:
    """The first `train_fraction` of the records (in measurement order) against the rest."""
    cut = int(n * train_fraction)
    return [(np.arange(cut), np.arange(cut, n))]


def rolling_splits(groups: Sequence[str], *, batch: int | None = None, min_round: int = MIN_HELD_OUT) -> list[Split]:
    """Rounds of the records in measurement order (a run of consecutive records of one
    group, cut every `batch` records), each with at least `min_round` records and
    something measured before it: trained on every earlier record, the round held out."""
    splits: list[Split] = []
    start = 0
    for end in range(1, len(groups) + 1):
        if end < len(groups) and groups[end] == groups[start] and (batch is None or end - start < batch):
            continue
        if start > 0 and end - start >= min_round:
            splits.append((np.arange(start), np.arange(start, end)))
        start = end
    return splits


@dataclass(frozen=True)
class Programs:
    """Distinct programs: one sample each, in the order each was first measured."""

    features: list[np.ndarray]
    costs: np.ndarray  # the median of the program's finite costs; inf if it never ran
    noise: np.ndarray  # relative spread: the larger of its repeats' and its measurements'
    groups: list[str]


def deduplicate(
    features: Sequence[np.ndarray], costs: Sequence[float], noise: Sequence[float], groups: Sequence[str]
) -> Programs:
    """Merge the measurements of one program (same group, identical feature matrix)."""
    members = distinct_programs(features, groups)
    merged = [merged_cost([costs[i] for i in idx], [noise[i] for i in idx]) for idx in members]
    first = [idx[0] for idx in members]
    return Programs(
        [features[i] for i in first],
        np.asarray([c for c, _ in merged], dtype=np.float64),
        np.asarray([n for _, n in merged], dtype=np.float64),
        [groups[i] for i in first],
    )


def task_splits(groups: Sequence[str]) -> list[Split]:
    """One split per task: trained on every other task's records, its own held out (how
    well what the model learnt carries to a task it has no label of)."""
    group = np.asarray(groups, dtype=object)
    return [(np.flatnonzero(group != g), np.flatnonzero(group == g)) for g in dict.fromkeys(groups)]


def cross_validate(
    features: Sequence[np.ndarray],
    costs: Sequence[float],
    noise: Sequence[float],
    groups: Sequence[str],
    splits: Sequence[Split],
    *,
    seed: int,
    labels_per_group: bool = True,
    objective: str | None = None,
) -> dict[str, HeldOutAccuracy]:
    """Per group: train a fresh model on each split's training records, score its held-out
    ones, and pool the metrics over the splits. `labels_per_group`, `objective`: the
    model's (`XGBConfig`; None: its default objective)."""
    cost = np.asarray(costs, dtype=np.float64)
    spread = np.asarray(noise, dtype=np.float64)
    group = np.asarray(groups, dtype=object)
    pairs: dict[str, PairCounts] = {}
    rhos: dict[str, list[float]] = {}
    recalls: dict[str, list[float]] = {}
    trained: dict[str, list[int]] = {}
    tested: dict[str, int] = {}
    for train, test in splits:
        if not len(train) or not len(test):
            continue
        config = XGBConfig(seed=seed, num_warmup_samples=1, labels_per_group=labels_per_group)
        model = XGBCostModel(replace(config, objective=objective) if objective else config)
        model.update([features[i] for i in train], cost[train], list(group[train]))
        scores = model.predict([features[i] for i in test])
        for g in dict.fromkeys(group[test]):
            mine = group[test] == g
            c = cost[test][mine]
            n_valid = int(np.isfinite(c).sum())
            trained.setdefault(g, []).append(int(np.sum(group[train] == g)))
            tested[g] = tested.get(g, 0) + n_valid
            pairs[g] = pairs.get(g, NO_PAIRS) + pairwise_beyond_noise(scores[mine], c, spread[test][mine])
            rhos.setdefault(g, []).append(spearman(scores[mine], c))
            if n_valid > RECALL_K:
                recalls.setdefault(g, []).append(recall_at_k(scores[mine], c, RECALL_K))
    out = {}
    for g, counts in pairs.items():
        enough = tested[g] >= MIN_HELD_OUT
        out[g] = HeldOutAccuracy(
            pairwise=counts.accuracy if enough else math.nan,
            spearman=_mean(rhos[g]) if enough else math.nan,
            recall=_mean(recalls.get(g, [])),
            pairs=counts.compared,
            dropped=counts.dropped,
            n_train=round(float(np.mean(trained[g]))),
            n_test=tested[g],
        )
    return out


def held_out_accuracy(
    records_path: Path, workload: Workload, target: dict[str, Any], *, seed: int, rolling_batch: int | None = None
) -> HeldOutAccuracy:
    """K-fold (or, given `rolling_batch`, the tuning's measurements per round: round by
    round) held-out accuracy of one workload's records (`tunefarm bench ops`)."""
    task = make_task(workload, target)
    records = [r for r in JsonlRecordStore(records_path).load() if r.task == task.key]
    scheme = "kfold" if rolling_batch is None else "rolling"
    return _evaluate({task.key: task}, records, seed, scheme=scheme, batch=rolling_batch).get(task.key, _EMPTY)


def held_out_by_task(records_path: Path, *, seed: int) -> dict[str, HeldOutAccuracy]:
    """Per task of a multi-task records file (a model's run): k-fold over all its records,
    one model per fold trained on every task's training records, as the tuning's shared
    model is."""
    return _evaluate(*_tasks_and_records(records_path), seed)


def held_out_across_tasks(
    records_path: Path, *, seed: int, labels_per_group: bool = True
) -> dict[str, HeldOutAccuracy]:
    """Per task of a multi-task records file: scored by a model trained on the other
    tasks' records only (`task_splits`)."""
    return _evaluate(*_tasks_and_records(records_path), seed, scheme="task", labels_per_group=labels_per_group)


def _tasks_and_records(records_path: Path) -> tuple[dict[str, SearchTask], list[MeasureRecord]]:
    from tunefarm.workloads.base import workload_from_stored

    store = JsonlRecordStore(records_path)
    records = store.load()
    tasks: dict[str, SearchTask] = {}
    for key in {r.task for r in records}:
        stored = store.get_workload(key)
        if stored is None:
            continue
        name, mod_json = stored
        tasks[key] = make_task(workload_from_stored(key=key, name=name, module_json=mod_json), records[0].target)
    return tasks, records


_EMPTY = HeldOutAccuracy(math.nan, math.nan, math.nan, 0, 0, 0, 0)


def _evaluate(
    tasks: dict[str, SearchTask],
    records: Sequence[MeasureRecord],
    seed: int,
    *,
    scheme: str = "kfold",
    labels_per_group: bool = True,
    batch: int | None = None,
) -> dict[str, HeldOutAccuracy]:
    """`scheme`: "kfold", "rolling" (rounds of at most `batch`) or "task" (`task_splits`),
    over the distinct programs in measurement order."""
    usable = [r for r in records if r.task in tasks]
    if not usable:
        return {}
    features_of = {key: iter(task.space.features_of([r.candidate for r in usable if r.task == key]))
                   for key, task in tasks.items()}  # fmt: skip
    feats = [next(features_of[r.task]) for r in usable]  # each task's in its own order: measurement order
    programs = deduplicate(feats, [r.cost for r in usable], relative_spread([r.costs for r in usable]),
                           [r.task for r in usable])  # fmt: skip
    splits = {
        "kfold": lambda: kfold_splits(len(programs.groups), FOLDS, seed),
        "rolling": lambda: rolling_splits(programs.groups, batch=batch),
        "task": lambda: task_splits(programs.groups),
    }[scheme]()
    return cross_validate(
        programs.features, programs.costs, programs.noise, programs.groups, splits,
        seed=seed, labels_per_group=labels_per_group,
    )  # fmt: skip


def _mean(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan
