"""`tunefarm bench pretrained`: held-out workloads tuned cold and from a pretrained model
(a tiny synthetic model trained here: no pretrained file ships with the tests), and its
refusal to bench a workload the model learnt from."""

from __future__ import annotations

import json
import math

import pytest
from test_pretrained import _dataset, _rows

from tunefarm.search.cost_model import pretrained
from tunefarm.search.cost_model.pretrain import (
    PretrainConfig,
    held_out_mask,
    pretrain,
    trained_workloads,
    training_programs,
    workload_identity,
)
from tunefarm.workloads.registry import make
from tunefarm_app.bench.cold_warm import reach, trials_ratio
from tunefarm_app.bench.pretrained import target_means, trained_class
from tunefarm_app.cli import main

SSE_HERE = '{"kind": "llvm", "mcpu": "x86-64-v2", "num-cores": 2}'
"""The synthetic SSE class's target (test_pretrained.SSE): a class the model was trained on."""


def _model(tmp_path, rows) -> str:
    base = pretrain(training_programs(rows), PretrainConfig(num_boost_round=10, max_depth=4)).base
    return str(pretrained.save_pretrained(base, tmp_path / "model.npz", provenance={"dataset": "synthetic"}))


def _as(rows, workload, task=None):
    """The rows of task0, renamed to another workload (and task key)."""
    return [dict(r, workload=workload, task=task or r["task"]) for r in rows if r["task"] == "task0"]


def test_a_models_metadata_names_its_workloads_and_classes_and_held_out_matches_by_key():
    matmul = make("matmul", {"M": 16, "N": 16, "K": 16})
    rows = _rows(range(2), per_group=4) + _as(_rows(range(1), per_group=4), matmul.name, f"{matmul.key}@abcd1234")
    programs = training_programs(rows)
    info = pretrain(programs, PretrainConfig(num_boost_round=3, max_depth=3)).base.info
    trained = trained_workloads(info)
    assert {"wl0", "wl1", matmul.name, workload_identity(matmul.key)} <= trained
    assert set(info["class_targets"]) == {"avx512", "sse"} and info["class_targets"]["sse"]["mcpu"] == "x86-64-v2"
    assert trained_workloads({"workloads": 3}) is None  # a file written before the names were recorded
    # the same computation with a constant input is the same workload; a task key of another target too
    const = matmul.with_constants(["B"])
    assert const.key != matmul.key and workload_identity(const.key) == workload_identity(matmul.key)
    assert held_out_mask(programs, [const.key]).sum() == 8 and held_out_mask(programs, ["wl1"]).sum() == 8
    assert held_out_mask(programs, ["matmul(M=32,N=16,K=16)"]).sum() == 0
    # a target is labelled with the training class of the same device descriptor
    assert trained_class(info, json.loads(SSE_HERE)) == "sse"
    assert trained_class(info, {"kind": "llvm", "mcpu": "haswell", "num-cores": 2}) is None


def test_trials_to_reach_the_cold_runs_final_best():
    inf = math.inf
    r = reach("w", [3.0, inf, 2.0, 1.0, 1.01], [2.5, 1.015, 0.9], tolerance=0.02, budget=5)
    assert (r.cold_best, r.cold_trials, r.warm_trials, r.warm_best) == (1.0, 4, 2, 0.9) and r.ratio == 0.5
    never = reach("w", [2.0, 1.0], [3.0, 2.0], tolerance=0.0, budget=2)
    assert never.warm_trials is None and never.ratio == trials_ratio(None, 2, 2) == 1.5
    from tunefarm.errors import UsageError

    with pytest.raises(UsageError, match="no valid kernel"):
        reach("w", [inf], [1.0], tolerance=0.0, budget=1)


def test_the_means_are_per_target_over_workloads_and_seeds():
    from tunefarm_app.bench.pretrained import PretrainedRow

    rows = [PretrainedRow("a", "sse", f"w{i}", s, 1.0, 1.0, 4, p, 8, p / 4) for i, (s, p) in enumerate([(1, 1), (2, 4)])]
    rows.append(PretrainedRow("b", None, "w0", 1, 1.0, 2.0, 2, None, 8, 4.5))
    means = target_means(rows)
    assert [m["target"] for m in means] == ["a", "b"]
    assert means[0]["ratio_geomean"] == pytest.approx(0.5) and means[0]["reached"] == 2
    assert means[1]["trained_class"] is None and means[1]["reached"] == 0 and means[1]["best_geomean"] == 2.0


