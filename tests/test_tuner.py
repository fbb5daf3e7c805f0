"""End-to-end tuning on real kernels: records, resume, apply-best, and errors as data."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import te
from tvm.script import tirx as T

from tunefarm.measure.builder import LocalBuilder
from tunefarm.measure.local import LocalMeasurer
from tunefarm.measure.runner import LocalRunner
from tunefarm.records import ErrorKind, TimingConfig
from tunefarm.search.config import SearchConfig, TuneConfig
from tunefarm.search.cost_model import XGBConfig, XGBCostModel
from tunefarm.search.session import StoreRecords, TuningSession
from tunefarm.search.task import make_task
from tunefarm.search.task_scheduler import TaskInfo
from tunefarm.search.tuner import TaskTuner
from tunefarm.store import JsonlRecordStore
from tunefarm.workloads import workload_from_te
from tunefarm_app.apply import build_best, find_best

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


def _session(wl, target, store, workers, work_dir, config=FAST, runner=None, reference_timeout=60.0):
    """A one-task session over the module's workers (what `tune-op` runs)."""
    builder, default_runner = workers
    task = make_task(wl, target)
    store.put_workload(task.key, wl.name, wl.to_json())
    model = XGBCostModel(XGBConfig(num_warmup_samples=6, seed=1))
    measurer = LocalMeasurer(
        builder, runner or default_runner, work_dir, reference_timeout=reference_timeout, close_workers=False
    )
    mtask = measurer.prepare(wl, task.key, target)
    tuner = TaskTuner(task, config, model, verify=mtask.verify)
    info = TaskInfo(key=task.key, flops=wl.flops, weights={wl.name: 1})
    session = TuningSession([tuner], [info], [mtask], measurer, config, model=model, callbacks=[StoreRecords(store)])
    session.resume([store.load(task.key)])
    return session, measurer


def _tune(*args, **kwargs):
    """Run a one-task session; returns its tuner's state and the session."""
    session, measurer = _session(*args, **kwargs)
    try:
        session.run()
    finally:
        measurer.close()
    return session.tuners[0].state, session


def test_tune_resume_and_apply_best(tmp_path, workers, host_target):
    wl = gemm()
    store = JsonlRecordStore(tmp_path / "gemm.jsonl")
    first, session = _tune(wl, host_target, store, workers, tmp_path)
    assert len(first.records) == 12 and first.resumed == 0
    assert [r.trials for r in session.stats.rounds] == [6, 12]
    assert first.best is not None and first.best.verified
    assert all(r.verified for r in first.records if r.is_valid)
    assert first.curve[-1][1] == pytest.approx(first.best.cost)

    # resume: the budget counts the records already in the file; nothing is measured twice
    second, _ = _tune(wl, host_target, store, workers, tmp_path, replace(FAST, trials=18))
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


def test_a_run_timed_flushed_before_every_call_is_not_resumed_by_a_warm_one(tmp_path, host_target):
    from tunefarm.tune import tune_workload

    records, lines = tmp_path / "gemm.jsonl", []
    flushed = replace(FAST, trials=6, timing=replace(FAST.timing, flush_every_call=True, max_flushed_calls=2))
    first = tune_workload(gemm(), host_target, flushed, records=records, work_dir=tmp_path / "w1", pretrained=False,
                          log=lines.append)  # fmt: skip
    assert first.resumed == 0
    assert all(r.flushed_calls for r in JsonlRecordStore(records).load())

    again = tune_workload(gemm(), host_target, replace(flushed, trials=8), records=records, work_dir=tmp_path / "w2",
                          pretrained=False, log=lines.append)  # fmt: skip
    assert again.resumed == 6  # timed the same way: resumed

    warm = replace(FAST, trials=6)
    second = tune_workload(gemm(), host_target, warm, records=records, work_dir=tmp_path / "w3", pretrained=False,
                           log=lines.append)  # fmt: skip
    assert second.resumed == 0
    assert any("left out 8 earlier measurements timed with the caches flushed before every call" in m for m in lines)
    stored = JsonlRecordStore(records).load()
    assert len(stored) == 14 and sum(not r.flushed_calls for r in stored) == 6


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
        result, _ = _tune(gemm(), host_target, store, workers, tmp_path, runner=runner)
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
    result, _ = _tune(gemm(wrong=True), host_target, store, workers, tmp_path, cfg)
    assert {r.error_kind for r in result.records} == {ErrorKind.WRONG_RESULT}
    assert result.best is None


