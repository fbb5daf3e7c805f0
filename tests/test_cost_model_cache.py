"""The embedded cost model kept between runs: per-target file, versioned, and a bad
file is a warning and a fresh model, never a crash (no compiler: synthetic features)."""

from __future__ import annotations

import numpy as np

from tunefarm.search.cost_model import XGBConfig, XGBCostModel, cache
from tunefarm.search.features import NUM_FEATURES

TARGET = {"kind": "llvm", "mcpu": "skylake", "num-cores": 2}


def _trained(n: int = 80, seed: int = 0) -> tuple[XGBCostModel, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    feats = [rng.uniform(size=(2, NUM_FEATURES)).astype(np.float32) for _ in range(n)]
    costs = [1e-3 / (0.1 + f[:, 0].sum()) for f in feats]
    model = XGBCostModel(XGBConfig(seed=1, num_warmup_samples=16, num_boost_round=20))
    model.update(feats, costs, ["t"] * n)
    return model, feats


def test_cache_path_is_per_target_under_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = cache.cache_path(TARGET)
    assert path.parent == tmp_path / "tunefarm" / "cost_models"
    assert path != cache.cache_path({**TARGET, "num-cores": 4})
    assert cache.model_path(None, TARGET, use_cache=False) is None
    assert cache.model_path(tmp_path / "m.npz", TARGET, use_cache=False) == tmp_path / "m.npz"


def test_saved_model_loads_for_the_same_target_and_predicts_the_same(tmp_path):
    model, feats = _trained()
    path = tmp_path / "sub" / "m.npz"
    cache.save_model(model, path, TARGET, log=print)
    logs: list[str] = []
    loaded = cache.start_cost_model(path, TARGET, seed=5, batch_size=8, log=logs.append)[0]
    assert loaded.trained_on == model.trained_on > 0
    np.testing.assert_array_equal(loaded.predict(feats), model.predict(feats))
    assert logs and "80 programs of earlier runs" in logs[0]


def test_a_file_of_another_target_or_feature_version_or_a_corrupt_one_is_ignored(tmp_path):
    model, _ = _trained()
    path = tmp_path / "m.npz"
    cache.save_model(model, path, TARGET, log=print)
    other_target: list[str] = []
    fresh = cache.start_cost_model(
        path, {**TARGET, "mcpu": "znver4"}, seed=5, batch_size=8, log=other_target.append
    )[0]
    assert fresh.num_samples == 0 and "trained for target" in other_target[0]

    model.metadata = {**model.metadata, "feature_version": -1}
    model.save(path)
    other_features: list[str] = []
    assert cache.start_cost_model(path, TARGET, seed=5, batch_size=8, log=other_features.append)[0].num_samples == 0
    assert "features version -1" in other_features[0]

    path.write_bytes(b"PK\x03\x04 not really a zip")
    corrupt: list[str] = []
    fresh = cache.start_cost_model(path, TARGET, seed=5, batch_size=8, log=corrupt.append)[0]
    assert fresh.num_samples == 0 and "unreadable" in corrupt[0]
    assert fresh.config.num_warmup_samples == 8  # a fresh model learns after the first batch


def test_saving_keeps_the_latest_programs_only(tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "MAX_PROGRAMS", 50)
    model, feats = _trained(n=80)
    costs = model._history.arrays()["costs"].copy()
    rows = model._history.arrays()["rows"].copy()
    path = tmp_path / "m.npz"
    cache.save_model(model, path, TARGET, log=print)
    loaded = XGBCostModel.load(path)
    assert loaded.num_samples == 50 and loaded.trained_on == 50
    kept = loaded._history.arrays()
    np.testing.assert_array_equal(kept["costs"], costs[-50:])
    np.testing.assert_array_equal(kept["rows"], rows[-100:])  # two rows per program
    loaded.update(feats[-2:], [1e-3, 2e-3], ["t", "t"])  # and it keeps learning
    assert loaded.num_samples == 52


def _record(task: str, tile: int, cost: float):
    from tunefarm.records import ErrorKind, MeasureRecord

    return MeasureRecord(
        task=task, workload="w", target=TARGET, sketch=0, sketch_sig="s", decisions=(("x.tile", (tile, 1)),),
        trace=[], costs=(cost,), error_kind=ErrorKind.NONE, error_msg="", build_secs=0.0, run_secs=0.0,
        verified=True, timestamp=0.0,
    )  # fmt: skip


class _Tuner:
    key = "t"

    def features(self, records):
        return [np.full((1, NUM_FEATURES), r.cost, dtype=np.float32) for r in records]


class _Session:
    def __init__(self, resumed):
        self.tuners = [_Tuner()]
        self.resumed_usable = [resumed]


def test_resumed_records_the_kept_model_learnt_are_not_learnt_twice(tmp_path):
    from tunefarm.search.session import RetrainCostModel, program_id

    a, b = _record("t", 1, 1e-3), _record("t", 2, 2e-3)
    model = XGBCostModel(XGBConfig(seed=1, num_warmup_samples=1, num_boost_round=5))
    learnt: list[str] = []
    RetrainCostModel(model, learnt).on_start(_Session([a]))  # the first run learns a
    assert model.num_samples == 1 and learnt == [program_id(a)]
    path = tmp_path / "m.npz"
    cache.save_model(model, path, TARGET, learnt=learnt, log=print)

    again = cache.start_cost_model(path, TARGET, seed=1, batch_size=8, log=print)[0]
    learnt_again = cache.learnt_programs(again)
    assert learnt_again == [program_id(a)]
    RetrainCostModel(again, learnt_again).on_start(_Session([a, b]))  # resumed: a again, and b
    assert again.num_samples == 2 and learnt_again == [program_id(a), program_id(b)]

    cache.save_model(again, path, TARGET, learnt=learnt_again[:1], log=print)  # out of step: not kept
    assert cache.learnt_programs(XGBCostModel.load(path)) == []


def test_a_target_without_a_cached_model_starts_from_its_nearest_cached_targets(monkeypatch, tmp_path):
    """Tune on one machine, then another: the second target starts from the first's model
    (transferred: the same predictions, its programs as prior data), the nearest of those
    cached (AVX2 `haswell` before SSE4.2 `x86-64-v2` for an AVX2 `znver2`)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    haswell = {"kind": "llvm", "mcpu": "haswell", "num-cores": 2}
    v2 = {"kind": "llvm", "mcpu": "x86-64-v2", "num-cores": 2}
    model, feats = _trained()
    cache.save_model(model, cache.cache_path(haswell), haswell, log=print)
    cache.save_model(_trained(seed=3)[0], cache.cache_path(v2), v2, log=print)
    dest = {"kind": "llvm", "mcpu": "znver2", "num-cores": 2}

    assert cache.nearest_cached(dest)[0] == cache.cache_path(haswell)
    logs: list[str] = []
    warm = cache.start_cost_model(cache.cache_path(dest), dest, seed=5, batch_size=8, log=logs.append)[0]
    assert warm.num_prior == model.num_samples and warm.trained_on == model.trained_on
    np.testing.assert_array_equal(warm.predict(feats), model.predict(feats))
    assert str(cache.cache_path(haswell)) in logs[0] and "ISA overlap" in logs[0]
    assert cache.incompatibility(warm, dest) is None  # stamped for its own target

    # an explicit --cost-model file that does not exist yet, or another kind, starts fresh
    assert cache.start_cost_model(tmp_path / "new.npz", dest, seed=5, batch_size=8, log=print)[0].num_samples == 0
    gpu = {"kind": "cuda", "arch": "sm_80"}
    assert cache.nearest_cached(gpu) is None
