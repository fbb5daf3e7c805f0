"""The final rounds: each task's fastest checked kernels measured again together, and the
models take the lowest median (tunefarm.search.finalists, tunefarm.measure.finalists)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tunefarm.records import Candidate, ErrorKind, MeasureRecord, TimingConfig
from tunefarm.search.config import FinalConfig
from tunefarm.search.finalists import finalists_of, pick


def rec(i: int, cost: float, *, error=ErrorKind.NONE, verified=True) -> MeasureRecord:
    return MeasureRecord(
        task="t@x", workload="w", target={"kind": "llvm"}, sketch=0, sketch_sig="s",
        decisions=Candidate.make(0, {"C.tile": [i + 1, 2]}).decisions, trace=[[], []],
        costs=(cost,) if error is ErrorKind.NONE else (), error_kind=error, error_msg="", build_secs=0.1,
        run_secs=0.1, verified=verified, timestamp=1.0 + i,
    )  # fmt: skip


def test_the_finalists_are_the_fastest_checked_programs_within_reach_of_the_best():
    records = [
        rec(0, 3.0e-3),
        rec(1, 1.0e-3),
        rec(2, 0.5e-3, verified=False),  # never checked: never a finalist
        rec(3, 0.0, error=ErrorKind.WRONG_RESULT),
        rec(4, 1.2e-3),
        rec(1, 1.1e-3),  # the same program measured again: one entry, its fastest record
        rec(5, 1.3e-3),
        rec(6, 1.1e-3),
    ]
    got = finalists_of(records, FinalConfig(kernels=3, within=1.25))
    assert [(r.key, r.cost) for r in got] == [(rec(1, 0).key, 1.0e-3), (rec(6, 0).key, 1.1e-3), (rec(4, 0).key, 1.2e-3)]
    assert [r.cost for r in finalists_of(records, FinalConfig(kernels=5, within=1.25))] == [1.0e-3, 1.1e-3, 1.2e-3]
    assert [r.cost for r in finalists_of(records, FinalConfig(kernels=5, within=1.05))] == [1.0e-3]  # a lone one
    assert finalists_of(records, FinalConfig(rounds=0)) == []
    assert finalists_of([rec(0, 1.0, verified=False)], FinalConfig()) == []


def test_the_pick_is_the_lowest_median_of_the_rounds_and_carries_them():
    a, b, c = rec(0, 1.0e-3), rec(1, 1.1e-3), rec(2, 1.2e-3)
    rounds = {a.key: [2.0e-3, 1.9e-3, 2.2e-3], b.key: [1.5e-3, 3.0e-3, 1.4e-3], c.key: []}  # c failed in its rounds
    chosen = pick("t@x", [a, b, c], rounds)
    assert chosen.by_record == a and chosen.chosen.key == b.key and chosen.changed
    assert chosen.chosen.costs == (1.5e-3, 3.0e-3, 1.4e-3) and chosen.chosen.cost == 1.5e-3
    assert replace(chosen.chosen, costs=b.costs, timestamp=b.timestamp) == b  # the same program and trace
    assert chosen.medians == {a.key: 2.0e-3, b.key: 1.5e-3}
    report = chosen.as_report()
    assert report == {"finalists": 2, "changed": True, "record_seconds": 1.0e-3, "final_seconds": 1.5e-3,
                      "by_record_final_seconds": 2.0e-3}  # fmt: skip
    assert pick("t@x", [a], {a.key: [1.0e-3]}).changed is False
    assert pick("t@x", [a, b], {}) is None


def test_a_finalists_rounds_are_shorter_than_the_runs_timing_never_longer():
    final = FinalConfig(repeat=3, min_repeat_ms=20.0)
    assert final.timing(TimingConfig()) == TimingConfig(repeat=3, min_repeat_ms=20.0)
    assert final.timing(TimingConfig(repeat=2, min_repeat_ms=5.0)) == TimingConfig(repeat=2, min_repeat_ms=5.0)


BLOCK = "C"


@pytest.mark.slow
def test_remeasure_times_every_finalist_in_each_round_and_leaves_out_a_broken_one(tmp_path):
    """Real kernels: two schedules of a small matmul and one whose trace does not build."""
    pytest.importorskip("tvm")
    from tunefarm.measure.builder import LocalBuilder
    from tunefarm.measure.finalists import Finalist, remeasure
    from tunefarm.measure.local import LocalMeasurer
    from tunefarm.measure.runner import LocalRunner
    from tunefarm.search.space.realize import trace_json
    from tunefarm.target import host_target_dict
    from tunefarm.workloads import registry

    wl = registry.make("matmul", {"M": 32, "N": 32, "K": 32})
    target = host_target_dict()
    builder = LocalBuilder(tmp_path / "build", n_workers=1)
    measurer = LocalMeasurer(builder, LocalRunner(num_threads=1), tmp_path)
    try:
        task = measurer.prepare(wl, f"{wl.key}@host", target)
        from tvm.s_tir import Schedule

        plain = Schedule(wl.mod)
        split = Schedule(wl.mod)
        (i, _j, _k) = split.get_loops(split.get_sblock(BLOCK))
        split.split(i, [None, 8])
        broken = [[["NoSuchInstruction", [], [], []]], []]
        finalists = [Finalist(task, replace(rec(n, 1e-3, verified=True), task=task.key, trace=t))
                     for n, t in enumerate([trace_json(plain), trace_json(split), broken])]  # fmt: skip
        got = remeasure(finalists, builder, measurer.runner, rounds=2, timing=TimingConfig(repeat=2, min_repeat_ms=1.0),
                        build_timeout=60.0, run_timeout=30.0)  # fmt: skip
    finally:
        measurer.close()
    keys = [(task.key, f.record.key) for f in finalists]
    assert set(got.rounds) == set(keys[:2]) and all(len(v) == 2 and min(v) > 0 for v in got.rounds.values())
    assert list(got.failed) == [keys[2]] and got.failed[keys[2]].startswith("build:")
    assert not list((tmp_path / "build").glob("*.so"))  # the finalists' builds are removed after