def test_workload_without_reference_is_checked_against_the_naive_program(tmp_path, workers, host_target):
    store = JsonlRecordStore(tmp_path / "n.jsonl")
    cfg = replace(FAST, trials=4, batch_size=4)
    result, session = _tune(gemm(reference=False), host_target, store, workers, tmp_path, cfg)
    assert session.measure_tasks[0].verify and not result.cross_checked
    assert result.best is not None and result.best.verified


def test_without_a_reference_in_time_kernels_are_checked_against_each_other(tmp_path, workers, host_target):
    """The unscheduled program gets a bounded time (here too little to build): tuning
    starts at once and the kernels' output digests are compared with each other."""
    store = JsonlRecordStore(tmp_path / "x.jsonl")
    cfg = replace(FAST, trials=8, batch_size=4)
    result, session = _tune(gemm(reference=False), host_target, store, workers, tmp_path, cfg, reference_timeout=0.001)
    assert not session.measure_tasks[0].verify and result.cross_checked
    valid = [r for r in result.records if r.is_valid]
    assert len(valid) >= 3 and all(r.digest for r in valid)
    # a consensus formed and later kernels match it; the first kernel, measured with
    # nothing to agree with, is confirmed then too when it agrees (TaskTuner._confirm_earlier)
    assert any(r.verified for r in valid[1:])
    assert result.best is None or result.best.verified


def test_step_api_takes_results_in_any_order_once(tmp_path, host_target):
    """propose / ingest: out of order is fine, a result delivered twice is one record,
    and a lost program may be proposed again."""
    from tunefarm.records import BuildResult, MeasureRecord, MeasureResult, RunResult

    wl = gemm()
    task = make_task(wl, host_target)
    tuner = TaskTuner(task, FAST, XGBCostModel(XGBConfig(num_warmup_samples=6, seed=1)))
    proposal = tuner.propose(4)
    assert len(proposal.inputs) == 4 and all(m.trace for m in proposal.inputs)

    def result(m, cost):  # the record a measurer hands back
        res = MeasureResult(m, BuildResult(m.key, "x.so", 0.1), RunResult(m.key, (cost,), 0.2, verified=True))
        return MeasureRecord.of(res, workload=wl.name, target=host_target, timestamp=0.0)

    first, second, third, lost = proposal.inputs
    records = tuner.ingest([result(third, 3e-3), result(first, 1e-3)])
    assert [r.candidate.key for r in records] == [third.key, first.key]
    assert tuner.ingest([result(first, 9e-3)]) == []  # delivered twice: ignored
    tuner.ingest([result(second, 2e-3)])
    assert tuner.state.trials == 3 and tuner.state.best.candidate.key == first.key
    assert lost.key in tuner.in_flight
    tuner.forget([lost.key])
    assert lost.key not in tuner.in_flight and lost.key not in tuner.measured
    again = tuner.propose(8)
    assert not {m.key for m in again.inputs} & {first.key, second.key, third.key}


def test_without_a_reference_only_kernels_others_agree_with_can_be_the_best(host_target):
    """A fast kernel measured before a consensus, whose output no other kernel confirms,
    is never the task's best (it would go into the model unchecked); a kernel measured
    before the consensus that agrees with it is confirmed once the consensus forms."""
    from tunefarm.records import BuildResult, MeasureRecord, MeasureResult, RunResult

    tuner = TaskTuner(make_task(gemm(), host_target), FAST, XGBCostModel(XGBConfig(seed=1)), verify=False)
    wrong_fast, early, late, *_ = tuner.propose(4).inputs
    right, other = (1.0, 2.0, 0.5), (1.0, 2.0, 0.75)  # digests: sums and samples

    def result(m, cost, digest):  # the record a measurer hands back
        res = MeasureResult(m, BuildResult(m.key, "x.so", 0.1), RunResult(m.key, (cost,), 0.2, digest=digest))
        return MeasureRecord.of(res, workload="gemm", target=host_target, timestamp=0.0)

    tuner.ingest([result(wrong_fast, 1e-3, other), result(early, 2e-3, right)])
    assert tuner.state.best is None  # nothing agrees yet: nothing is checked
    tuner.ingest([result(late, 3e-3, right)])
    by_key = {r.candidate.key: r for r in tuner.state.records}
    assert by_key[early.key].verified and by_key[late.key].verified and not by_key[wrong_fast.key].verified
    assert tuner.state.best.candidate.key == early.key  # not the faster, unconfirmed one


