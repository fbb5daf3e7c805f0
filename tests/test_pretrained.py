"""The pretrained cost model: device descriptors, a base under a model's own trees, the
ranking objective, pretraining across tasks and classes, the shipped-model loader, and
`tunefarm pretrain` / `tune-op --no-pretrained` (synthetic datasets in tmp dirs: no
pretrained file is committed until a real dataset trains one)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tunefarm.search.cost_model import XGBConfig, XGBCostModel, cache, pretrained
from tunefarm.search.cost_model.base_trees import BaseTrees
from tunefarm.search.cost_model.descriptor import (
    DESCRIPTOR_NAMES,
    DESCRIPTOR_VERSION,
    DESCRIPTOR_WIDTH,
    device_descriptor,
    device_family,
)
from tunefarm.search.cost_model.pretrain import (
    PretrainConfig,
    base_scores,
    pretrain,
    ranking_report,
    split_by_workload,
    training_programs,
)
from tunefarm.search.cost_model.ranking import (
    affine_fit,
    pairwise_rank_gradient,
    pairwise_rank_loss,
    ranking_pairs,
)
from tunefarm.search.cost_model.xgb import normalized_throughputs, pack_sum_loss
from tunefarm.search.features import feature_width
from tunefarm_app.cli import main

WIDTH = feature_width(1)
HASWELL = {"kind": "llvm", "mcpu": "haswell", "num-cores": 4}
AVX512 = {"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": 8}
SSE = {"kind": "llvm", "mcpu": "x86-64-v2", "num-cores": 2}
CLASSES = {"avx512": AVX512, "sse": SSE}
FAST = {"avx512": 0, "sse": 1}
"""The hidden rule: on the AVX-512 class, programs with a large feature 0 run fast; on the
SSE class, those with a large feature 1 (devices rank the same programs differently)."""



# --- descriptor --------------------------------------------------------------------------------


def test_descriptors_say_vector_width_isa_cores_and_gpu_limits():
    def d(target):
        vec = device_descriptor(target)
        assert vec.shape == (DESCRIPTOR_WIDTH,) and vec.dtype == np.float32
        return dict(zip(DESCRIPTOR_NAMES, vec.tolist()))

    haswell, avx512, sse = d(HASWELL), d(AVX512), d(SSE)
    assert haswell["log_vector_bytes"] == pytest.approx(math.log2(33))
    assert avx512["log_vector_bytes"] == pytest.approx(math.log2(65)) and avx512["log_vector_registers"] == pytest.approx(math.log2(33))
    assert sse["log_vector_bytes"] == pytest.approx(math.log2(17))
    assert (haswell["isa_avx2"], haswell["isa_fma"], haswell["isa_avx512f"]) == (1, 1, 0)
    assert (avx512["isa_avx512f"], sse["isa_avx2"], sse["isa_sse4.2"]) == (1, 0, 1)
    assert haswell["log_cores"] == 2 and avx512["log_cores"] == 3 and haswell["family_x86"] == 1
    assert haswell["is_gpu"] == 0 and haswell["compute_capability"] == 0

    a100, h100 = d({"kind": "cuda", "arch": "sm_80"}), d({"kind": "cuda", "arch": "sm_90"})
    assert a100["is_gpu"] == 1 and a100["compute_capability"] == pytest.approx(8.0) and h100["compute_capability"] == pytest.approx(9.0)
    assert a100["log_multiprocessors"] == pytest.approx(math.log2(109)) and h100["log_multiprocessors"] == pytest.approx(math.log2(133))
    # what one block may use: the opt-in limit of dynamic shared memory (163 KB, 227 KB), 48 KB before sm_80
    assert a100["log_shared_memory_per_block"] == pytest.approx(math.log2(1 + 163 * 1024))
    assert h100["log_shared_memory_per_block"] == pytest.approx(math.log2(1 + 227 * 1024))
    assert d({"kind": "cuda", "arch": "sm_75"})["log_shared_memory_per_block"] == pytest.approx(math.log2(1 + 48 * 1024))
    small = d({"kind": "cuda", "arch": "sm_80", "max_shared_memory_per_block": 16384, "max_threads_per_block": 512})
    assert small["log_shared_memory_per_block"] == pytest.approx(math.log2(16385)) and small["log_max_threads_per_block"] == pytest.approx(math.log2(513))
    assert a100["log_vector_bytes"] == 0 and a100["family_x86"] == 0
    assert device_family(HASWELL) == "x86" and device_family({"kind": "cuda", "arch": "sm_80"}) == "cuda"
    assert device_family({"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "neoverse-n1"}) == "arm"


# --- synthetic measurements ------------------------------------------------------------------


def _program(rng, workload: int) -> np.ndarray:
    rows = np.zeros((2, WIDTH), dtype=np.float32)  # most features of a real program are 0 too
    rows[:, :8] = rng.random((2, 8), dtype=np.float32)
    rows[:, 8] = workload / 10  # like loop extents, a column tells the workloads apart
    return rows


def _cost(features: np.ndarray, cls: str, workload: int, rng) -> float:
    speed = float(features[:, FAST[cls]].sum()) + 0.3 * float(features[:, 2].sum())
    return 1e-4 * (1 + workload) * math.exp(-2.0 * speed) * (1 + 0.01 * rng.random())


def _rows(workloads: range, per_group: int = 40, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for cls, target in CLASSES.items():
        for w in workloads:
            for _ in range(per_group):
                f = _program(rng, w)
                rows.append({
                    "device_class": cls, "target": json.dumps(target, sort_keys=True), "task": f"task{w}",
                    "workload": f"wl{w}", "feature_version": 1, "features": f.tolist(),
                    "cost": _cost(f, cls, w, rng), "noise": 0.01, "cores": 4,
                })  # fmt: skip
    return rows


@pytest.fixture(scope="module")
def split():
    programs = training_programs(_rows(range(8)))
    return split_by_workload(programs, ["wl6", "wl7"])


@pytest.fixture(scope="module")
def squared_base(split):
    return pretrain(split[0], PretrainConfig(objective="squared", num_boost_round=60, max_depth=6)).base


def _own_batch(cls: str, workload: int, n: int, seed: int) -> tuple[list[np.ndarray], list[float], list[str]]:
    rng = np.random.default_rng(seed)
    feats = [_program(rng, workload) for _ in range(n)]
    return feats, [_cost(f, cls, workload, rng) for f in feats], [f"task{workload}"] * n


# --- the ranking objective -------------------------------------------------------------------


def test_rank_gradient_matches_finite_differences_and_the_loss_a_brute_force_sum():
    rng = np.random.default_rng(3)
    counts = np.array([1, 2, 3, 1, 2, 2])
    row_program = np.repeat(np.arange(len(counts)), counts)
    y = np.array([1.0, 0.5, 0.0, 0.8, 0.3, 0.31])
    groups = np.array([0, 0, 0, 1, 1, 1])
    pairs = ranking_pairs(y, groups, noise=np.zeros(6), floor=0.05)
    got = {(int(a), int(b)) for a, b in zip(pairs.better, pairs.worse)}
    assert got == {(0, 1), (0, 2), (1, 2), (3, 4), (3, 5)}  # 4 vs 5 is within the 5% floor
    preds = rng.normal(size=row_program.shape)
    scores = np.bincount(row_program, weights=preds)
    brute = sum(abs(y[a] - y[b]) * math.log(1 + math.exp(-(scores[a] - scores[b]))) for a, b in got)
    assert pairwise_rank_loss(preds, row_program, 6, pairs) == pytest.approx(brute)
    grad, hess = pairwise_rank_gradient(preds, row_program, 6, pairs)
    eps = 1e-6
    for r in range(len(preds)):
        up, down = preds.copy(), preds.copy()
        up[r] += eps
        down[r] -= eps
        numeric = (pairwise_rank_loss(up, row_program, 6, pairs) - pairwise_rank_loss(down, row_program, 6, pairs)) / (2 * eps)
        assert grad[r] == pytest.approx(numeric, rel=1e-5, abs=1e-8)
    assert (hess > 0).all()


def test_rank_pairs_are_sampled_deterministically_in_a_large_group():
    y = np.linspace(0.01, 1, 200)
    groups = np.zeros(200, dtype=np.int64)
    a = ranking_pairs(y, groups, max_pairs=500, seed=1)
    b = ranking_pairs(y, groups, max_pairs=500, seed=1)
    assert 0 < len(a.weight) <= 500 and np.array_equal(a.better, b.better) and (y[a.better] > y[a.worse]).all()


def test_affine_fit_recovers_a_scale_and_keeps_the_order():
    s = np.array([-3.0, -1.0, 0.0, 2.0])
    assert affine_fit(s, 0.5 * s + 0.2, np.ones(4)) == pytest.approx((0.5, 0.2))
    assert affine_fit(s, -s, np.ones(4))[0] > 0


# --- pretraining ---------------------------------------------------------------------------


def test_duplicates_are_one_program_and_groups_are_class_and_task():
    rows = _rows(range(2), per_group=5)
    twice = rows + [dict(rows[0], cost=rows[0]["cost"] * 3)]
    programs = training_programs(twice)
    assert len(programs) == len(rows)
    first = programs.groups.index("avx512/task0")
    assert programs.costs[first] == pytest.approx(np.median([rows[0]["cost"], rows[0]["cost"] * 3]))
    assert set(programs.groups) == {f"{c}/task{w}" for c in CLASSES for w in range(2)}
    assert programs.summary()["classes"] == {"avx512": 10, "sse": 10}


@pytest.mark.parametrize("objective", ["squared", "rank"])
def test_pretraining_ranks_held_out_workloads_on_each_class_by_its_own_rule(split, objective):
    """Two classes whose speed follows opposite features: a model conditioned on the
    device descriptor ranks the workloads it never saw on both, a fresh one cannot."""
    train, test = split
    base = pretrain(train, PretrainConfig(objective=objective, num_boost_round=60, max_depth=6)).base
    report = ranking_report(base_scores(base, test), test)
    assert report.pairs > 1000
    for cls, (pairwise, _) in report.per_class.items():
        assert pairwise > 0.75, (cls, report)
    fresh = XGBCostModel(XGBConfig(seed=1))
    assert ranking_report(fresh.predict(test.features), test).pairwise < 0.6


def test_the_statement_mlp_ranks_held_out_workloads_on_each_class_by_its_own_rule(split):
    """The contender (`tunefarm pretrain --compare`) learns the same two opposite rules from
    the descriptor; its numpy scores are the trained network's (a forward pass that
    dropped the standardisation or a layer would rank no better than chance)."""
    from tunefarm.search.cost_model.statement_mlp import MLPConfig, train_statement_mlp

    train, test = split
    model = train_statement_mlp(train, MLPConfig(epochs=150))
    assert model.train_loss < 0.3  # per unit of pair weight; log 2 = 0.69 is no order at all
    report = ranking_report(model.scores(test), test)
    for cls, (pairwise, _) in report.per_class.items():
        assert pairwise > 0.75, (cls, report)


def test_pretraining_refuses_mixed_layouts_and_families():
    from tunefarm.search.cost_model.pretrain import DatasetError

    rows = _rows(range(1), per_group=3)
    with pytest.raises(DatasetError, match="versions"):
        training_programs(rows + [dict(rows[0], feature_version=3, features=[[0.0] * feature_width(3)])])
    gpu = dict(rows[0], target=json.dumps({"kind": "cuda", "arch": "sm_80"}), feature_version=3)
    with pytest.raises(DatasetError, match="choose one"):
        training_programs(rows + [gpu])
    assert training_programs(rows + [gpu], family="x86").family == "x86"


# --- a base under a model's own trees ----------------------------------------------------------


def test_a_model_with_a_base_ranks_with_it_before_warm_up(squared_base):
    base = squared_base.with_descriptor(device_descriptor(SSE))
    feats, costs, _ = _own_batch("sse", 9, 60, seed=5)
    a = XGBCostModel(XGBConfig(seed=1, num_warmup_samples=64), base=base)
    b = XGBCostModel(XGBConfig(seed=2, num_warmup_samples=64), base=base)
    np.testing.assert_array_equal(a.predict(feats), b.predict(feats))  # not the seeded random scores
    assert ranking_report(a.predict(feats), _programs(feats, costs, "sse")).pairwise > 0.75
    # the same programs on the other class's descriptor rank by the other rule
    other = XGBCostModel(XGBConfig(seed=1), base=squared_base.with_descriptor(device_descriptor(AVX512)))
    assert ranking_report(other.predict(feats), _programs(feats, costs, "sse")).pairwise < 0.7
    # the search evolves its first population by the base's scores, not at random
    assert a.ranks and a.trained_on == 0 and not XGBCostModel(XGBConfig(seed=1)).ranks


def _programs(feats, costs, cls):
    from tunefarm.search.cost_model.pretrain import TrainingPrograms

    n = len(feats)
    return TrainingPrograms(feats, np.asarray(costs), np.full(n, 0.01), [f"{cls}/t"] * n, [cls] * n, ["w"] * n,
                            np.zeros((n, DESCRIPTOR_WIDTH), np.float32), "x86", 1)  # fmt: skip


def test_own_trees_learn_the_residual_where_the_device_disagrees_with_the_base(squared_base):
    """A class whose rule the base never saw (speed from feature 3): its own trees,
    trained on top of the base, fit its data better than the base alone."""
    FAST["odd"] = 3
    try:
        feats, costs, groups = _own_batch("odd", 9, 96, seed=7)
    finally:
        del FAST["odd"]
    base = squared_base.with_descriptor(device_descriptor(HASWELL))
    model = XGBCostModel(XGBConfig(seed=1, num_warmup_samples=96, num_boost_round=40, objective="pack_sum"), base=base)
    y = normalized_throughputs(np.asarray(costs), np.zeros(len(costs), np.int64), 1)
    w = np.maximum(y, 0.05)
    counts = np.array([f.shape[0] for f in feats])
    row_program = np.repeat(np.arange(len(feats)), counts)

    def loss(m):
        scores = m.predict(feats)
        return pack_sum_loss(scores, np.arange(len(feats)), y, w)

    before = loss(model)
    model.update(feats, costs, groups)
    assert model.trained_on == 96 and model.last_training is not None
    assert loss(model) < 0.5 * before
    # the own trees were trained on the residual: alone they are not the whole score
    own = model._booster.inplace_predict(np.concatenate(feats))
    assert not np.allclose(np.bincount(row_program, weights=own), model.predict(feats))


def test_the_base_fades_as_each_task_gets_programs_of_its_own_and_not_with_the_number_of_tasks(tmp_path, squared_base):
    """One task with 96 programs: the base counts 16 / (16 + 96) in training and scoring;
    twelve tasks with 8 each (96 programs too): 16 / (16 + 8). A saved model keeps it."""
    base = squared_base.with_descriptor(device_descriptor(SSE))
    config = XGBConfig(seed=1, num_warmup_samples=96, num_boost_round=20, prior_strength=16.0, objective="pack_sum")
    one_task = XGBCostModel(config, base=base)
    feats, costs, groups = _own_batch("sse", 1, 96, seed=3)
    assert one_task.base_weight == 1.0  # before its own trees: the base alone
    one_task.update(feats, costs, groups)
    assert one_task.base_weight == pytest.approx(16 / 112)
    own = one_task._booster.inplace_predict(np.concatenate(feats))
    row_program = np.repeat(np.arange(len(feats)), [f.shape[0] for f in feats])
    base_values = base.row_values(np.concatenate(feats), row_program, np.array([f.shape[0] for f in feats]))
    expected = np.bincount(row_program, weights=own + 16 / 112 * base_values)
    np.testing.assert_allclose(one_task.predict(feats), expected, rtol=1e-5, atol=1e-6)

    many_tasks = XGBCostModel(config, base=base)
    batches = [_own_batch("sse", w, 8, seed=w) for w in range(12)]
    many_tasks.update(*(sum((list(b[i]) for b in batches), []) for i in range(3)))
    assert many_tasks.base_weight == pytest.approx(16 / 24)

    one_task.save(tmp_path / "m.npz")
    assert XGBCostModel.load(tmp_path / "m.npz").base_weight == pytest.approx(16 / 112)


def test_a_model_with_a_base_saves_loads_and_transfers(tmp_path, squared_base):
    base = squared_base.with_descriptor(device_descriptor(SSE))
    model = XGBCostModel(XGBConfig(seed=1, num_warmup_samples=16, num_boost_round=10), base=base)
    feats, costs, groups = _own_batch("sse", 9, 32, seed=9)
    model.update(feats, costs, groups)
    path = tmp_path / "m.npz"
    model.save(path)
    loaded = XGBCostModel.load(path)
    assert loaded.base is not None and loaded.base.info["objective"] == "squared"
    np.testing.assert_array_equal(loaded.base.descriptor, base.descriptor)
    np.testing.assert_array_equal(loaded.predict(feats), model.predict(feats))
    np.testing.assert_array_equal(loaded._history.arrays()["margins"], model._history.arrays()["margins"])
    # transferred to another class: the base scores for the new descriptor, the history is prior
    moved = loaded.transferred("sse", device_descriptor(AVX512))
    assert moved.num_prior == 32 and moved.base is not None
    np.testing.assert_array_equal(moved.base.descriptor, device_descriptor(AVX512))
    assert not np.array_equal(moved.predict(feats), loaded.predict(feats))
    np.testing.assert_array_equal(moved._history.arrays()["margins"], loaded._history.arrays()["margins"])
    # and a model without a base saves no base
    plain = XGBCostModel(XGBConfig(seed=1, num_warmup_samples=16, num_boost_round=5))
    plain.update(feats, costs, groups)
    plain.save(path)
    assert XGBCostModel.load(path).base is None and "margins" not in XGBCostModel.load(path)._history.arrays()


# --- the shipped-model loader ---------------------------------------------------------------


def test_load_pretrained_fits_the_target_or_says_why_not(tmp_path, squared_base):
    model, note = pretrained.load_pretrained(HASWELL, directory=tmp_path)
    assert model is None and "no pretrained cost model for x86" in note
    pretrained.save_pretrained(squared_base, tmp_path / "x86.npz", provenance={"dataset": "synthetic"})
    model, note = pretrained.load_pretrained(HASWELL, config=XGBConfig(seed=3, num_warmup_samples=8), directory=tmp_path)
    assert model is not None and model.num_samples == 0 and model.config.num_warmup_samples == 8
    np.testing.assert_array_equal(model.base.descriptor, device_descriptor(HASWELL))
    assert "squared objective" in note and "2 device classes" in note
    assert model.base.info["provenance"] == {"dataset": "synthetic"} and model.base.info["tvm"] == pretrained.tvm_series()
    gpu, note = pretrained.load_pretrained({"kind": "cuda", "arch": "sm_80"}, directory=tmp_path)
    assert gpu is None and "cuda" in note

    def rewritten(**changes):
        base = BaseTrees(squared_base.booster, squared_base.descriptor, info={**squared_base.info, **changes})
        pretrained.save_pretrained(base, tmp_path / "x86.npz", provenance={})

    rewritten(feature_version=2)
    assert "features version 2" in pretrained.load_pretrained(HASWELL, directory=tmp_path)[1]
    base = BaseTrees(squared_base.booster, squared_base.descriptor, descriptor_version=DESCRIPTOR_VERSION + 1,
                     info=squared_base.info)  # fmt: skip
    pretrained.save_pretrained(base, tmp_path / "x86.npz", provenance={})
    model, note = pretrained.load_pretrained(HASWELL, directory=tmp_path)
    assert model is None and "descriptor version" in note and "not used" in note
    state_tvm = pretrained.save_pretrained(squared_base, tmp_path / "x86.npz", provenance={})
    with np.load(state_tvm) as data:
        state, trees = json.loads(str(data["state"])), data["trees"]
    state["base"]["info"]["tvm"] = "0.1"
    np.savez(tmp_path / "x86.npz", state=np.array(json.dumps(state)), trees=trees)
    model, note = pretrained.load_pretrained(HASWELL, directory=tmp_path)
    assert model is None and "TVM '0.1'" in note
    (tmp_path / "x86.npz").write_bytes(b"not a zip")
    model, note = pretrained.load_pretrained(HASWELL, directory=tmp_path)
    assert model is None and "unreadable" in note


def test_a_run_starts_from_its_own_file_then_the_pretrained_model_then_a_fresh_one(tmp_path, monkeypatch, squared_base):
    monkeypatch.setenv(pretrained.DIRECTORY_ENV, str(tmp_path / "shipped"))
    pretrained.save_pretrained(squared_base, tmp_path / "shipped" / "x86.npz", provenance={})
    logs: list[str] = []
    model, start = cache.start_cost_model(cache.cache_path(HASWELL), HASWELL, seed=1, batch_size=8, log=logs.append)
    assert start.source == "pretrained" and model.base is not None and model.config.num_warmup_samples == 8
    assert start.path == str(tmp_path / "shipped" / "x86.npz") and "pretrained cost model" in logs[-1]
    off, start = cache.start_cost_model(None, HASWELL, seed=1, batch_size=8, log=logs.append, pretrained=False)
    assert start.source == "fresh" and off.base is None
    # the run saves what it learnt with the base; the next run starts from that file
    feats, costs, groups = _own_batch("sse", 9, 16, seed=2)
    model.update(feats, costs, groups)
    cache.save_model(model, cache.cache_path(HASWELL), HASWELL, log=print)
    again, start = cache.start_cost_model(cache.cache_path(HASWELL), HASWELL, seed=1, batch_size=8, log=logs.append)
    assert start.source == "cache" and again.base is not None and again.num_samples == 16
    # a new target starts from the nearest cached one, its base scoring for the new descriptor
    near, start = cache.start_cost_model(cache.cache_path(AVX512), AVX512, seed=1, batch_size=8, log=logs.append)
    assert start.source == "nearest" and near.num_prior == 16
    np.testing.assert_array_equal(near.base.descriptor, device_descriptor(AVX512))


# --- the command line ------------------------------------------------------------------------


def _dataset(tmp_path, workloads=range(6)):
    from tunefarm.dataset import DatasetRow, write_dataset

    rows = []
    for r in _rows(workloads, per_group=24):
        rows.append(DatasetRow(
            device_class=r["device_class"], target=r["target"], task=r["task"], workload=r["workload"], flops=1e6,
            sketch_sig="s", candidate="c", decisions="{}", feature_version=1, features=r["features"], cost=r["cost"],
            costs=[r["cost"]], noise=r["noise"], flushed_calls=False, error="none", verified=True, timestamp=0.0, tvm_version="0.27.0",
            tunefarm_version="0.1.0", cpu_model="synthetic", cores=4, host="h", source="synthetic",
        ))  # fmt: skip
    return write_dataset(rows, tmp_path / "ds.parquet", provenance={"command": "synthetic"})


def test_pretrain_command_compares_objectives_on_held_out_workloads_and_writes_a_loadable_model(tmp_path, capsys):
    ds = _dataset(tmp_path)
    out = tmp_path / "shipped" / "x86.npz"
    argv = ["pretrain", str(ds), "--out", str(out), "--hold-out-workloads", "wl4,wl5", "--compare", "--rounds", "30",
            "--max-depth", "6", "--json"]  # fmt: skip
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["held_out_workloads"] == ["wl4", "wl5"]
    assert set(data["objectives"]) == {"squared", "rank", "statement_mlp"}  # the MLP is the contender
    for entry in data["objectives"].values():
        assert entry["held_out"]["pairwise"] > 0.75 and entry["held_out"]["pairs"] > 0
    assert data["bytes"] == out.stat().st_size < 20 * 2**20
    model, note = pretrained.load_pretrained(HASWELL, directory=out.parent)
    assert model is not None, note
    info = model.base.info
    assert info["objective"] == "rank" and info["classes"] == {"avx512": 96, "sse": 96} and info["tasks"] == 4
    assert info["provenance"]["held_out_workloads"] == ["wl4", "wl5"]
    assert info["provenance"]["datasets"][0]["manifest"]["command"] == "synthetic"


@pytest.mark.parametrize(
    "argv_tail, message",
    [
        (["--hold-out-fraction", "1.5"], "--hold-out-fraction"),
        (["--compare"], "held-out workloads"),
        (["--hold-out-workloads", "nosuch"], "no workload of the dataset"),
        (["--family", "arm"], "no row of device family 'arm'"),
    ],
)
def test_pretrain_command_bad_arguments_exit_2_with_one_line(tmp_path, capsys, argv_tail, message):
    ds = _dataset(tmp_path, workloads=range(2))
    assert main(["pretrain", str(ds), "--out", str(tmp_path / "m.npz"), *argv_tail]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_pretrain_command_on_a_file_that_is_not_a_dataset_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet")
    assert main(["pretrain", str(bad), "--out", str(tmp_path / "m.npz")]) == 2
    assert "not a Parquet dataset" in capsys.readouterr().err
    assert main(["pretrain", str(tmp_path / "none.parquet"), "--out", str(tmp_path / "m.npz")]) == 2
    assert "no such dataset file" in capsys.readouterr().err
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"x": [1]}), tmp_path / "other.parquet")
    assert main(["pretrain", str(tmp_path / "other.parquet"), "--out", str(tmp_path / "m.npz")]) == 2
    assert "not a tunefarm dataset" in capsys.readouterr().err
    assert not (tmp_path / "m.npz").exists()


def test_tune_op_starts_from_the_pretrained_model_unless_told_not_to(tmp_path, monkeypatch, capsys, squared_base):
    monkeypatch.setenv(pretrained.DIRECTORY_ENV, str(tmp_path / "shipped"))
    pretrained.save_pretrained(squared_base, tmp_path / "shipped" / "x86.npz", provenance={})
    argv = ["tune-op", "matmul", "--shape", "M=16,N=16,K=16", "--trials", "2", "--batch-size", "2",
            "--records", str(tmp_path / "r.jsonl"), "--no-progress", "--no-cost-model-cache"]  # fmt: skip
    assert main([*argv, "--json", str(tmp_path / "a.json")]) == 0
    start = json.loads((tmp_path / "a.json").read_text())["cost_model"]
    assert start["start"] == "pretrained" and start["file"] == str(tmp_path / "shipped" / "x86.npz")
    out = capsys.readouterr().out
    assert "cost model pretrained" in out
    assert main([*argv, "--trials", "4", "--no-pretrained", "--json", str(tmp_path / "b.json")]) == 0
    start = json.loads((tmp_path / "b.json").read_text())["cost_model"]
    assert start["start"] == "fresh" and start["file"] is None and "switched off" in start["note"]


# --- the farm: a class with no model starts from the pretrained one ------------------------------


def test_a_farm_class_with_no_model_starts_from_the_pretrained_model_and_its_jobs_say_so(
    db_sessions, tmp_path, squared_base
):
    import uuid

    from farm_state import seed_farm

    from services.api import crud
    from services.db import device_classes, job_store
    from services.db.models import Job
    from services.db.session import transaction
    from services.scheduler.shared_model import ClassModels
    from tunefarm_app.farm_commands import pretrained_text

    shipped = tmp_path / "shipped"
    pretrained.save_pretrained(squared_base, shipped / "x86.npz", provenance={})
    uid = uuid.uuid4().hex[:8]
    with transaction(db_sessions) as s:
        sse = device_classes.ensure_device_class(s, name=f"pre-sse-{uid}", target=SSE).id
        avx512 = device_classes.ensure_device_class(s, name=f"pre-avx512-{uid}", target=AVX512).id

    def models(**kwargs) -> ClassModels:
        return ClassModels(db_sessions, tmp_path / "artifacts", warmup=4, save_every=1000, catch_up_secs=60, **kwargs)

    # no file in the pretrained directory (the tests' empty one), or switched off: fresh, as before
    assert models().get(sse).model.base is None and models().get(sse).pretrained is None
    assert models(pretrained_dir=shipped, pretrained=False).get(sse).model.base is None
    classes = models(pretrained_dir=shipped)
    shared = classes.get(sse)
    assert shared.start_version_id is None and shared.transferred_from is None and shared.model.num_samples == 0
    np.testing.assert_array_equal(shared.model.base.descriptor, device_descriptor(SSE))
    assert shared.pretrained == {"family": "x86", "objective": "squared", "programs": squared_base.info["programs"],
                                 "tasks": 6, "classes": 2, "written": shared.model.base.info["written"]}  # fmt: skip
    # its first batch is ranked by the base, by the class's own rule
    feats, costs, groups = _own_batch("sse", 9, 40, seed=4)
    assert ranking_report(shared.model.predict(feats), _programs(feats, costs, "sse")).pairwise > 0.75
    # its own measurements train on top of it; the version it saves keeps the base
    shared.model.update(feats, costs, groups)
    assert classes.save(shared) == 1
    again = models().get(sse)  # no shipped file needed any more: the version carries its base
    assert again.version == 1 and again.model.num_samples == 40 and again.pretrained["family"] == "x86"
    # a new class transfers the nearest class's model, its base scoring for the new class's device
    near = models().get(avx512)
    assert near.transferred_from.device_class == f"pre-sse-{uid}" and near.pretrained is not None
    np.testing.assert_array_equal(near.model.base.descriptor, device_descriptor(AVX512))

    # a job starting from it records the base; its status says it started from the pretrained model
    state = seed_farm(db_sessions)
    with transaction(db_sessions) as s:
        team = s.get(Job, state.job_b).team_id
        job_store.note_cost_model(s, job_id=state.job_b, pretrained=shared.pretrained)
    with transaction(db_sessions) as s:
        public = crud.job_public(s, team_id=team, job_id=state.job_b, fresh_secs=60.0).cost_model
    assert public.version is None and public.pretrained.family == "x86" and public.pretrained.classes == 2
    words = pretrained_text(public.pretrained.model_dump(), started=True)
    assert words.startswith("the pretrained x86 model (squared objective") and "no model of its own" in words
    with transaction(db_sessions) as s:
        other = crud.job_public(s, team_id=s.get(Job, state.job_a).team_id, job_id=state.job_a, fresh_secs=60.0)
    assert other.cost_model.pretrained is None  # a job that recorded none
