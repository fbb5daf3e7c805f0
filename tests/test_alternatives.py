"""Alternatives of a model's tasks (`tunefarm.models.alternatives`): the model takes the
fastest member with a valid measurement; a Winograd schedule, built into the model in place
of its task, passes the model's check; a model's 3x3 convolutions are tuned beside their
Winograd alternatives (and not with `--no-winograd`); and an alternative whose output is not
its task's never gets a valid measurement, so it is never chosen."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tunefarm.models.alternatives import (
    Choice,
    Member,
    algorithm_of,
    choose,
    is_alternative_key,
    rounds_with_alternatives,
    schedule_key,
)
from tunefarm.records import Candidate, ErrorKind, MeasureRecord, TimingConfig

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("torch")

TARGET = {"kind": "llvm", "num-cores": 2}


def test_rounds_are_sized_for_the_tasks_and_their_alternatives_together():
    """The rounds a run gives a model's tasks and alternatives (embedded, and a farm job
    whose API sized its rounds for the model's tasks alone): each of them gets about three
    rounds, none larger than the API's, and no alternatives when a round each is more than
    the budget."""
    from tunefarm.search.config import batch_size_for

    api_rounds = batch_size_for(500, 28)  # ResNet-18's 28 tasks: 5 per round
    assert api_rounds == 5
    assert rounds_with_alternatives(500, 28 + 16, largest=api_rounds) == 4  # 16 alternatives: rounds shrink
    assert rounds_with_alternatives(2000, 28 + 16, largest=api_rounds) == api_rounds  # never larger than the API's
    assert rounds_with_alternatives(2000, 28 + 16) == 15
    assert rounds_with_alternatives(32, 4 + 4) == 4  # 8 rounds of 4: a warm-up round each
    assert rounds_with_alternatives(20, 4 + 4) == 2  # rounds shrink to give each its warm-up round
    assert rounds_with_alternatives(7, 4 + 4) is None  # 7 trials cannot give 8 tasks a round each


def _member(name: str, cost: float | None, trials: int = 4) -> Member:
    best = None
    if cost is not None:
        best = MeasureRecord(
            task=f"{name}#0@t", workload=name, target={}, sketch=0, sketch_sig="s",
            decisions=Candidate.make(0, {}).decisions, trace=[], costs=(cost,), error_kind=ErrorKind.NONE,
            error_msg="", build_secs=0.0, run_secs=0.0, verified=True, timestamp=0.0,
        )  # fmt: skip
    return Member(name, f"{name}#0", best, trials)


def test_the_fastest_measured_member_is_chosen():
    task = "fused_conv2d_add_relu(1x8x8x4,4x3x3x4)"
    direct, w2, w4 = _member(task, 3e-5), _member(task + "+winograd2", 2e-5), _member(task + "+winograd4", None)
    choice = choose(direct.key, [direct, w2, w4])
    assert choice.chosen is w2 and choice.algorithm == "winograd2" and choice.schedule_key == w2.key
    assert [(r["algorithm"], r["chosen"]) for r in choice.as_report()] == [
        ("direct", False), ("winograd2", True), ("winograd4", False)
    ]
    # the task itself on a tie; nobody measured: no choice, and the default build
    assert choose(direct.key, [direct, _member(task + "+winograd2", 3e-5)]).chosen is direct
    nothing = choose(direct.key, [_member(task, None), w4])
    assert nothing.chosen is None and nothing.schedule_key is None and nothing.algorithm == "direct"
    assert algorithm_of(task, task + "+winograd4") == "winograd4" and algorithm_of(task, task) == "direct"
    assert is_alternative_key(task, task + "+winograd4#00ff") and not is_alternative_key(task, task + "#00ff")
    assert not is_alternative_key(task, task + "x+winograd4#00ff")
    assert isinstance(choice, Choice)


@pytest.fixture(scope="module")
def conv_bn_relu(tmp_path_factory) -> Path:
    from tunefarm.models import examples

    return examples.export_example("conv_bn_relu", tmp_path_factory.mktemp("models") / "cbr.onnx")


def test_a_model_built_with_a_winograd_schedule_passes_its_check(conv_bn_relu, tmp_path):
    from tunefarm.models.build import build_model_library
    from tunefarm.models.finish import check_built, load_model
    from tunefarm.search.space.realize import realize, trace_json
    from tunefarm.search.task import make_task
    from tunefarm.winograd_sites import winograd_alternatives

    model = load_model(conv_bn_relu, name="cbr")
    block = next(t for t in model.tasks.tasks if t.weight == 2)  # the repeated 3x3 block
    alt = next(a for a in winograd_alternatives(block.workload) if a.name.endswith("winograd4"))
    built = make_task(alt, TARGET).space.sample_many(1, random.Random(4))[0]
    schedules = {alt.key: trace_json(realize(alt.mod, built.program.instructions))}
    assert schedule_key(block, schedules) == alt.key
    assert all(schedule_key(t, schedules) is None for t in model.tasks.tasks if t is not block)
    lib = build_model_library(
        model.tasks.fused_mod, tmp_path, target=TARGET, inputs=model.imported.inputs,
        outputs=model.imported.outputs, schedules=schedules, name="cbr",
    )  # fmt: skip
    assert lib.scheduled_tasks == (alt.key,)
    result = check_built(model, tmp_path)
    assert result.ok, result.problem()


@pytest.mark.slow
def test_a_model_tunes_its_convolutions_beside_their_winograd_alternatives(conv_bn_relu, tmp_path):
    from tunefarm.models.finish import load_model
    from tunefarm.models.tasks import merge_tasks
    from tunefarm.tune import _task_specs, tune_models

    # 16 trials in rounds of 2 give each of the 4 tasks and 4 alternatives a round
    # (no peers timed: the choice is the test, not the model's speed beside onnxruntime)
    # (two short repeats per kernel: the choice is made from what was measured, however timed)
    result = tune_models([conv_bn_relu], trials=16, out=tmp_path / "tuned", target=TARGET, peers=(),
                         timing=TimingConfig(repeat=2, min_repeat_ms=5.0), log=lambda m: None)  # fmt: skip
    (model,) = result.report["models"]
    assert model["check"]["ok"] and model["check"]["reference"] == "onnxruntime"  # checked, not timed
    assert model["latency"]["median"] > 0 and model["onnxruntime_latency"] is None and model["openvino_latency"] is None
    convs = [t for t in model["tasks"] if t["alternatives"]]
    assert len(convs) == 2  # the stem and the repeated block; the transposes have none
    for t in convs:
        assert [a["algorithm"] for a in t["alternatives"]] == ["direct", "winograd2", "winograd4"]
        chosen = [a for a in t["alternatives"] if a["chosen"]]
        assert len(chosen) == 1 and chosen[0]["algorithm"] == t["algorithm"]
        measured = [a["best_seconds"] for a in t["alternatives"] if a["best_seconds"] is not None]
        assert chosen[0]["best_seconds"] == min(measured) == t["best_seconds"]
        assert t["trials"] == sum(a["trials"] for a in t["alternatives"]) and t["trials"] >= 6
    groups = {i.group for i in result.tune.infos if i.group}
    assert len(groups) == 2 and len(result.tune.tasks) == 4 + 2 * 2
    assert result.report["algorithms"] == ["winograd"]

    # --no-winograd; and a budget without a round for every alternative tunes none
    shared = merge_tasks([load_model(conv_bn_relu, name="cbr").tasks])
    assert len(_task_specs(shared, (), 16)[0]) == 4
    logged: list[str] = []
    specs, groups = _task_specs(shared, ("winograd",), 7, logged.append)  # rounds of 1: 7 < 8
    assert len(specs) == 4 and not groups and not any(s.group for s in specs)
    assert "7 trials do not give their 4 alternatives a round each" in logged[0]


def test_an_alternative_whose_output_is_not_its_tasks_is_never_chosen(tmp_path):
    """A relu posing as an alternative of a copy: checked against the copy's output, none of
    its kernels is valid, so the model takes the copy."""
    from dataclasses import replace

    from tvm import te

    from tunefarm.search.config import TuneConfig
    from tunefarm.tune import TaskSpec, tune_tasks
    from tunefarm.workloads.base import workload_from_te

    x = te.placeholder((64, 64), name="x")
    copy = workload_from_te("copy(64x64)", [x, te.compute((64, 64), lambda i, j: x[i, j], name="y")])
    relu = workload_from_te(
        "copy(64x64)+winograd2", [x, te.compute((64, 64), lambda i, j: te.max(x[i, j], 0.0), name="y")]
    )
    relu = replace(relu, reference_mod=copy.mod)
    specs = [TaskSpec(copy, {"m": 1}, group=copy.key), TaskSpec(relu, {"m": 1}, group=copy.key)]
    result = tune_tasks(specs, TARGET, TuneConfig(trials=8, batch_size=2), records=tmp_path / "r.jsonl",
                        log=lambda m: None)  # fmt: skip
    (good, bad) = result.outcomes
    assert good.best is not None and bad.best is None
    assert bad.verify_available and bad.errors == {ErrorKind.WRONG_RESULT.value: bad.trials} and bad.trials > 0
    members = [Member(t.workload.name, t.workload.key, o.best, o.trials) for t, o in zip(result.tasks, result.outcomes)]
    assert choose(copy.key, members).algorithm == "direct"


def test_an_alternative_the_search_cannot_take_is_left_out_and_its_task_tuned_as_it_is(conv_bn_relu):
    from tunefarm.errors import WorkloadError
    from tunefarm.models.finish import load_model
    from tunefarm.tune import TaskSpec, _search_tasks
    from tunefarm.winograd_sites import winograd_alternatives

    block = next(t for t in load_model(conv_bn_relu, name="cbr").tasks.tasks if t.weight == 2)
    alt = winograd_alternatives(block.workload)[0]
    # a GPU build cannot run a weight transform once outside the kernel: no search task
    cuda = {"kind": "cuda", "arch": "sm_90"}
    specs = [TaskSpec(block.workload, {"m": 2}, group=block.key), TaskSpec(alt, {"m": 2}, group=block.key)]
    logged: list[str] = []
    kept, tasks = _search_tasks(specs, cuda, logged.append)
    assert kept == specs[:1] and [t.workload.key for t in tasks] == [block.key]
    assert logged and logged[0].startswith(f"{alt.name} is not tuned: ")
    # the same failure of a task of the model's own stops the run
    with pytest.raises(WorkloadError):
        _search_tasks([TaskSpec(alt, {"m": 2})], cuda, logged.append)