class ShufflingMeasurer:
    """A stand-in measurer: holds several batches and returns their results a few at a
    time in a shuffled order across batches, with made-up costs (no compiling)."""

    def __init__(self, seed: int = 0):
        import random

        self.rng = random.Random(seed)
        self.waiting: list = []
        self.submitted: list = []

    def prepare(self, workload, task_key, target):  # pragma: no cover - not used
        raise NotImplementedError

    def submit(self, batch) -> None:
        from tunefarm.records import BuildResult, MeasureRecord, MeasureResult, RunResult

        self.submitted.append(batch)
        for m in batch.inputs:
            cost = 1e-3 * (1 + self.rng.random())
            run = RunResult(m.key, (cost,), 0.0, verified=True)
            result = MeasureResult(m, BuildResult(m.key, "x.so", 0.0), run)
            self.waiting.append(MeasureRecord.of(result, workload="w", target={}, timestamp=0.0))

    def collect(self, timeout=None):
        self.rng.shuffle(self.waiting)
        out, self.waiting = self.waiting[:3], self.waiting[3:]
        return out

    @property
    def pending(self) -> int:
        return len(self.waiting)

    def close(self) -> None:
        pass


def test_session_keeps_several_rounds_in_flight_and_matches_results_out_of_order(host_target):
    from tunefarm.measure import MeasureTask

    wls = [gemm(), workload_from_te("gemm16b", [*_gemm_tensors(16, "X")])]
    tasks = [make_task(wl, host_target) for wl in wls]
    model = XGBCostModel(XGBConfig(num_warmup_samples=6, seed=1))
    cfg = replace(FAST, trials=20, batch_size=4)
    tuners = [TaskTuner(t, cfg, model) for t in tasks]
    infos = [TaskInfo(key=t.key, flops=t.workload.flops, weights={"m": 1}) for t in tasks]
    mtasks = [MeasureTask(t.key, "w.json", t.workload.name, host_target, "d.npz", 2, 1, True) for t in tasks]
    measurer = ShufflingMeasurer()
    session = TuningSession(tuners, infos, mtasks, measurer, cfg, model=model, max_in_flight=3)
    session.start()
    peak = 0
    while session.step(wait=0):
        peak = max(peak, len(session._rounds))
    session.close()
    assert peak == 3  # three rounds were out at once
    assert session.trials == 20 and session.in_flight == 0
    for tuner in tuners:
        keys = [r.candidate.key for r in tuner.state.records]
        assert len(keys) == len(set(keys)) and all(r.task == tuner.key for r in tuner.state.records)
    assert sum(len(b.inputs) for b in measurer.submitted) == 20
    assert len(session.stats.rounds) == len(measurer.submitted)


def _gemm_tensors(n: int, prefix: str):
    a = te.placeholder((n, n), "float32", name=f"{prefix}A")
    b = te.placeholder((n, n), "float32", name=f"{prefix}B")
    k = te.reduce_axis((0, n), name="k")
    c = te.compute((n, n), lambda i, j: te.sum(a[i, k] * b[j, k], axis=k), name="C")
    return a, b, c


def test_a_model_that_learns_elsewhere_costs_no_features(host_target, monkeypatch):
    """The farm's job sees its class's model through a view that learns from Postgres,
    not from the session: the session computes no features for it (they were computed
    for nothing before, then again by the class's model)."""
    from tunefarm.measure import MeasureTask
    from tunefarm.search.cost_model import RandomCostModel

    class LearnsElsewhere(RandomCostModel):
        learns_from_updates = False

        def update(self, features, costs, groups):
            raise AssertionError("a model that learns elsewhere is never given features")

    computed = []
    original = TaskTuner.features
    monkeypatch.setattr(TaskTuner, "features", lambda self, records: computed.append(len(records)) or original(self, records))
    task = make_task(gemm(), host_target)
    model = LearnsElsewhere(seed=1)
    cfg = replace(FAST, trials=8, batch_size=4)
    info = TaskInfo(key=task.key, flops=task.workload.flops, weights={"m": 1})
    mtask = MeasureTask(task.key, "w.json", task.workload.name, host_target, "d.npz", 2, 1, True)
    session = TuningSession([TaskTuner(task, cfg, model)], [info], [mtask], ShufflingMeasurer(), cfg, model=model)
    session.start()
    while session.step(wait=0):
        pass
    session.close()
    assert session.trials == 8 and computed == []


def test_the_population_leaves_room_for_realizing_and_retraining_in_the_search_share():
    """The search's share of a round covers realizing the picks and retraining the cost
    model too: their time per round comes off the evolution's allowance."""
    from tunefarm.search.tuner import EvolutionSize, SearchPace, evolution_size

    cfg = SearchConfig(population=512, min_population=48, generations=4, target_search_share=0.15)
    assert evolution_size(cfg, SearchPace(), 32) == EvolutionSize(512, 4)  # no pace yet: as configured
    pace = SearchPace(measure_secs_per_trial=1.0, secs_per_scored=0.001)
    # 32 trials of 1 s: 0.15/0.85 * 32 = 5.6 s for the search, 5 ms per program over 5 generations
    assert evolution_size(cfg, pace, 32) == EvolutionSize(512, 4)
    pace.note_search(scored=1000, secs=1.0, fixed_secs=2.0)  # realizing the picks: 2 s a round
    pace.note_training(2.5)  # and a retraining of 2.5 s
    assert pace.fixed_secs_per_round == pytest.approx(4.5)
    assert evolution_size(cfg, pace, 32).population == int((0.15 / 0.85 * 32 - 4.5) / (0.001 * 5)) == 229
    pace.note_training(20.0)  # retraining alone beyond the share: the smallest population, one generation
    assert evolution_size(cfg, pace, 32) == EvolutionSize(48, 1)


