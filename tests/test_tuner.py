"""End-to-end tuning on real kernels: records, resume, apply-best, and errors as data."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import te
from tvm.script import tirx as T

from services.measurer.runner import LocalRunner
from services.scheduler.config import SearchConfig, TuneConfig
from services.scheduler.cost_model import XGBConfig, XGBCostModel
from services.scheduler.task import make_task
from services.scheduler.tuner import TaskTuner
from services.worker.builder import LocalBuilder
from tunefarm.apply import build_best, find_best
from tunefarm.records import ErrorKind, TimingConfig
from tunefarm.report import report_dict
from tunefarm.store import JsonlRecordStore
from tunefarm.workloads import workload_from_te

pytestmark = pytest.mark.slow

N = 16
FAST = TuneConfig(
    trials=12,
    batch_size=6,
    seed=3,
    timing=TimingConfig(repeat=2, min_repeat_ms=2.0),
    run_timeout=4.0,
    search=SearchConfig(population=48, generations=2),
)


def gemm(reference=True, wrong=False):
    a = te.placeholder((N, N), "float32", name="A")
    b = te.placeholder((N, N), "float32", name="B")
    k = te.reduce_axis((0, N), name="k")
    c = te.compute((N, N), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k), name="C")
    ref = (lambda x, y: [x @ y + (1.0 if wrong else 0.0)]) if reference else None
    return workload_from_te("gemm16" + ("_wrong" if wrong else ""), [a, b, c], reference=ref)


@T.prim_func(s_tir=True)
def aborting(A: T.Buffer((16, 16), "float32"), B: T.Buffer((16, 16), "float32"), C: T.Buffer((16, 16), "float32")):
    for _i in range(1):
        with T.sblock("abort"):
            T.evaluate(T.call_extern("int32", "abort"))


@T.prim_func(s_tir=True)
def sleeping(A: T.Buffer((16, 16), "float32"), B: T.Buffer((16, 16), "float32"), C: T.Buffer((16, 16), "float32")):
    for _i in range(1):
        with T.sblock("sleep"):
            T.evaluate(T.call_extern("int32", "sleep", 1000))


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    builder = LocalBuilder(tmp_path_factory.mktemp("build"), n_workers=2)
    runner = LocalRunner(num_threads=2)
    yield builder, runner
    builder.close()
    runner.close()


def _tuner(wl, target, store, workers, work_dir, config=FAST, runner=None):
    builder, default_runner = workers
    task = make_task(wl, target)
    store.put_workload(task.key, wl.name, wl.to_json())
    model = XGBCostModel(XGBConfig(num_warmup_samples=6, seed=1))
    return TaskTuner(
        task,
        config,
        model=model,
        builder=builder,
        runner=runner or default_runner,
        store=store,
        work_dir=work_dir,
        log=lambda msg: None,
    )


def test_tune_resume_and_apply_best(tmp_path, workers, host_target):
    wl = gemm()
    store = JsonlRecordStore(tmp_path / "gemm.jsonl")
    events = []
    tuner = _tuner(wl, host_target, store, workers, tmp_path)
    tuner.on_trial = events.append
    first = tuner.tune()
    assert len(first.records) == 12 and first.resumed == 0
    assert [e.trial for e in events] == list(range(1, 13))
    assert first.best is not None and first.best.verified
    assert all(r.verified for r in first.records if r.is_valid)
    report = report_dict(first)
    for key in ("workload", "target", "flops", "trials", "errors", "best_seconds", "gflops", "wall_seconds",
                "search_seconds", "build_seconds", "measure_seconds", "curve", "best_schedule", "verified"):
        assert key in report
    assert report["verified"] is True and report["trials"] == 12
    assert report["curve"][-1][1] == pytest.approx(first.best.cost)
    json.dumps(report)  # plain data

    # resume: the budget counts the records already in the file; nothing is measured twice
    second = _tuner(wl, host_target, store, workers, tmp_path, replace(FAST, trials=18)).tune()
    assert second.resumed == 12 and len(second.records) == 18
    lines = store.load()
    assert len(lines) == 18
    keys = Counter(r.candidate.key for r in lines)
    assert max(keys.values()) == 1

    # apply-best rebuilds the best kernel without search, into a library with `main`
    best = find_best(store.path)
    assert best.record.cost == min(r.cost for r in lines if r.is_valid)
    lib = tvm.runtime.load_module(str(build_best(best, tmp_path / "best.so")))
    a, b = np.random.rand(N, N).astype("float32"), np.random.rand(N, N).astype("float32")
    c = tvm.runtime.empty((N, N), "float32", tvm.cpu())
    lib["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b), c)
    np.testing.assert_allclose(c.numpy(), a @ b, rtol=1e-4, atol=1e-4)


class SabotagedRunner(LocalRunner):
    """Runs a crashing or a hanging kernel in place of some candidates."""

    def __init__(self, crash: str, hang: str):
        super().__init__(num_threads=2)
        self.crash, self.hang, self.n = crash, hang, 0

    def run(self, inputs):
        swapped = []
        for inp in inputs:
            self.n += 1
            if self.n % 5 == 2:
                inp = replace(inp, artifact=self.crash)
            elif self.n % 5 == 4:
                inp = replace(inp, artifact=self.hang, timeout_secs=2.0)
            swapped.append(inp)
        return super().run(swapped)


def _export(func, path: Path, target) -> str:
    mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
    tvm.compile(mod, target=tvm.target.Target(target)).export_library(str(path))
    return str(path)


def test_crashing_and_hanging_kernels_are_recorded_and_tuning_goes_on(tmp_path, workers, host_target):
    crash = _export(aborting, tmp_path / "crash.so", host_target)
    hang = _export(sleeping, tmp_path / "hang.so", host_target)
    runner = SabotagedRunner(crash, hang)
    try:
        store = JsonlRecordStore(tmp_path / "r.jsonl")
        result = _tuner(gemm(), host_target, store, workers, tmp_path, runner=runner).tune()
    finally:
        runner.close()
    kinds = Counter(r.error_kind for r in result.records)
    assert len(result.records) == 12
    assert kinds[ErrorKind.RUN_CRASH] >= 2 and kinds[ErrorKind.RUN_TIMEOUT] >= 2
    assert kinds[ErrorKind.NONE] >= 5
    crashed = next(r for r in result.records if r.error_kind is ErrorKind.RUN_CRASH)
    assert "SIGABRT" in crashed.error_msg and crashed.costs == ()
    assert len(store.load()) == 12  # errors are records too
    assert result.best is not None and result.errors["run_crash"] == kinds[ErrorKind.RUN_CRASH]


def test_wrong_results_are_errors(tmp_path, workers, host_target):
    store = JsonlRecordStore(tmp_path / "w.jsonl")
    cfg = replace(FAST, trials=4, batch_size=4)
    result = _tuner(gemm(wrong=True), host_target, store, workers, tmp_path, cfg).tune()
    assert {r.error_kind for r in result.records} == {ErrorKind.WRONG_RESULT}
    assert result.best is None


def test_workload_without_reference_is_checked_against_the_naive_program(tmp_path, workers, host_target):
    store = JsonlRecordStore(tmp_path / "n.jsonl")
    cfg = replace(FAST, trials=4, batch_size=4)
    result = _tuner(gemm(reference=False), host_target, store, workers, tmp_path, cfg).tune()
    assert result.verify_available
    assert result.best is not None and result.best.verified