def test_bench_pretrained_refuses_a_workload_the_model_was_trained_on(tmp_path, capsys):
    matmul = make("matmul", {"M": 16, "N": 16, "K": 16})
    model = _model(tmp_path, _rows(range(3), per_group=6) + _as(_rows(range(1), per_group=6), matmul.name))
    argv = ["bench", "pretrained", "--model", model, "--workload", "matmul:M=16,N=16,K=16", "--target", SSE_HERE]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "matmul(M=16,N=16,K=16)" in err and "not held out" in err and len(err.strip().splitlines()) == 1
    # a model that does not record its workloads cannot tell: refused too
    base = pretrained.read_pretrained(model)
    info = {k: v for k, v in base.info.items() if k not in ("workload_names", "workload_keys")}
    from dataclasses import replace

    pretrained.save_pretrained(replace(base, info=info), tmp_path / "old.npz", provenance={})
    assert main([*argv[:3], str(tmp_path / "old.npz"), *argv[4:]]) == 2
    assert "does not record the workloads" in capsys.readouterr().err
    assert main([*argv[:5], "nosuch:M=1", *argv[6:]]) == 2
    assert "not a registry op" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_pretrained_trains_without_the_held_out_workloads_and_prints_the_ratios(tmp_path, capsys):
    """2 small ops, 8 trials each, 1 seed, on the synthetic SSE class: the dataset holds
    one of them, which the trained model leaves out."""
    ops = ["matmul:M=16,N=16,K=16", "matmul:M=16,N=32,K=16"]
    held = make("matmul", {"M": 16, "N": 16, "K": 16})
    dataset = _dataset(tmp_path, workloads=range(3))
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(dataset).to_pylist()
    for row in table:
        if row["workload"] == "wl0":
            row.update(workload=held.name, task=f"{held.key}@00000000")
    pq.write_table(pa.Table.from_pylist(table, schema=pq.read_schema(dataset)), dataset)
    argv = ["bench", "pretrained", "--datasets", str(dataset), "--rounds", "10", "--target", SSE_HERE,
            "--trials", "8", "--batch-size", "4", "--work-dir", str(tmp_path / "work"),
            "--repeat", "2", "--min-repeat-ms", "5"]  # fmt: skip  # the ratios are the test, not the kernels' speed
    for op in ops:
        argv += ["--workload", op]
    assert main([*argv, "--json", str(tmp_path / "bench.json")]) == 0
    out = capsys.readouterr().out
    assert "pre/cold" in out and "cold trials" in out and "pretrained/cold trials geometric mean" in out
    assert "trained: sse" in out
    data = json.loads((tmp_path / "bench.json").read_text())
    assert [r["workload"] for r in data["rows"]] == ["matmul(M=16,N=16,K=16)", "matmul(M=16,N=32,K=16)"]
    for r in data["rows"]:
        assert 1 <= r["cold_trials"] <= 8 and r["budget"] == 8 and r["trained_class"] == "sse"
        pre = r["pretrained_trials"] if r["pretrained_trials"] is not None else 9
        assert r["ratio"] == pytest.approx(pre / r["cold_trials"])
    assert data["geomeans"][0]["rows"] == 2 and data["geomeans"][0]["ratio_geomean"] > 0
    assert (data["timing"]["repeat"], data["timing"]["min_repeat_ms"]) == (2, 5.0)
    info = pretrained.read_pretrained(data["model"]).info
    assert held.name not in info["workload_names"] and "wl1" in info["workload_names"]
    assert held.name in info["provenance"]["held_out_workloads"]
    # each run started as asked (`tune_run` checks), and neither left a cost model behind
    assert [p.name for p in (tmp_path / "work").rglob("*.npz")] == ["pretrained-x86.npz"]


def test_a_models_tasks_are_held_out_too_and_refused_when_trained_on(tmp_path, capsys):
    from onnx_models import gpu_mix_onnx

    from tunefarm_app.bench.pretrained import held_out_workloads

    onnx = gpu_mix_onnx(tmp_path / "mix.onnx")
    workloads = held_out_workloads(["matmul:M=16,N=16,K=16"], onnx)
    assert workloads[0].name == "matmul(M=16,N=16,K=16)" and len(workloads) > 2
    assert all(w.name.startswith("mix:") for w in workloads[1:])
    task = workloads[-1].workload
    model = _model(tmp_path, _rows(range(2), per_group=6) + _as(_rows(range(1), per_group=6), "a-name", f"{task.key}@1"))
    assert main(["bench", "pretrained", "--model", model, "--model-tasks", str(onnx), "--target", SSE_HERE]) == 2
    err = capsys.readouterr().err
    assert workloads[-1].name in err and "not held out" in err and len(err.strip().splitlines()) == 1
