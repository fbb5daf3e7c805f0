"""Held-out cost-model evaluation: random k-fold against a time-ordered split, and the
measurement-noise rule for pairs (synthetic data, no compiler)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tunefarm.search.cost_model import XGBConfig, XGBCostModel, pairwise_accuracy
from tunefarm.search.cost_model.metrics import pairwise_beyond_noise, relative_spread, spearman
from tunefarm_app.bench.heldout import FOLDS, cross_validate, kfold_splits, time_ordered_split


def _search_like_records(seed: int = 0):
    """200 programs in the order a search measures them: 160 spread over the space, whose
    cost follows feature x, then 40 winners (x near the top) all within 2% of the best,
    ordered by noise only. Each has three repeats 0.5% apart."""
    rng = np.random.default_rng(seed)
    x_early = rng.uniform(0.0, 0.8, 160)
    cost_early = 1e-3 * (1.0 + 4.0 * (1.0 - x_early))
    x_late = rng.uniform(0.8, 1.0, 40)
    cost_late = cost_early.min() * 0.5 * (1.0 + rng.uniform(0.0, 0.02, 40))
    x = np.concatenate([x_early, x_late])
    costs = np.concatenate([cost_early, cost_late])
    features = [np.array([[xi, rng.uniform()]], dtype=np.float32) for xi in x]
    repeats = [(c * 0.995, c, c * 1.005) for c in costs]
    return features, costs, repeats


def test_random_folds_and_a_time_ordered_split_disagree_on_a_search_like_record_order():
    features, costs, repeats = _search_like_records()
    noise = relative_spread(repeats)
    groups = ["t"] * len(costs)
    kfold = cross_validate(features, costs, noise, groups, kfold_splits(len(costs), FOLDS, seed=3), seed=1)[
        "t"
    ]
    timed = cross_validate(features, costs, noise, groups, time_ordered_split(len(costs)), seed=1)["t"]
    assert kfold.n_test == len(costs)
    assert kfold.pairwise > 0.85 and kfold.spearman > 0.7
    # The last fifth is the winners, within the noise of each other: no pair is left to
    # compare, and every one is counted as dropped.
    assert timed.pairs == 0 and timed.dropped == 40 * 39 // 2 and math.isnan(timed.pairwise)
    # Counting those pairs anyway (the old metric) reports a coin toss.
    model = XGBCostModel(XGBConfig(seed=1, num_warmup_samples=1))
    model.update(features[:160], costs[:160], groups[:160])
    assert pairwise_accuracy(model.predict(features[160:]), costs[160:]) < 0.7


def test_pairs_within_the_noise_are_dropped():
    costs = [1.0, 1.02, 1.10, 1.5]
    perfect = [4.0, 3.0, 2.0, 1.0]  # higher = faster
    # Fixed floor (3%): only (1.0, 1.02) is too close.
    counts = pairwise_beyond_noise(perfect, costs, [0.0] * 4)
    assert (counts.compared, counts.dropped, counts.accuracy) == (5, 1, 1.0)
    # A noisy third record (10% spread) also hides its gaps to the first two.
    counts = pairwise_beyond_noise(perfect, costs, [0.05, 0.05, 0.10, 0.0])
    assert (counts.compared, counts.dropped) == (3, 3)
    # A wrong order on a pair inside the noise does not count against the model.
    assert pairwise_beyond_noise([3.0, 4.0, 2.0, 1.0], costs, [0.0] * 4).accuracy == 1.0
    # Failures have no rank and are not pairs at all.
    counts = pairwise_beyond_noise([3.0, 2.0, 1.0], [1.0, math.inf, 2.0], [0.0] * 3)
    assert (counts.compared, counts.dropped, counts.accuracy) == (1, 0, 1.0)


def test_relative_spread_of_repeats():
    spread = relative_spread([(1.0, 1.0, 1.0), (1.0, 1.1), (2.0,), (1.0, math.inf)])
    assert spread[0] == 0.0 and spread[2] == 0.0 and spread[3] == 0.0
    assert spread[1] == pytest.approx(np.std([1.0, 1.1], ddof=1) / 1.05)


def test_spearman_follows_speed():
    costs = [1.0, 2.0, 3.0, math.inf]
    assert spearman([3, 2, 1, 0], costs) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 0], costs) == pytest.approx(-1.0)
    assert math.isnan(spearman([1, 1, 1], [1.0, 2.0, 3.0]))


def test_kfold_holds_each_record_out_once_and_is_seeded():
    splits = kfold_splits(23, 5, seed=7)
    held = np.concatenate([test for _, test in splits])
    assert sorted(held.tolist()) == list(range(23))
    for train, test in splits:
        assert not set(train.tolist()) & set(test.tolist()) and len(train) + len(test) == 23
    assert all(np.array_equal(a[1], b[1]) for a, b in zip(splits, kfold_splits(23, 5, seed=7)))
    assert not all(np.array_equal(a[1], b[1]) for a, b in zip(splits, kfold_splits(23, 5, seed=8)))


def test_per_task_labels_carry_to_a_task_the_model_has_no_label_of():
    """Three tasks, one rule: within a task, the larger feature f the faster the program;
    the larger tasks (larger f overall, like an op count) take 100x the seconds. Labels
    relative to each task's best teach the rule; labels relative to the best of all tasks
    make the large tasks' programs all ~0, and the model has nothing to rank a new large
    task's programs by."""
    from tunefarm_app.bench.heldout import task_splits

    rng = np.random.default_rng(5)
    features, costs, groups = [], [], []
    for task, scale, offset in (("small", 1e-3, 0.0), ("large", 1e-1, 2.0), ("held", 5e-2, 2.0)):
        x = rng.uniform(0.0, 1.0, 60)
        features += [np.array([[xi + offset, rng.uniform()]], dtype=np.float32) for xi in x]
        costs += list(scale * (1.0 + 4.0 * (1.0 - x)))
        groups += [task] * 60
    noise = np.zeros(len(costs))
    held_out = [split for split in task_splits(groups) if groups[split[1][0]] == "held"]
    per_task = cross_validate(features, costs, noise, groups, held_out, seed=1, objective="pack_sum")["held"]
    global_ = cross_validate(features, costs, noise, groups, held_out, seed=1, labels_per_group=False,
                             objective="pack_sum")["held"]  # fmt: skip
    assert per_task.n_train == 0 and per_task.n_test == 60
    assert per_task.pairwise > 0.9
    assert global_.pairwise < 0.7


