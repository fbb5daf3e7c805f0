"""The measurement layer: isolated workers, the builder, the runner and task data.

One LocalBuilder and one LocalRunner are shared by the whole module (each worker pays
the ~2 s `import tvm` once); the tests that crash or hang a kernel also check that the
next kernel on the same runner still runs. No test asserts on timings.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from tvm import te  # noqa: E402
from tvm.script import tirx as T  # noqa: E402

from tunefarm.isolation import CallStatus, IsolatedWorker, summarize_error  # noqa: E402
from tunefarm.measure.builder import LocalBuilder  # noqa: E402
from tunefarm.measure.runner import LocalRunner, calls_per_flushed_repeat, kernel_output_mismatch  # noqa: E402
from tunefarm.measure.task_data import add_expected_from, read_task_data, write_task_data  # noqa: E402
from tunefarm.records import BuildInput, ErrorKind, RunInput, TimingConfig  # noqa: E402
from tunefarm.target import host_target_dict  # noqa: E402
from tunefarm.workloads import Workload, workload_from_prim_func, workload_from_te  # noqa: E402

FAST = TimingConfig(repeat=2, min_repeat_ms=1.0)


# -- workloads ----------------------------------------------------------------------------


def gemm(n: int = 64, *, reference: bool = True, wrong: bool = False) -> Workload:
    a = te.placeholder((n, n), "float32", name="A")
    b = te.placeholder((n, n), "float32", name="B")
    k = te.reduce_axis((0, n), name="k")
    c = te.compute((n, n), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k), name="C")
    ref = (lambda x, y: [x @ y + (1.0 if wrong else 0.0)]) if reference else None
    return workload_from_te(f"gemm{n}", [a, b, c], reference=ref)


def gemm_trace(wl: Workload, block: str = "C") -> list:
    """A small hand-written schedule (tile, reorder, parallel, vectorize) as trace JSON data."""
    sch = tvm.s_tir.Schedule(wl.mod)
    i, j, k = sch.get_loops(sch.get_sblock(block))
    i0, i1 = sch.split(i, [None, 8])
    j0, j1 = sch.split(j, [None, 16])
    sch.reorder(i0, j0, i1, k, j1)
    sch.parallel(i0)
    sch.vectorize(j1)
    return json.loads(json.dumps(sch.trace.as_json(), default=lambda o: o.value))


_WORKLOAD_DIR: list[Path] = []


def wl_file(wl: Workload) -> str:
    """The workload as the builder takes it: the path of its IRModule JSON."""
    import tempfile

    if not _WORKLOAD_DIR:
        _WORKLOAD_DIR.append(Path(tempfile.mkdtemp(prefix="tunefarm-test-wl-")))
    path = _WORKLOAD_DIR[0] / f"{wl.key.replace('#', '_')}.json"
    path.write_text(wl.to_json())
    return str(path)


@T.prim_func(s_tir=True)
def aborting_copy(A: T.Buffer((4,), "float32"), B: T.Buffer((4,), "float32")):
    for i in range(4):
        with T.sblock("B"):
            vi = T.axis.spatial(4, i)
            T.evaluate(T.call_extern("int32", "abort"))
            B[vi] = A[vi]


@T.prim_func(s_tir=True)
def sleeping_copy(A: T.Buffer((4,), "float32"), B: T.Buffer((4,), "float32")):
    for i in range(4):
        with T.sblock("B"):
            vi = T.axis.spatial(4, i)
            T.evaluate(T.call_extern("int32", "sleep", 1000))
            B[vi] = A[vi]


# -- fixtures -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target() -> dict:
    return host_target_dict()


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("measure")


@pytest.fixture(scope="module")
def builder(work):
    with LocalBuilder(work / "artifacts", n_workers=2) as b:
        b.start()
        yield b


@pytest.fixture(scope="module")
def runner():
    with LocalRunner(num_threads=1) as r:
        r.start()
        yield r


@pytest.fixture(scope="module")
def gemm_built(builder, work, target):
    """The 64x64 GEMM, unscheduled and scheduled: (workload, task data, [BuildResult x2])."""
    wl = gemm()
    results = builder.build(
        [
            BuildInput("naive", wl_file(wl), None, target),
            BuildInput("tiled", wl_file(wl), gemm_trace(wl), target),
        ]
    )
    return wl, write_task_data(work / "gemm.npz", wl), results


def run_input(key: str, artifact: str, task_data: str, wl: Workload, **kw) -> RunInput:
    kw.setdefault("timing", FAST)
    kw.setdefault("verify", True)
    return RunInput(key, artifact, task_data, len(wl.inputs), len(wl.outputs), **kw)


def build_one(builder, wl: Workload, target, trace: list | None = None, key: str = "k") -> str:
    (result,) = builder.build([BuildInput(key, wl_file(wl), trace, target)])
    assert result.error_kind is ErrorKind.NONE, result.error_msg
    return result.artifact


# -- builder + runner ---------------------------------------------------------------------


def test_build_and_run_gemm(gemm_built, runner):
    wl, task_data, builds = gemm_built
    for b in builds:
        assert b.error_kind is ErrorKind.NONE, b.error_msg
        assert Path(b.artifact).is_file() and b.build_secs > 0
    assert builds[0].artifact != builds[1].artifact
    results = runner.run([run_input(b.candidate_key, b.artifact, task_data, wl) for b in builds])
    for b, r in zip(builds, results, strict=True):
        assert r.candidate_key == b.candidate_key
        assert r.error_kind is ErrorKind.NONE, r.error_msg
        assert r.verified
        assert len(r.costs) == FAST.repeat and all(c > 0 for c in r.costs)
        assert r.run_secs > 0


def test_slow_kernel_is_timed_once(gemm_built, runner):
    wl, task_data, builds = gemm_built
    slow_cutoff = TimingConfig(repeat=3, min_repeat_ms=1.0, slow_cutoff_secs=0.0)
    (r,) = runner.run([run_input("naive", builds[0].artifact, task_data, wl, timing=slow_cutoff)])
    assert r.error_kind is ErrorKind.NONE and len(r.costs) == 1


def test_flushing_before_every_call_gives_one_cost_per_repeat(gemm_built, runner):
    wl, task_data, builds = gemm_built
    flushed = TimingConfig(repeat=3, min_repeat_ms=1.0, flush_every_call=True, max_flushed_calls=4)
    (r,) = runner.run([run_input("tiled", builds[1].artifact, task_data, wl, timing=flushed)])
    assert r.error_kind is ErrorKind.NONE, r.error_msg
    assert r.verified and len(r.costs) == 3 and all(c > 0 for c in r.costs)
    assert r.flushed_calls
    (warm,) = runner.run([run_input("tiled", builds[1].artifact, task_data, wl)])
    assert not warm.flushed_calls


def test_calls_per_flushed_repeat_fill_the_repeat_within_bounds():
    timing = TimingConfig(min_repeat_ms=40.0, max_flushed_calls=64)
    assert calls_per_flushed_repeat(timing, 0.010) == 4  # 40 ms of 10 ms calls
    assert calls_per_flushed_repeat(timing, 1e-6) == 64  # capped
    assert calls_per_flushed_repeat(timing, 2.0) == 1  # a slow kernel is called once
    assert calls_per_flushed_repeat(replace(timing, max_flushed_calls=0), 1e-6) == 1


def test_timing_reaches_an_agent_unchanged():
    from services.protocol import wire

    timing = TimingConfig(repeat=7, min_repeat_ms=12.5, flush_every_call=True, max_flushed_calls=9)
    assert wire.timing_from_pb(wire.timing_to_pb(timing)) == timing


def test_build_errors_do_not_spoil_the_batch(builder, target):
    wl = gemm(32)
    good = gemm_trace(wl)
    results = builder.build(
        [
            BuildInput("good", wl_file(wl), good, target),
            BuildInput("no-such-block", wl_file(wl), json.loads(json.dumps(good).replace('"C"', '"no_such_block"')), target),
            BuildInput("bad-target", wl_file(wl), None, {"kind": "no_such_kind"}),
            BuildInput("bad-trace", wl_file(wl), [["not", "a trace"]], target),
            BuildInput("good-naive", wl_file(wl), None, target),
        ]
    )
    keys = ["good", "no-such-block", "bad-target", "bad-trace", "good-naive"]
    assert [r.candidate_key for r in results] == keys
    ok, err = ErrorKind.NONE, ErrorKind.BUILD_ERROR
    assert [r.error_kind for r in results] == [ok, err, err, err, ok]
    block, kind, js = results[1].error_msg, results[2].error_msg, results[3].error_msg
    assert "replaying the schedule trace" in block and "no_such_block" in block
    assert "target" in kind and "no_such_kind" in kind
    assert "replaying the schedule trace" in js
    for r in results[1:4]:
        assert r.artifact is None and len(r.error_msg) <= 300
    assert Path(results[0].artifact).is_file() and Path(results[4].artifact).is_file()


def test_build_timeout(builder, target):
    wl = gemm(32)
    (r,) = builder.build([BuildInput("slow", wl_file(wl), gemm_trace(wl), target, timeout_secs=0.001)])
    assert r.error_kind is ErrorKind.BUILD_TIMEOUT and r.artifact is None
    assert "no answer within" in r.error_msg
    build_one(builder, wl, target)  # the killed worker is replaced


def test_crashing_kernel(builder, runner, gemm_built, work, target):
    wl, task_data, builds = gemm_built
    bad = workload_from_prim_func("aborting_copy", aborting_copy)
    artifact = build_one(builder, bad, target)
    bad_data = write_task_data(work / "copy.npz", bad)
    crash, after = runner.run(
        [run_input("abort", artifact, bad_data, bad), run_input("tiled", builds[1].artifact, task_data, wl)]
    )
    assert crash.error_kind is ErrorKind.RUN_CRASH and crash.costs == ()
    assert "SIGABRT" in crash.error_msg
    assert after.error_kind is ErrorKind.NONE and after.verified


def test_hanging_kernel(builder, runner, gemm_built, work, target):
    wl, task_data, builds = gemm_built
    bad = workload_from_prim_func("sleeping_copy", sleeping_copy)
    artifact = build_one(builder, bad, target)
    bad_data = write_task_data(work / "copy.npz", bad)
    hang, after = runner.run(
        [
            run_input("sleep", artifact, bad_data, bad, timeout_secs=2.0),
            run_input("tiled", builds[1].artifact, task_data, wl),
        ]
    )
    assert hang.error_kind is ErrorKind.RUN_TIMEOUT and hang.costs == ()
    assert "2 s" in hang.error_msg
    assert after.error_kind is ErrorKind.NONE and after.verified


def test_missing_artifact_is_a_run_error(runner, gemm_built, work):
    wl, task_data, _ = gemm_built
    (r,) = runner.run([run_input("gone", str(work / "no_such.so"), task_data, wl)])
    assert r.error_kind is ErrorKind.RUN_ERROR and r.error_msg


def test_wrong_result(runner, gemm_built, work):
    wl, _, builds = gemm_built
    wrong_data = write_task_data(work / "gemm_wrong.npz", gemm(reference=True, wrong=True))
    (r,) = runner.run([run_input("tiled", builds[1].artifact, wrong_data, wl)])
    assert r.error_kind is ErrorKind.WRONG_RESULT and not r.verified and r.costs == ()
    assert "max abs error 1" in r.error_msg and "output_0" in r.error_msg


def test_save_outputs_then_add_expected(runner, gemm_built, work):
    wl, _, builds = gemm_built
    no_ref = gemm(reference=False)
    task_data = write_task_data(work / "gemm_noref.npz", no_ref)
    assert read_task_data(task_data).expected is None

    # Without a reference the kernel runs and is timed but not verified.
    saved = str(work / "naive_out.npz")
    (r,) = runner.run([run_input("naive", builds[0].artifact, task_data, wl, save_outputs=saved)])
    assert r.error_kind is ErrorKind.NONE and not r.verified and r.costs
    data = read_task_data(task_data)
    with np.load(saved) as out:
        np.testing.assert_allclose(out["output_0"], data.inputs[0] @ data.inputs[1], rtol=1e-4, atol=1e-4)

    # Folded in, the naive program's output verifies the tiled one.
    add_expected_from(task_data, saved)
    assert read_task_data(task_data).expected is not None
    (r,) = runner.run([run_input("tiled", builds[1].artifact, task_data, wl)])
    assert r.error_kind is ErrorKind.NONE and r.verified


# -- task data and output checks (no kernels) ----------------------------------------------


def test_task_data_is_deterministic(work):
    wl = gemm(8)
    a = read_task_data(write_task_data(work / "a.npz", wl, seed=3))
    b = read_task_data(write_task_data(work / "b.npz", wl, seed=3))
    c = read_task_data(write_task_data(work / "c.npz", wl, seed=4))
    assert all(np.array_equal(x, y) for x, y in zip(a.inputs, b.inputs, strict=True))
    assert not np.array_equal(a.inputs[0], c.inputs[0])
    assert a.inputs[0].dtype == np.float32 and -1 <= a.inputs[0].min() and a.inputs[0].max() < 1
    assert a.output_specs == (((8, 8), "float32"),)
    np.testing.assert_allclose(a.expected[0], a.inputs[0] @ a.inputs[1], rtol=1e-5)


def test_integer_inputs(work):
    x = te.placeholder((16,), "int32", name="x")
    y = te.compute((16,), lambda i: x[i] * 2, name="y")
    data = read_task_data(write_task_data(work / "int.npz", workload_from_te("double", [x, y])))
    assert data.inputs[0].dtype == np.int32 and 0 <= data.inputs[0].min() and data.inputs[0].max() < 8
    assert data.expected is None


def test_add_expected_checks_shapes(work):
    wl = gemm(8, reference=False)
    path = write_task_data(work / "shape.npz", wl)
    np.savez(work / "bad_out.npz", output_0=np.zeros((4, 4), np.float32))
    with pytest.raises(ValueError, match="output_0"):
        add_expected_from(path, work / "bad_out.npz")


def test_compare_outputs():
    exp = np.array([[0.0, 1000.0], [2.0, 3.0]], np.float32)
    assert kernel_output_mismatch([exp.copy()], [exp]) == ""
    assert kernel_output_mismatch([exp + 0.5], [exp]) == ""  # atol scales with max |expected| = 1000
    off = exp.copy()
    off[1, 0] = 5.0
    msg = kernel_output_mismatch([off], [exp])
    assert "max abs error 3" in msg and "(1, 0)" in msg and "1 of 4" in msg
    nan = exp.copy()
    nan[0, 1] = np.nan
    assert "NaN at (0, 1)" in kernel_output_mismatch([nan], [exp])
    assert "shape" in kernel_output_mismatch([exp[:1]], [exp])


def test_summarize_error():
    long = "ScheduleError: ScheduleError: An error occurred in the primitive 'x'.\n\n# IR\n" + "line\n" * 500
    long += "Error message: Cannot find a block with the name: nope"
    short = summarize_error(long)
    assert short.startswith("ScheduleError: An error occurred") and short.endswith("name: nope")
    assert len(summarize_error("x" * 1000)) == 300


# -- IsolatedWorker -----------------------------------------------------------------------


def test_worker_raised_keeps_the_child():
    with IsolatedWorker(env={"TUNEFARM_TEST_VAR": "42"}) as w:
        pid = w.call("os:getpid", timeout=10).value
        out = w.call("operator:truediv", 1, 0, timeout=10)
        assert out.status is CallStatus.RAISED and out.message.startswith("ZeroDivisionError")
        assert w.call("os:getpid", timeout=10).value == pid
        assert w.call("os:getenv", "TUNEFARM_TEST_VAR", timeout=10).value == "42"
        assert w.call("no_such_module:f", timeout=10).status is CallStatus.RAISED
        assert w.call("threading:Lock", timeout=10).status is CallStatus.RAISED  # result does not pickle
        with pytest.raises(TypeError):  # arguments that do not pickle are the caller's bug
            w.call("builtins:id", threading.Lock(), timeout=10)
        assert w.call("os:getpid", timeout=10).value == pid


def test_worker_reports_its_cpu_time_and_waits_for_an_idle_child():
    with IsolatedWorker() as w:
        assert w.cpu_seconds() is None  # no child yet
        w.start()
        before = w.cpu_seconds()
        assert w.call("builtins:sum", range(20_000_000), timeout=60).ok  # a few hundred ms of CPU
        assert w.cpu_seconds() - before >= 0.05
        assert w.wait_idle(max_secs=5.0) < 5.0  # an idle child: no CPU between two readings
    assert w.cpu_seconds() is None


def test_worker_output_does_not_corrupt_the_protocol():
    with IsolatedWorker() as w:
        assert w.call("os:write", 1, b"garbage\x00" * 10000, timeout=10).ok
        assert w.call("builtins:print", "x" * 100000, timeout=10).ok
        assert w.call("operator:add", 2, 3, timeout=10).value == 5


def test_worker_crash_and_timeout_restart_the_child():
    with IsolatedWorker() as w:
        w.start()
        first = w.pid
        out = w.call("os:abort", timeout=10)
        assert out.status is CallStatus.CRASHED and "SIGABRT" in out.message
        assert w.pid is None and not _alive(first)
        second = w.call("os:getpid", timeout=10).value
        assert second != first

        out = w.call("time:sleep", 60, timeout=0.5)
        assert out.status is CallStatus.TIMED_OUT and out.message == "no answer within 0.5 s"
        assert not _alive(second)
        assert w.call("os:getpid", timeout=10).value not in (first, second)

        out = w.call("os:_exit", 3, timeout=10)
        assert out.status is CallStatus.CRASHED and "exited with code 3" in out.message
        assert w.call("operator:add", 1, 1, timeout=10).value == 2
        last = w.pid
    assert not _alive(last)


def test_worker_preload_failure_is_reported():
    with IsolatedWorker(preload=["no_such_module_here"]) as w:
        out = w.call("os:getpid", timeout=10)
        assert out.status is CallStatus.CRASHED and "no_such_module_here" in out.message


def test_a_worker_without_torch_runs_tvm_and_cannot_import_torch():
    """`WITHOUT_TORCH` (the builders', runners' and model workers' children): `import tvm`
    does not pull in torch (tvm_ffi imports it whenever it is installed), and an import of
    it fails as if it were not installed."""
    from tunefarm.isolation import WITHOUT_TORCH

    with IsolatedWorker(preload=["tvm"], blocked_imports=WITHOUT_TORCH) as w:
        assert w.call("tunefarm.target:host_target_dict", timeout=60).ok  # TVM works
        assert w.call("sys:modules.get", "torch", timeout=10).value is None  # not imported
        out = w.call("importlib:import_module", "torch", timeout=10)
        assert out.status is CallStatus.RAISED and out.message.startswith("ModuleNotFoundError"), out.message


def test_a_process_that_blocks_torch_runs_tvm_and_scipy_without_it():
    """`block_imports(WITHOUT_TORCH)` (the scheduler service): `import tvm` does not pull
    in torch, an import of it fails as if it were not installed, and scipy, which asks
    whether torch was imported, works on."""
    import subprocess
    import sys

    code = (
        "import sys; from tunefarm.isolation import WITHOUT_TORCH, block_imports; block_imports(WITHOUT_TORCH)\n"
        "import tvm, scipy.stats\n"
        "from tunefarm.target import host_target_dict; host_target_dict()\n"
        "assert scipy.stats.spearmanr([1, 2, 3], [3, 2, 1]).statistic == -1\n"
        "assert 'torch' not in sys.modules\n"
        "try:\n    import torch.nn\nexcept ModuleNotFoundError as e:\n    print('blocked', e.name)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "blocked torch", done.stdout  # torch.nn: its package first


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
