"""The command line: bad input gets one line and exit status 2; sketches are printed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tunefarm_app.cli import main


@pytest.mark.parametrize(
    "argv, words",
    [
        (["tune-op", "nosuchop"], "unknown workload 'nosuchop'"),
        (["tune-op", "matmul", "--shape", "M=x"], "M must be an integer"),
        (["tune-op", "matmul", "--shape", "Q=3"], "unknown parameter 'Q'"),
        (["tune-op", "matmul", "--trials", "0"], "--trials must be at least 1"),
        (["tune-op", "matmul", "--target", "{nope"], "not valid JSON"),
        (["tune-op", "matmul", "--target", '{"kind": "nosuchkind"}'], "TVM rejects the target"),
        (["tune-op", "matmul", "--target", '{"kind": "llvm", "mcpu": "bogus"}'], "LLVM knows no CPU 'bogus'"),
        (["tune-op", "missing_file.py:f"], "no such file"),
        (["apply-best", "missing.jsonl", "--out", "x.so"], "no such records file"),
        (["tune-op"], "required"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, words, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert words in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_empty_records_file(tmp_path, capsys):
    path = tmp_path / "empty.jsonl"
    path.write_text("not json\n")
    assert main(["apply-best", str(path), "--out", str(tmp_path / "x.so")]) == 2
    assert "holds no records (1 unreadable lines)" in capsys.readouterr().err


def test_sketches_command_prints_the_fusion_sketch(capsys):
    assert main(["sketches", "matmul_relu", "--shape", "M=64,N=64,K=64"]) == 0
    out = capsys.readouterr().out
    assert "2 sketches" in out
    assert "fuse relu into the tile of C" in out
    assert "fusible-consumer=relu" in out


def test_console_script_runs():
    out = subprocess.run(
        [sys.executable, "-m", "tunefarm_app.cli", "tune-op", "nosuchop"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and out.stderr.startswith("tunefarm: error:")


@pytest.mark.slow
def test_tune_op_on_a_tvmscript_file_then_apply_best(tmp_path, capsys, host_target):
    """The README's flow on a user's TVMScript kernel: tune a few trials (reference from
    the unscheduled program), write the report, rebuild the best kernel. The run keeps
    its cost model in the per-target cache, and the next run starts from it."""
    import json
    from pathlib import Path

    import numpy as np
    import tvm

    from tunefarm.search.cost_model.cache import cache_path

    kernel = Path(__file__).resolve().parents[1] / "examples" / "kernel.py"
    records, report = tmp_path / "k.jsonl", tmp_path / "k.json"
    argv = ["tune-op", str(kernel), "--trials", "6", "--batch-size", "3", "--records", str(records), "--json", str(report), "--no-progress"]
    assert main(argv) == 0
    data = json.loads(report.read_text())
    assert data["trials"] == 6 and data["verified"] is True and data["reference_available"] is True
    assert data["best_schedule"]["tvm_trace"] and data["gflops"] > 0
    assert len(records.read_text().splitlines()) == 6
    cached = cache_path(host_target)
    assert cached.is_file()
    capsys.readouterr()
    assert main([*argv[:3], "9", *argv[4:]]) == 0  # three more trials, from the cached model
    assert f"cost model: {cached} (" in capsys.readouterr().err
    lib_path = tmp_path / "k.so"
    assert main(["apply-best", str(records), "--out", str(lib_path)]) == 0
    lib = tvm.runtime.load_module(str(lib_path))
    a = np.random.rand(256, 512).astype("float32")
    b = np.random.rand(384, 512).astype("float32")
    c = tvm.runtime.empty((256, 384), "float32", tvm.cpu())
    lib["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b), c)
    np.testing.assert_allclose(c.numpy(), a @ b.T, rtol=1e-4, atol=1e-3)


def test_output_into_a_closed_pipe_is_not_a_traceback():
    """`tunefarm sketches conv2d | head -1`: the reader goes away before we write."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tunefarm_app.cli", "sketches", "conv2d"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc.stdout.close()  # closed long before the CLI has imported TVM and prints
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 0
    assert "Traceback" not in err and "BrokenPipe" not in err


def test_a_small_space_stops_early_and_says_why(tmp_path, capsys):
    """An elementwise epilogue has only a handful of distinct programs: tuning stops when
    they are all measured, and both the summary and the report say so."""
    import json
    from pathlib import Path

    ops = Path(__file__).resolve().parents[1] / "examples" / "my_ops.py"
    report = tmp_path / "r.json"
    argv = ["tune-op", f"{ops}:bias_gelu", "--shape", "M=8,N=16", "--trials", "40", "--batch-size", "8"]
    argv += ["--records", str(tmp_path / "r.jsonl"), "--json", str(report), "--no-progress"]
    assert main(argv) == 0
    data = json.loads(report.read_text())
    assert data["stop_reason"] == "search space exhausted" and 0 < data["trials"] < 40
    assert "stopped    before the trial budget: search space exhausted" in capsys.readouterr().out
