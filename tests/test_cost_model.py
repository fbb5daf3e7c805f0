"""Cost models: one conformance suite for every `CostModel`, then the XGBoost model's learning,
warm-up, retraining schedule and objective, then the ranking metrics. No TVM needed."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest

from tunefarm.search.cost_model import (
    CostModel,
    RandomCostModel,
    XGBConfig,
    XGBCostModel,
    pairwise_accuracy,
    recall_at_k,
)
from tunefarm.search.cost_model.xgb import (
    normalized_throughputs,
    pack_sum_gradient,
    pack_sum_loss,
    prior_weight,
)

NUM_FEATURES = 16
GROUP_SCALES = {"gemm": 3e-5, "conv": 1e-3, "softmax": 2e-2}  # seconds per unit of work
GROUP_ROWS = {"gemm": 1, "conv": 3, "softmax": 6}  # stores per program, fixed within a task
GROUP_CODES = {"gemm": 0.2, "conv": 0.5, "softmax": 0.8}


# --- synthetic programs ----------------------------------------------------------------------


def row_work(rows: np.ndarray) -> np.ndarray:
    """Known nonlinear work of each store row."""
    return 1 + 3 * rows[:, 0] ** 2 + np.sin(3 * rows[:, 1]) + 2 * rows[:, 2] * rows[:, 3]


def make_programs(n: int, seed: int) -> tuple[list[np.ndarray], list[float], list[str]]:
    """Programs of three groups; cost = group scale * (summed row work) ** 1.5."""
    rng = np.random.default_rng(seed)
    names = list(GROUP_SCALES)
    features, costs, groups = [], [], []
    for _ in range(n):
        group = names[int(rng.integers(len(names)))]
        rows = rng.random((GROUP_ROWS[group], NUM_FEATURES), dtype=np.float32)
        # Like real features (loop extents, buffer sizes), the last one tells the tasks apart.
        rows[:, -1] = GROUP_CODES[group]
        features.append(rows)
        costs.append(GROUP_SCALES[group] * float(row_work(rows).sum()) ** 1.5)
        groups.append(group)
    return features, costs, groups


def per_group_accuracy(scores: np.ndarray, costs: list[float], groups: list[str]) -> float:
    group_array = np.array(groups)
    return float(
        np.mean(
            [
                pairwise_accuracy(scores[group_array == g], np.array(costs)[group_array == g])
                for g in GROUP_SCALES
            ]
        )
    )


def invalid_program() -> np.ndarray:
    return np.empty((0, NUM_FEATURES), dtype=np.float32)


# --- conformance suite: every CostModel ------------------------------------------------------


def random_model() -> CostModel:
    return RandomCostModel(seed=7)


def xgb_in_warmup() -> CostModel:
    model = XGBCostModel(XGBConfig(num_warmup_samples=1000))
    model.update(*make_programs(30, seed=1))
    return model


def xgb_trained() -> CostModel:
    model = XGBCostModel(XGBConfig(num_warmup_samples=40))
    model.update(*make_programs(60, seed=1))
    return model


def xgb_pack_sum_trained() -> CostModel:
    model = XGBCostModel(XGBConfig(num_warmup_samples=40, objective="pack_sum"))
    model.update(*make_programs(60, seed=1))
    return model


MODEL_FACTORIES = [random_model, xgb_in_warmup, xgb_trained, xgb_pack_sum_trained]


@pytest.fixture(params=MODEL_FACTORIES, ids=lambda f: f.__name__)
def make_model(request: pytest.FixtureRequest) -> Callable[[], CostModel]:
    return request.param


def test_predict_gives_one_float_per_program(make_model: Callable[[], CostModel]) -> None:
    features, _, _ = make_programs(25, seed=2)
    scores = make_model().predict(features)
    assert scores.shape == (25,)
    assert scores.dtype == np.float64
    assert np.isfinite(scores).all()
    assert make_model().predict([]).shape == (0,)


def test_invalid_programs_score_minus_inf(make_model: Callable[[], CostModel]) -> None:
    features, _, _ = make_programs(4, seed=2)
    batch = [features[0], invalid_program(), features[1], np.empty((0,)), features[2]]
    scores = make_model().predict(batch)
    assert scores[1] == -math.inf and scores[3] == -math.inf
    assert np.isfinite(scores[[0, 2, 4]]).all()


def test_update_accepts_failed_and_invalid_programs(make_model: Callable[[], CostModel]) -> None:
    model = make_model()
    before = model.num_samples
    features, costs, groups = make_programs(3, seed=3)
    model.update(features + [invalid_program()], [math.inf, *costs[1:], 1e-3], groups + ["gemm"])
    assert model.num_samples == before + 4
    assert np.isfinite(model.predict(features)).all()


def test_update_rejects_malformed_batches(make_model: Callable[[], CostModel]) -> None:
    model = make_model()
    features, costs, groups = make_programs(3, seed=3)
    with pytest.raises(ValueError):
        model.update(features, costs[:2], groups)
    with pytest.raises(ValueError):
        model.update(features, [math.nan, *costs[1:]], groups)
    with pytest.raises(ValueError):
        model.update(features, [0.0, *costs[1:]], groups)


def test_same_inputs_give_same_scores(make_model: Callable[[], CostModel]) -> None:
    features, _, _ = make_programs(50, seed=4)
    np.testing.assert_array_equal(make_model().predict(features), make_model().predict(features))


def test_save_then_load_predicts_identically_and_keeps_learning(
    make_model: Callable[[], CostModel], tmp_path
) -> None:
    model = make_model()
    path = tmp_path / "model.bin"
    model.save(path)
    loaded = type(model).load(path)
    features, costs, groups = make_programs(50, seed=5)
    assert loaded.num_samples == model.num_samples
    np.testing.assert_array_equal(loaded.predict(features), model.predict(features))
    # Both continue the same way after more data.
    model.update(features, costs, groups)
    loaded.update(features, costs, groups)
    assert loaded.num_samples == model.num_samples
    np.testing.assert_array_equal(loaded.predict(features), model.predict(features))


# --- XGBCostModel ------------------------------------------------------------------------------


def test_xgb_learns_to_rank_held_out_programs() -> None:
    train = make_programs(600, seed=10)
    test_features, test_costs, test_groups = make_programs(200, seed=11)
    model = XGBCostModel(XGBConfig(num_warmup_samples=64))
    model.update(*train)
    assert model.trained_on == 600

    learned = per_group_accuracy(model.predict(test_features), test_costs, test_groups)
    chance = per_group_accuracy(RandomCostModel(seed=0).predict(test_features), test_costs, test_groups)
    assert learned > 0.75
    assert learned > chance + 0.15
    scores = model.predict(test_features)
    conv = np.array(test_groups) == "conv"
    assert recall_at_k(scores[conv], np.array(test_costs)[conv], k=10) >= 0.5


def test_the_rank_objective_learns_the_order_and_scores_on_the_throughput_scale() -> None:
    """Trained for each task's order (`ranking.py`), its scores are mapped back onto the
    normalised throughputs: evolution picks parents in proportion to them."""
    features, costs, groups = make_programs(600, seed=10)
    test_features, test_costs, test_groups = make_programs(200, seed=11)
    model = XGBCostModel(XGBConfig(num_warmup_samples=64, objective="rank"))
    model.update(features, costs, groups)
    assert model.last_training is not None
    learned = per_group_accuracy(model.predict(test_features), test_costs, test_groups)
    assert learned > 0.75
    y = normalized_throughputs(np.array(costs), np.array([list(GROUP_SCALES).index(g) for g in groups]), 3)
    w = np.maximum(y, XGBConfig().min_weight)  # the fit's weights
    scores = model.predict(features)
    for group in GROUP_SCALES:  # scores rank within a task (pairs never cross tasks)
        mine = np.array(groups) == group
        assert float(np.corrcoef(scores[mine], y[mine])[0, 1]) > 0.8, group
    assert np.average(scores, weights=w) == pytest.approx(np.average(y, weights=w), abs=1e-3)
    a, b = model._calibration
    raw = (scores - b) / a  # what the trees alone say: logits of pairwise odds, far wider
    assert np.std(raw) > 5 * np.std(y) and np.std(scores) < 2 * np.std(y)


def test_the_rank_objective_without_a_pair_beyond_the_noise_trains_on_pack_sum() -> None:
    features, _, groups = make_programs(80, seed=3)
    model = XGBCostModel(XGBConfig(num_warmup_samples=40, objective="rank"))
    model.update(features, [1e-3] * len(features), groups)  # every program equally fast
    assert model.last_training is not None
    assert np.all(np.isfinite(model.predict(features)))


def test_xgb_learns_that_failed_programs_are_bad() -> None:
    features, costs, groups = make_programs(400, seed=12)
    fails = [bool(f[:, 5].max() > 0.8) for f in features]  # a feature that predicts failure
    costs = [math.inf if fail else c for c, fail in zip(costs, fails, strict=True)]
    model = XGBCostModel(XGBConfig(num_warmup_samples=64))
    model.update(features, costs, groups)

    test_features, _, _ = make_programs(200, seed=13)
    test_fails = np.array([f[:, 5].max() > 0.8 for f in test_features])
    scores = model.predict(test_features)
    assert scores[test_fails].mean() < 0.5 * scores[~test_fails].mean()

    # Why the weight floor exists: with the paper's w = y alone, failures weigh nothing
    # in pack-sum's squared error (a ranking pair with a failure weighs its partner's y).
    unfloored = XGBCostModel(XGBConfig(num_warmup_samples=64, min_weight=0.0, objective="pack_sum"))
    unfloored.update(features, costs, groups)
    scores = unfloored.predict(test_features)
    assert scores[test_fails].mean() > scores[~test_fails].mean()


def test_xgb_warmup_gives_deterministic_random_scores_then_learned_ones() -> None:
    config = XGBConfig(num_warmup_samples=40, seed=5)
    model = XGBCostModel(config)
    features, costs, groups = make_programs(40, seed=14)
    probe = [features[0], features[0]]  # the same program twice

    model.update(features[:39], costs[:39], groups[:39])
    assert model.trained_on == 0
    reference = RandomCostModel(seed=config.seed)
    np.testing.assert_array_equal(model.predict(probe), reference.predict(probe))
    np.testing.assert_array_equal(model.predict(features), reference.predict(features))

    model.update(features[39:], costs[39:], groups[39:])  # reaches warm-up: trains
    assert model.trained_on == 40
    first = model.predict(probe)
    assert first[0] == first[1]
    np.testing.assert_array_equal(model.predict(probe), first)


def test_xgb_adaptive_training_retrains_after_20_percent_new_data() -> None:
    model = XGBCostModel(XGBConfig(num_warmup_samples=50))
    features, costs, groups = make_programs(100, seed=15)

    def add(start: int, stop: int) -> int:
        model.update(features[start:stop], costs[start:stop], groups[start:stop])
        return model.trained_on

    assert add(0, 30) == 0  # warm-up
    assert add(30, 50) == 50  # past warm-up: trains
    assert add(50, 59) == 50  # 9 new < 20% of 50
    assert add(59, 60) == 60  # 10 new >= 10: retrains
    assert add(60, 71) == 60  # 11 < 12
    assert add(71, 72) == 72


def test_xgb_without_adaptive_training_retrains_every_batch() -> None:
    model = XGBCostModel(XGBConfig(num_warmup_samples=20, adaptive_training=False))
    features, costs, groups = make_programs(24, seed=16)
    model.update(features[:20], costs[:20], groups[:20])
    model.update(features[20:21], costs[20:21], groups[20:21])
    assert model.trained_on == 21


def test_xgb_rejects_a_different_feature_width() -> None:
    model = xgb_trained()
    with pytest.raises(ValueError, match="feature width"):
        model.predict([np.zeros((2, NUM_FEATURES + 1), np.float32)])


def test_xgb_load_rejects_another_models_file(tmp_path) -> None:
    path = tmp_path / "random.json"
    RandomCostModel(seed=0).save(path)
    with pytest.raises(ValueError):
        XGBCostModel.load(path)


def test_labels_are_normalised_throughput_per_group() -> None:
    costs = np.array([2.0, 1.0, math.inf, 10.0, 40.0, math.inf])
    groups = np.array([0, 0, 0, 1, 1, 2])
    np.testing.assert_allclose(normalized_throughputs(costs, groups, 3), [0.5, 1.0, 0.0, 1.0, 0.25, 0.0])


def test_objective_gradient_matches_finite_differences() -> None:
    rng = np.random.default_rng(0)
    row_program = np.array([0, 0, 1, 2, 2, 2])
    y = np.array([0.3, 1.0, 0.0])
    w = np.maximum(y, 0.05)
    preds = rng.normal(size=6)
    grad, hess = pack_sum_gradient(preds, row_program, y, w)

    step = 1e-6
    for r in range(len(preds)):
        up, down = preds.copy(), preds.copy()
        up[r] += step
        down[r] -= step
        numeric = (pack_sum_loss(up, row_program, y, w) - pack_sum_loss(down, row_program, y, w)) / (2 * step)
        assert grad[r] == pytest.approx(numeric, rel=1e-5, abs=1e-8)
        # Diagonal of the hessian: d2L/dr2 = 2 w of the row's program.
        second = (
            pack_sum_loss(up, row_program, y, w)
            - 2 * pack_sum_loss(preds, row_program, y, w)
            + pack_sum_loss(down, row_program, y, w)
        ) / step**2
        assert hess[r] == pytest.approx(second, rel=1e-3)


# --- metrics -----------------------------------------------------------------------------------


def test_pairwise_accuracy_on_hand_made_rankings() -> None:
    costs = [1.0, 2.0, 3.0, 4.0]
    assert pairwise_accuracy([4, 3, 2, 1], costs) == 1.0
    assert pairwise_accuracy([1, 2, 3, 4], costs) == 0.0
    assert pairwise_accuracy([1, 1, 1, 1], costs) == 0.5  # ties count half
    assert pairwise_accuracy([4, 3, 1, 2], costs) == 5 / 6  # one of six pairs swapped
    # Pairs of equal cost are skipped; failed programs are ignored whatever their score.
    assert pairwise_accuracy([3, 2, 1, 100], [1.0, 1.0, 2.0, math.inf]) == 1.0
    assert math.isnan(pairwise_accuracy([1, 2], [math.inf, 1.0]))


def test_pairwise_accuracy_samples_large_inputs_deterministically() -> None:
    rng = np.random.default_rng(1)
    costs = rng.random(3000)
    scores = -costs + rng.normal(scale=0.3, size=3000)
    exact = pairwise_accuracy(scores, costs, max_pairs=10**7)
    sampled = pairwise_accuracy(scores, costs, max_pairs=200_000)
    assert sampled == pairwise_accuracy(scores, costs, max_pairs=200_000)
    assert sampled == pytest.approx(exact, abs=0.01)


def test_recall_at_k_exact_values() -> None:
    costs = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert recall_at_k([5, 4, 3, 2, 1], costs, k=2) == 1.0
    assert recall_at_k([1, 2, 3, 4, 5], costs, k=2) == 0.0
    assert recall_at_k([5, 1, 4, 2, 3], costs, k=2) == 0.5  # top by score {0, 2}, by cost {0, 1}
    assert recall_at_k([5, 1, 4, 2, 3], costs, k=3) == 2 / 3  # {0, 2, 4} vs {0, 1, 2}
    # Failed programs are dropped; k shrinks to the number of measured programs.
    assert recall_at_k([9, 1, 3, 2], [math.inf, 1.0, 2.0, 3.0], k=2) == 0.5
    assert recall_at_k([9, 1, 3, 2], [math.inf, 1.0, 2.0, 3.0], k=5) == 1.0
    with pytest.raises(ValueError):
        recall_at_k([1.0], [1.0], k=0)


# --- transfer --------------------------------------------------------------------------------


def test_a_transferred_model_ranks_at_once_with_the_source_trees_and_keeps_its_history_as_prior(tmp_path) -> None:
    source = XGBCostModel(XGBConfig(num_warmup_samples=40, adaptive_training=False))
    source.update(*make_programs(300, seed=10))
    test_features = make_programs(50, seed=11)[0]
    model = source.transferred("haswell")
    np.testing.assert_array_equal(model.predict(test_features), source.predict(test_features))
    assert model.num_samples == model.num_prior == 300 and source.num_prior == 0
    assert model.trained_on == source.trained_on
    model.save(tmp_path / "m.npz")  # the prior flags and renamed groups survive a save
    again = XGBCostModel.load(tmp_path / "m.npz")
    assert again.num_prior == 300
    np.testing.assert_array_equal(again.predict(test_features), source.predict(test_features))
    # Its own programs (the same task names: another device's groups are renamed) retrain it.
    again.update(*make_programs(20, seed=12))
    assert again.num_samples == 320 and again.num_prior == 300 and again.trained_on == 320


def test_prior_programs_weigh_less_as_own_programs_arrive() -> None:
    assert prior_weight(0, 64.0) == 1.0
    assert prior_weight(64, 64.0) == 0.5
    assert prior_weight(192, 64.0) == 0.25
    assert prior_weight(10, 0.0) == 0.0


def test_a_transferred_model_adapts_to_a_device_that_ranks_differently() -> None:
    """The new device's costs depend on another feature than the old one's: after enough of
    its own programs, the transferred model ranks them as the new device does."""
    def other_device(features: list[np.ndarray], groups: list[str]) -> list[float]:
        return [GROUP_SCALES[g] * float((1 + 4 * f[:, 5] ** 2).sum()) for f, g in zip(features, groups)]

    source = XGBCostModel(XGBConfig(num_warmup_samples=40, adaptive_training=False))
    source.update(*make_programs(300, seed=20))
    feats, _, groups = make_programs(400, seed=21)
    model = source.transferred("old")
    model.update(feats, other_device(feats, groups), groups)
    test_features, _, test_groups = make_programs(200, seed=22)
    truth = other_device(test_features, test_groups)
    adapted = per_group_accuracy(model.predict(test_features), truth, test_groups)
    before = per_group_accuracy(source.predict(test_features), truth, test_groups)
    assert adapted > 0.75 and adapted > before + 0.1