def test_a_program_measured_twice_is_one_sample_so_no_fold_holds_its_twin():
    """Costs unrelated to the features: nothing to learn. Measured twice each (a search
    measures a program again; twins share their feature matrix), random folds put one
    twin in training and score the other: the model recalls it. Deduplicated, the same
    data scores a coin toss."""
    from tunefarm_app.bench.heldout import deduplicate

    rng = np.random.default_rng(2)
    programs = [np.array([[rng.uniform(), rng.uniform()]], dtype=np.float32) for _ in range(100)]
    costs = 1e-3 * (1.0 + rng.uniform(0.0, 4.0, 100))
    features = programs + [p.copy() for p in programs]
    measured = np.concatenate([costs, costs * 1.002])
    noise, groups = np.zeros(200), ["t"] * 200
    leaky = cross_validate(features, measured, noise, groups, kfold_splits(200, FOLDS, seed=3), seed=1)["t"]
    distinct = deduplicate(features, measured, noise, groups)
    assert len(distinct.groups) == 100 and distinct.costs[0] == pytest.approx(costs[0] * 1.001)
    fair = cross_validate(distinct.features, distinct.costs, distinct.noise, distinct.groups,
                          kfold_splits(100, FOLDS, seed=3), seed=1)["t"]  # fmt: skip
    assert leaky.pairwise > 0.75
    assert fair.pairwise < 0.65


def test_rolling_rounds_train_on_what_was_measured_before():
    from tunefarm_app.bench.heldout import rolling_splits

    groups = ["a"] * 6 + ["b"] * 3 + ["a"] * 5 + ["b"] * 7
    splits = rolling_splits(groups, min_round=5)
    # a's first round has nothing before it; b's first is too small to rank
    assert [(train.tolist(), test.tolist()) for train, test in splits] == [
        (list(range(9)), list(range(9, 14))),
        (list(range(14)), list(range(14, 21))),
    ]


def test_one_task_tuned_alone_is_ranked_batch_by_batch():
    """One task's records are one run; each of the tuning's batches was chosen by the model
    of the batches before it, so each is a round (a single-op bench had no round at all)."""
    from tunefarm_app.bench.heldout import rolling_splits

    assert rolling_splits(["a"] * 20, min_round=5) == []
    splits = rolling_splits(["a"] * 20 + ["b"] * 6, batch=8, min_round=4)
    assert [(len(train), test.tolist()) for train, test in splits] == [
        (8, list(range(8, 16))),
        (16, list(range(16, 20))),
        (20, list(range(20, 26))),
    ]


def test_a_stored_task_with_a_weight_transform_is_rebuilt_with_its_constants():
    """A model run's records name each task by its key (`...+const1@<target>`); the
    held-out figures rebuild the task from the records' sidecar, constants included,
    or a task whose weight is transformed outside the kernel (Winograd) cannot be
    rebuilt at all."""
    pytest.importorskip("tvm")
    from tunefarm.search.task import make_task
    from tunefarm.workloads import registry
    from tunefarm.workloads.base import workload_from_stored

    workload = registry.make("conv2d_winograd", {"N": 1, "C": 8, "H": 14, "W": 14, "F": 16, "m": 2})
    assert workload.constants
    task = make_task(workload, {"kind": "llvm", "num-cores": 2})
    again = workload_from_stored(key=task.key, name=workload.name, module_json=workload.to_json())
    assert again.constants == workload.constants
    assert len(again.outputs) == len(workload.outputs)
    assert make_task(again, task.target).key == task.key
