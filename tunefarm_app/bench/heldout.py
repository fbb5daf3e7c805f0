"""The cost model's ranking accuracy on measurements it has not seen (Ansor paper §7.5).

A fresh `XGBCostModel` is trained on the first `TRAIN_FRACTION` of a records file in
measurement order (the order the search produced them) and scores the rest; the report is
the pairwise ranking accuracy and recall@k of those scores against the measured costs.
Failed measurements are in the training set (the model learns they are bad) and are
dropped from the held-out metrics (a failure has no rank).

The tuning model only starts learning after `XGBConfig.num_warmup_samples` (64) programs;
here it trains on whatever the training split holds, so small budgets give a number too
(a noisy one: 32 trials leave 7 held-out programs, 21 pairs, and no recall@8).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.scheduler.cost_model import XGBConfig, XGBCostModel, pairwise_accuracy, recall_at_k
from services.scheduler.task import make_task
from tunefarm.store import JsonlRecordStore
from tunefarm.workloads import Workload

TRAIN_FRACTION = 0.8
"""Share of the records (the earliest ones) the model is trained on."""

RECALL_K = 8
"""k of the reported recall@k."""

MIN_HELD_OUT = 5
"""Fewest valid held-out measurements worth a pairwise accuracy (10 pairs)."""


@dataclass(frozen=True)
class HeldOutAccuracy:
    pairwise: float  # NaN when there is no usable pair
    recall: float  # recall@RECALL_K; NaN unless more than RECALL_K held-out programs are valid
    n_train: int
    n_test: int  # valid held-out measurements the metrics are computed on


def held_out_accuracy(
    records_path: Path, workload: Workload, target: dict[str, Any], *, seed: int
) -> HeldOutAccuracy:
    """Train on the first TRAIN_FRACTION of the file's records, score the rest."""
    records = JsonlRecordStore(records_path).load()
    task = make_task(workload, target)
    records = [r for r in records if r.task == task.key]
    split = int(len(records) * TRAIN_FRACTION)
    train, test = records[:split], records[split:]
    n_test = sum(1 for r in test if r.is_valid)
    if not train or n_test < MIN_HELD_OUT:
        return HeldOutAccuracy(math.nan, math.nan, len(train), n_test)
    model = XGBCostModel(XGBConfig(seed=seed, num_warmup_samples=1))
    model.update(
        task.space.features_of([r.candidate for r in train]), [r.cost for r in train], [task.key] * len(train)
    )
    scores = model.predict(task.space.features_of([r.candidate for r in test]))
    costs = [r.cost for r in test]
    return HeldOutAccuracy(
        pairwise=pairwise_accuracy(scores, costs),
        # with at most k valid programs every ranking has recall 1: no information
        recall=recall_at_k(scores, costs, RECALL_K) if n_test > RECALL_K else math.nan,
        n_train=len(train),
        n_test=n_test,
    )


def held_out_by_task(records_path: Path, *, seed: int) -> dict[str, HeldOutAccuracy]:
    """Per task of a multi-task records file (a model's run): one model trained on the
    first TRAIN_FRACTION of the file's records, all tasks together, as the tuning's shared
    model is; each task's held-out records scored by it."""
    import tvm

    from tunefarm.workloads import workload_from_prim_func

    store = JsonlRecordStore(records_path)
    records = store.load()
    split = int(len(records) * TRAIN_FRACTION)
    train, test = records[:split], records[split:]
    tasks = {}
    for key in {r.task for r in records}:
        stored = store.get_workload(key)
        if stored is None:
            continue
        name, mod_json = stored
        wl = workload_from_prim_func(name, tvm.ir.load_json(mod_json)["main"])
        tasks[key] = make_task(wl, records[0].target)
    model = XGBCostModel(XGBConfig(seed=seed, num_warmup_samples=1))
    usable = [r for r in train if r.task in tasks]
    feats = []
    for r in usable:
        feats += tasks[r.task].space.features_of([r.candidate])
    if not usable:
        return {}
    model.update(feats, [r.cost for r in usable], [r.task for r in usable])
    out = {}
    for key, task in tasks.items():
        mine = [r for r in test if r.task == key]
        n_test = sum(1 for r in mine if r.is_valid)
        n_train = sum(1 for r in usable if r.task == key)
        if n_test < MIN_HELD_OUT:
            out[key] = HeldOutAccuracy(math.nan, math.nan, n_train, n_test)
            continue
        scores = model.predict(task.space.features_of([r.candidate for r in mine]))
        costs = [r.cost for r in mine]
        out[key] = HeldOutAccuracy(
            pairwise=pairwise_accuracy(scores, costs),
            recall=recall_at_k(scores, costs, RECALL_K) if n_test > RECALL_K else math.nan,
            n_train=n_train,
            n_test=n_test,
        )
    return out