def test_below_the_smallest_population_the_evolution_runs_fewer_generations():
    """A round of 4 small kernels: the smallest population over every generation would
    exceed the share, so the generations shrink to what the allowance pays for."""
    from tunefarm.search.tuner import EvolutionSize, SearchPace, evolution_size

    cfg = SearchConfig(population=512, min_population=48, generations=4, target_search_share=0.15)
    pace = SearchPace(measure_secs_per_trial=0.5, secs_per_scored=0.001)
    allowed = 0.15 / 0.85 * 0.5 * 4  # 0.353 s: 7 scorings of 48 programs
    assert int(allowed / (0.001 * 48)) == 7
    assert evolution_size(cfg, pace, 4) == EvolutionSize(70, 4)  # 0.353 s / 5 ms: still above the floor
    pace.note_search(scored=48, secs=0.048, fixed_secs=0.2)
    size = evolution_size(cfg, pace, 4)  # 0.153 s left: 3 scorings of 48 programs
    assert size == EvolutionSize(48, 2)
    slow = SearchPace(measure_secs_per_trial=0.5, secs_per_scored=0.004)
    assert evolution_size(cfg, slow, 4) == EvolutionSize(48, 1)  # never fewer than one generation
    fast = SearchPace(measure_secs_per_trial=0.5, secs_per_scored=0.0001)
    assert evolution_size(cfg, fast, 4).generations == 4


def test_retraining_is_due_once_the_untrained_programs_took_long_enough_to_measure():
    from tunefarm.search.session import retrain_due

    assert retrain_due(4, None, None, 0.04)  # nothing known yet: retrain
    assert retrain_due(4, 1.0, None, 0.04) and retrain_due(4, None, 2.0, 0.04)
    assert not retrain_due(0, 1.0, 0.0, 0.04)  # nothing new to learn
    # 4 programs of 1 s each: 0.16 s of retraining allowed at a 4% share
    assert retrain_due(4, 1.0, 0.15, 0.04) and not retrain_due(4, 1.0, 0.2, 0.04)
    assert retrain_due(5, 1.0, 0.2, 0.04)  # one more program measured: due


class _CountingModel(XGBCostModel):
    def __init__(self, config):
        super().__init__(config)
        self.calls: list[bool] = []

    def update(self, features, costs, groups, *, train=True):
        self.calls.append(train)
        super().update(features, costs, groups, train=train)


def _paced_session(host_target, share: float):
    from tunefarm.measure import MeasureTask

    task = make_task(gemm(), host_target)
    model = _CountingModel(XGBConfig(num_warmup_samples=4, seed=1, adaptive_training=False))
    cfg = replace(FAST, trials=24, batch_size=4)
    cfg = replace(cfg, search=replace(cfg.search, retrain_share=share))
    info = TaskInfo(key=task.key, flops=task.workload.flops, weights={"m": 1})
    mtask = MeasureTask(task.key, "w.json", task.workload.name, host_target, "d.npz", 2, 1, True)
    tuner = TaskTuner(task, cfg, model)
    session = TuningSession([tuner], [info], [mtask], ShufflingMeasurer(), cfg, model=model)
    session.start()
    while session.step(wait=0):
        pass
    session.close()
    return session, model, tuner


def test_the_session_retrains_the_model_only_as_often_as_the_measuring_time_allows(host_target):
    """A stand-in measurer takes no time, so retraining costs more than measuring: after its
    first retraining the model gets the batches without retraining (all in its history),
    unless the share allows any retraining time."""
    session, model, tuner = _paced_session(host_target, share=0.04)
    assert session.trials == 24 and model.num_samples == 24
    assert len(model.calls) == len(session.stats.rounds) == 6
    assert model.calls[0] and not any(model.calls[1:])
    assert model.trained_on == 4
    model.update([], [], [], train=True)  # what was held back is learnt on the next training
    assert model.trained_on == 24

    session, model, tuner = _paced_session(host_target, share=1e9)
    assert all(model.calls) and model.trained_on == 24
