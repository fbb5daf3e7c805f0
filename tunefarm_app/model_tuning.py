"""Whole models in embedded mode: `tunefarm tune model.onnx ... --out tuned/`.

One run:
  1. import every model (ONNX through TVM's Relax frontend after simplification, or a
     torch module through torch.export) with fixed input shapes;
  2. fuse each into subgraphs and list its tasks; identical tasks of several models are
     one task with a weight per model;
  3. tune all tasks in one session (`embedded.tune_tasks`): the gradient task scheduler
     spends the trial budget where the weighted end-to-end latency gains most, one cost
     model learns from every task; every measurement goes to `out/records.jsonl` at once,
     so the same command resumes an interrupted run;
  4. build each model with its tasks' best schedules (a task without a valid measurement
     keeps TVM's default build, and the report says so), check its output against the
     reference (onnxruntime on the ONNX file as given, the module itself for torch) on
     several input kinds (`tunefarm.models.check`) — a mismatch beyond float32 noise is
     an error: the library is kept as `model.failed-check.so` and the report names the
     task to suspect —, time it and onnxruntime on the same threads, and write `model.so`,
     `manifest.json` and `report.json`. Step 4 and the report are
     `tunefarm.models.finish`, shared with the farm's scheduler service.

Directory layout: one model -> `out/{model.so, manifest.json, records.jsonl, report.json}`;
several -> `out/<model name>/{model.so, manifest.json}` with the records and the report
shared in `out/`.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunefarm.errors import UsageError
from tunefarm.models.finish import (  # noqa: F401  (re-exported: the app layer's names for them)
    DEFAULT_BUILD_REPEAT,
    RECORDS_NAME,
    REPORT_NAME,
    REPORT_VERSION,
    LoadedModel,
    ModelOutcome,
    TaskOutcome,
    TuningSummary,
    batch_size_for,
    finish_model,
    load_model,
    model_inputs,
    model_name,
    plain,
)
from tunefarm.models.finish import model_report as _model_report
from tunefarm.models.tasks import CONV_LAYOUT_CHOICES, merge_tasks
from tunefarm.search.config import SearchConfig, TuneConfig
from tunefarm.search.session import SessionCallback
from tunefarm.target import host_target_dict
from tunefarm_app.embedded import TaskSpec, TuneResult, tune_tasks


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class ModelTuneResult:
    out: Path
    models: list[ModelOutcome]
    tune: TuneResult
    report: dict


def tune_models(
    sources: Sequence[Any],
    *,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    example_inputs: Sequence[Any] | None = None,
    trials: int,
    out: str | Path,
    target: dict[str, Any] | None = None,
    seed: int = 1,
    strategy: str = "gradient",
    latency_targets: Mapping[str, float] | None = None,
    compare_default: bool = False,
    callbacks: Sequence[SessionCallback] = (),
    work_dir: Path | None = None,
    cost_model: Path | None = None,
    search: SearchConfig | None = None,
    conv_layout: str = "nhwc",
    log: Callable[[str], None] = _stderr,
) -> ModelTuneResult:
    """Tune one or several models together and write the tuned models to `out`.
    `cost_model`: a cost model file to start from (if it is there and fits the target)
    and to save the run's model to; None: a fresh model, not kept. `search`: the
    evolutionary search's parameters (default `SearchConfig()`). `conv_layout`: the
    layout convolutions compute in, a key of `CONV_LAYOUT_CHOICES` ("nhwc" or "model")."""
    if trials < 1:
        raise UsageError("--trials must be at least 1")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} exists and is not a directory")
    if conv_layout not in CONV_LAYOUT_CHOICES:
        raise UsageError(f"--conv-layout {conv_layout!r}: choose one of {', '.join(CONV_LAYOUT_CHOICES)}")
    target = target or host_target_dict()
    t_start = time.perf_counter()
    taken: set[str] = set()
    models = []
    for src in sources:
        name = model_name(src, taken)
        models.append(load_model(src, input_shapes, name=name, example_inputs=example_inputs,
                                 conv_layouts=CONV_LAYOUT_CHOICES[conv_layout]))  # fmt: skip
        for w in models[-1].imported.warnings:
            log(f"{name}: {w}")
    targets = dict(latency_targets or {})
    unknown = sorted(set(targets) - {m.name for m in models})
    if unknown:
        raise UsageError(f"--latency-target names no model: {', '.join(unknown)}")
    shared = merge_tasks([m.tasks for m in models])
    log(
        f"{len(shared)} tasks in {len(models)} model{'s' if len(models) > 1 else ''}: "
        + ", ".join(f"{m.name} ({len(m.tasks.tasks)} tasks)" for m in models)
    )
    out.mkdir(parents=True, exist_ok=True)
    config = TuneConfig(
        trials=trials,
        batch_size=batch_size_for(trials, len(shared)),
        seed=seed,
        strategy=strategy,
        search=search or SearchConfig(),
    )
    specs = [TaskSpec(t.workload, dict(t.weights)) for t in shared]
    result = tune_tasks(
        specs,
        target,
        config,
        records=out / RECORDS_NAME,
        work_dir=work_dir,
        cost_model_path=cost_model,
        callbacks=callbacks,
        latency_targets=targets or None,
        log=log,
    )
    schedules = {t.task.workload.key: t.best.trace for t in result.tasks if t.best is not None}
    outcomes = []
    for m in models:
        directory = out if len(models) == 1 else out / m.name
        outcomes.append(finish_model(m, directory, target, schedules, compare_default=compare_default, log=log))
    report = model_report(models, outcomes, result, target, trials, strategy, time.perf_counter() - t_start)
    report["conv_layout"] = conv_layout
    (out / REPORT_NAME).write_text(json.dumps(plain(report), indent=1) + "\n")
    return ModelTuneResult(out, outcomes, result, report)


def tune_model(
    model: Any,
    *,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    example_inputs: Sequence[Any] | None = None,
    trials: int = 2000,
    out: str | Path = "tuned",
    **kwargs: Any,
) -> ModelTuneResult:
    """Tune one model: an ONNX path or ModelProto, or a torch.nn.Module with
    `example_inputs` (a tuple of tensors). See `tune_models` for the keyword arguments."""
    return tune_models(
        [model], input_shapes=input_shapes, example_inputs=example_inputs, trials=trials, out=out, **kwargs
    )


def model_report(
    models: Sequence[LoadedModel],
    outcomes: Sequence[ModelOutcome],
    result: TuneResult,
    target: dict[str, Any],
    trials: int,
    strategy: str,
    wall_secs: float,
) -> dict:
    """`report.json` of an embedded run (`tunefarm.models.finish.model_report` on its `TuneResult`)."""
    tasks = {
        t.task.workload.key: TaskOutcome(t.state.trials, t.best, t.verify_available, t.dead_reason, dict(t.errors))
        for t in result.tasks
    }
    stats = result.stats
    summary = TuningSummary(
        trials=result.trials,
        resumed=result.resumed,
        stop_reason=stats.stop_reason,
        tuning_secs=stats.wall_secs,
        search_secs=stats.search_secs,
        train_secs=stats.train_secs,
        measure_secs=stats.measure_secs,
        strategy=strategy,
        task_names=[t.task.workload.name for t in result.tasks],
        decisions=result.decisions,
        timeline=result.timeline,
    )
    return _model_report(models, outcomes, tasks, summary, target, trials, wall_secs)
