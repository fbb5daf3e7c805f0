"""Whole models end to end (`tunefarm tune`): a tiny model tuned with a small budget
matches onnxruntime, an interrupted run resumes without measuring anything twice,
several models share their tasks, records export to a MetaSchedule database that TVM's
stock Relax pipeline applies, and the command line's errors are one line."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("torch")

from onnx import TensorProto, helper  # noqa: E402

from tunefarm.models import examples  # noqa: E402
from tunefarm.records import TimingConfig  # noqa: E402
from tunefarm.search.config import batch_size_for  # noqa: E402
from tunefarm.search.session import SessionCallback  # noqa: E402
from tunefarm.store import JsonlRecordStore  # noqa: E402
from tunefarm.tune import tune_models  # noqa: E402
from tunefarm_app.cli import main  # noqa: E402

TARGET = {"kind": "llvm", "num-cores": 2}
# Two short repeats per kernel: what these tests check is the machinery, not which kernel is fastest.
SHORT_TIMING = TimingConfig(repeat=2, min_repeat_ms=5.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return examples.export_example("conv_bn_relu", tmp_path_factory.mktemp("models") / "tiny.onnx")


class StopAfter(SessionCallback):
    """Interrupts the run (as Ctrl-C would) once `n` measurements have arrived."""

    def __init__(self, n: int):
        self.n = n

    def on_records(self, session, tuner, records) -> None:
        if session.trials - session.resumed >= self.n:
            raise KeyboardInterrupt


@pytest.mark.slow
def test_tune_a_tiny_model_interrupt_resume_and_match_onnxruntime(tiny, tmp_path):
    out = tmp_path / "tuned"
    with pytest.raises(KeyboardInterrupt):
        tune_models([tiny], trials=16, out=out, target=TARGET, callbacks=[StopAfter(5)], algorithms=(),
                    timing=SHORT_TIMING, log=lambda m: None)  # fmt: skip
    first = JsonlRecordStore(out / "records.jsonl").load()
    assert 5 <= len(first) < 16  # what was measured before the interruption is kept

    # timed beside onnxruntime only: OpenVINO's timing is test_model_check's
    result = tune_models([tiny], trials=16, out=out, target=TARGET, algorithms=(), peers=("onnxruntime",),
                         timing=SHORT_TIMING, final_rounds=3, log=lambda m: None)  # fmt: skip
    records = JsonlRecordStore(out / "records.jsonl").load()
    assert len(records) == 16 and result.tune.resumed == len(first)
    assert result.report["conv_layout"] == "nhwc"
    assert max(Counter((r.task, r.candidate.key) for r in records).values()) == 1  # nothing measured twice

    report = json.loads((out / "report.json").read_text())
    (model,) = report["models"]
    assert model["check"]["ok"] and model["check"]["reference"] == "onnxruntime"
    assert model["latency"]["median"] > 0 and model["onnxruntime_latency"]["median"] > 0
    assert all(t["trials"] > 0 for t in model["tasks"])  # every task got at least one round
    assert {t["schedule"] for t in model["tasks"]} == {"tuned"}
    rounds = report["task_scheduler"]["rounds"]  # this run's choices (the resumed rounds had theirs)
    assert rounds and {r["reason"] for r in rounds} <= {"warm-up", "gradient", "epsilon", "round-robin"}
    assert all(r["task_name"] for r in rounds)
    assert report["timeline"] and report["timeline"][-1]["trials"] == 16
    # the final rounds: a task whose fastest kernels were measured again takes their pick
    final = report["final_rounds"]
    rows = {t["name"]: t for t in model["tasks"]}
    assert final["rounds"] == 3 and set(final["tasks"]) <= set(rows)
    for name, picked in final["tasks"].items():
        assert picked["finalists"] >= 2 and rows[name]["best_seconds"] == picked["final_seconds"] > 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert [i["name"] for i in manifest["inputs"]] == [i["name"] for i in model["inputs"]]

    # `tunefarm run` on the result, with an input from a file
    x = np.random.default_rng(1).standard_normal(model["inputs"][0]["shape"]).astype("float32")
    np.save(tmp_path / "x.npy", x)
    name = model["inputs"][0]["name"]
    assert main(["run", str(out), "--input", f"{name}=" + str(tmp_path / "x.npy"), "--out",
                 str(tmp_path / "o.npz"), "--repeat", "3"]) == 0
    from tunefarm.models.importer import run_onnxruntime

    (want,) = run_onnxruntime(tiny.read_bytes(), {name: x})
    got = np.load(tmp_path / "o.npz")[model["outputs"][0]["name"]]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_two_models_share_identical_tasks_and_records_export_to_relax(tiny, tmp_path):
    import tvm
    from tvm import relax
    from tvm.s_tir import meta_schedule as ms

    twin = tmp_path / "twin.onnx"
    twin.write_bytes(tiny.read_bytes())
    out = tmp_path / "both"
    result = tune_models([tiny, twin], trials=8, out=out, target=TARGET, algorithms=(), peers=(),
                         timing=SHORT_TIMING, log=lambda m: None)  # fmt: skip
    report = result.report
    assert [m["name"] for m in report["models"]] == ["tiny", "twin"]
    assert len(result.tune.tasks) == len(report["models"][0]["tasks"])  # shared, not doubled
    assert all(dict(i.weights).keys() == {"tiny", "twin"} for i in result.tune.infos)
    assert (out / "tiny" / "model.so").is_file() and (out / "twin" / "model.so").is_file()

    # export-ms, then TVM's stock pipeline: MetaScheduleApplyDatabase on the fused module
    assert main(["export-ms", str(out / "records.jsonl"), "--out", str(tmp_path / "db")]) == 0
    from tunefarm.models.importer import import_model, random_inputs, run_onnxruntime
    from tunefarm.models.tasks import fuse

    imported = import_model(tiny.read_bytes())
    fused = fuse(imported.mod)
    target = tvm.target.Target(TARGET)
    db = ms.database.JSONDatabase(work_dir=str(tmp_path / "db"))
    with target, db:
        applied = relax.transform.MetaScheduleApplyDatabase()(fused)
    scheduled = [gv.name_hint for gv, f in applied.functions.items()
                 if isinstance(f, tvm.tirx.PrimFunc) and f.attrs and "tirx.is_scheduled" in f.attrs]
    assert scheduled, "no function took a schedule from the exported database"
    vm = relax.VirtualMachine(tvm.compile(applied, target=target), tvm.cpu())
    feeds = random_inputs({t.name: t.shape for t in imported.inputs}, {t.name: t.dtype for t in imported.inputs})
    out_tvm = vm["main"](*[tvm.runtime.tensor(feeds[t.name]) for t in imported.inputs])
    got = out_tvm.numpy() if hasattr(out_tvm, "numpy") else out_tvm[0].numpy()
    (want,) = run_onnxruntime(tiny.read_bytes(), feeds)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_torch_module_through_the_python_api(tmp_path):
    import torch

    import tunefarm

    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).eval()
    x = torch.randn(2, 16)
    result = tunefarm.tune_model(net, example_inputs=(x,), trials=6, out=tmp_path / "t", target=TARGET, peers=(),
                                 timing=SHORT_TIMING, log=lambda m: None)  # fmt: skip
    (model,) = result.report["models"]
    assert model["check"]["ok"] and model["check"]["reference"] == "torch"


def test_batch_size_gives_every_task_rounds():
    assert batch_size_for(2000, 18) == 32
    assert batch_size_for(300, 7) == 14
    assert batch_size_for(60, 10) == 4
    assert batch_size_for(24, 7) == 3  # 7 x 3 <= 24: every task gets its warm-up round


def _unsupported_model(path: Path) -> Path:
    node = helper.make_node("Celu", ["x"], ["y"], name="my_celu")
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.write_bytes(model.SerializeToString())
    return path


def _dynamic_model(path: Path) -> Path:
    node = helper.make_node("Relu", ["x"], ["y"])
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.write_bytes(model.SerializeToString())
    return path


@pytest.mark.parametrize(
    "make, extra, words",
    [
        (lambda p: (p.write_bytes(b"\x08\x07garbage" * 10), p)[1], [], "not a valid ONNX model"),
        (_unsupported_model, [], "Celu"),
        (_dynamic_model, [], "--input-shape x="),
        (_dynamic_model, ["--input-shape", "x=1,4,5"], "x"),
        (lambda p: p, [], "no such model file"),
    ],
)
@pytest.mark.parametrize("command", ["tasks", "tune"])
def test_model_errors_are_one_line_and_exit_2(make, extra, words, command, tmp_path, capsys):
    path = make(tmp_path / "m.onnx")
    argv = [command, str(path), *extra] + (["--out", str(tmp_path / "o"), "--trials", "4"] if command == "tune" else [])
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1 and "Traceback" not in err, err


def test_negative_final_rounds_are_one_line_and_nothing_is_written(tiny, tmp_path, capsys):
    assert main(["tune", str(tiny), "--out", str(tmp_path / "o"), "--trials", "4", "--final-rounds", "-1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "tunefarm: error: --final-rounds must be at least 0"
    assert not (tmp_path / "o").exists()


def test_tasks_command_prints_the_table(tiny, capsys):
    assert main(["tasks", str(tiny)]) == 0
    out = capsys.readouterr().out
    assert "tiny: 4 tasks" in out and "fused_conv2d" in out and "transpose" in out  # NHWC between transposes
    # in the model's own layout (NCHW): the convolutions alone, no transposes around them
    assert main(["tasks", str(tiny), "--conv-layout", "model"]) == 0
    out = capsys.readouterr().out
    assert "tiny: 2 tasks" in out and "transpose" not in out
    assert main(["tasks", str(tiny), "--conv-layout", "nchw"]) == 2
    assert "invalid choice: 'nchw'" in capsys.readouterr().err


def test_cli_module_runs_tasks_in_a_fresh_process(tiny):
    out = subprocess.run([sys.executable, "-m", "tunefarm_app.cli", "tasks", str(tiny)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and "4 tasks" in out.stdout
