"""Embedded mode, the default: one process tunes with local build and run worker
processes, a JSON-lines record store and a cost model in memory (no Redis, no Postgres).

Two ways in:
- `tune_tasks`: workloads (one for `tune-op`, a model's tasks for `tune`) with their
  weights per model, a trial budget for all of them, and a records file that makes the
  run resumable. It builds the run of `tunefarm.search.run` (task scheduler, one
  evolutionary search per task, one shared cost model) over a `LocalMeasurer`. With
  `cost_model_path`, the shared cost model is loaded from that file (when it fits the
  target) and saved back at the end (`tunefarm.search.cost_model.cache`); a target
  without one starts from its nearest cached target's or the shipped pretrained model
  (`pretrained=False`: not the latter), and the result says which (`cost_model`).
- `tune_models` (and `tune_model`, `tunefarm.tune_model`): whole models,
  `tunefarm tune model.onnx ... --out tuned/`. One run:
  1. import every model (ONNX through TVM's Relax frontend after simplification, or a
     torch module through torch.export) with fixed input shapes;
  2. fuse each into subgraphs and list its tasks; identical tasks of several models are
     one task with a weight per model;
  3. tune all tasks in one session (`tune_tasks`): the gradient task scheduler spends
     the trial budget where the weighted end-to-end latency gains most, one cost model
     learns from every task; every measurement goes to `out/records.jsonl` at once, so
     the same command resumes an interrupted run;
  4. build each model with its tasks' best schedules, check it, time it beside the peers
     and write `model.so`, `manifest.json` and `report.json` (`tunefarm.models.finish`,
     shared with the farm's scheduler service).

Directory layout: one model -> `out/{model.so, manifest.json, records.jsonl, report.json}`;
several -> `out/<model name>/{model.so, manifest.json}` with the records and the report
shared in `out/`.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tunefarm import target as targets
from tunefarm.cuda import require_local_gpu
from tunefarm.errors import UsageError, WorkloadError
from tunefarm.gpu import is_gpu
from tunefarm.isa import check_runs_on_host
from tunefarm.measure.builder import LocalBuilder
from tunefarm.measure.finalists import Finalist, remeasure
from tunefarm.measure.local import LocalMeasurer, rounds_in_flight
from tunefarm.measure.runner import LocalRunner
from tunefarm.models.alternatives import (
    ALGORITHMS,
    Choice,
    Member,
    alternatives_of,
    choices,
    rounds_with_alternatives,
)
from tunefarm.models.finish import (
    RECORDS_NAME,
    REPORT_NAME,
    ModelOutcome,
    finish_model,
    load_model,
    model_name,
    model_report,
    plain,
)
from tunefarm.models.precision import FP32, check_precision
from tunefarm.models.tasks import CONV_LAYOUT_CHOICES, merge_tasks
from tunefarm.records import TimingConfig
from tunefarm.search.config import FinalConfig, SearchConfig, TuneConfig, batch_size_for
from tunefarm.search.cost_model import cache as cost_model_cache
from tunefarm.search.cost_model.cache import CostModelStart
from tunefarm.search.finalists import FinalPick, finalists_of, pick
from tunefarm.search.run import TaskOutcome, Timeline, TuningSummary, build_session, summarize
from tunefarm.search.session import SessionCallback, SessionStats, StoreRecords, TuningSession
from tunefarm.search.task import SearchTask, make_task
from tunefarm.search.task_scheduler import TaskInfo
from tunefarm.search.tuner import TaskState
from tunefarm.store import JsonlRecordStore
from tunefarm.target import host_target_dict
from tunefarm.workloads import Workload


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def default_records_path(workload: Workload) -> Path:
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in workload.name)
    return Path("tunefarm-records") / f"{safe}.jsonl"


@dataclass(frozen=True)
class TaskSpec:
    """One workload to tune and how much it weighs in each model (1 for a single op);
    `group`: the task whose alternative it is, with the task itself (`TaskInfo.group`)."""

    workload: Workload
    weights: Mapping[str, int]
    group: str = ""


@dataclass
class TuneResult:
    """How a tuning run went: per task (in the order given) the task, its search's state
    (every record, counters, its curve) and its outcome; and the run's summary."""

    tasks: list[SearchTask]
    states: list[TaskState]
    outcomes: list[TaskOutcome]
    infos: list[TaskInfo]  # what the task scheduler knew of each task (weights per model)
    summary: TuningSummary
    stats: SessionStats
    cost_model: CostModelStart | None = None  # which model the run started from
    final: dict[str, FinalPick] = field(default_factory=dict)  # task key -> its final rounds' pick
    final_secs: float = 0.0  # the final rounds' wall time

    @property
    def trials(self) -> int:
        return self.summary.trials

    @property
    def resumed(self) -> int:
        return self.summary.resumed

    def single(self) -> tuple[SearchTask, TaskState, TaskOutcome]:
        """The one task of a single-task run (`tune-op`)."""
        if len(self.tasks) != 1:
            raise ValueError("not a single-task run")
        return self.tasks[0], self.states[0], self.outcomes[0]


def tune_tasks(
    specs: Sequence[TaskSpec],
    target: dict[str, Any],
    config: TuneConfig,
    *,
    records: Path,
    work_dir: Path | None = None,
    cost_model_path: Path | None = None,
    callbacks: Sequence[SessionCallback] = (),
    latency_targets: dict[str, float] | None = None,
    pretrained: bool = True,
    pretrained_file: Path | None = None,
    log: Callable[[str], None] = _stderr,
) -> TuneResult:
    """Tune `specs` on `target` within `config.trials` measurements in all (resumed ones
    included), in embedded mode. `pretrained`: a target without a cost model of its own
    may start from the shipped pretrained one (`cost_model_cache.start_cost_model`), or
    from `pretrained_file` (a `tunefarm pretrain` file) instead."""
    _check_can_measure(config, target)
    specs, tasks = _search_tasks(specs, target, log)
    store = JsonlRecordStore(records)
    for task in tasks:
        store.put_workload(task.key, task.workload.name, task.workload.to_json())
    all_records = store.load()
    if store.skipped_lines:
        log(f"warning: {store.skipped_lines} unreadable lines in the records file were skipped (left in place)")
    log(
        f"tuning {len(tasks)} task{'s' if len(tasks) != 1 else ''} on {targets.describe(target)}: "
        f"{config.trials} trials, seed {config.seed}, {config.strategy} task scheduler"
    )
    log("config " + json.dumps(config.as_dict(), separators=(",", ":"), default=str))
    model, start = cost_model_cache.start_cost_model(
        cost_model_path, target, seed=config.seed, batch_size=config.batch_size, log=log, pretrained=pretrained,
        pretrained_file=pretrained_file,
    )
    learnt = cost_model_cache.learnt_programs(model)
    cores = targets.num_cores(target)
    timeline = Timeline()
    with tempfile.TemporaryDirectory(prefix="tunefarm-") as tmp:
        wd = Path(work_dir) if work_dir is not None else Path(tmp)
        builder = LocalBuilder(wd / "build", n_workers=cores)
        in_flight = rounds_in_flight(target, builder.parallelism, config.batch_size)
        measurer = LocalMeasurer(builder, LocalRunner(num_threads=cores), wd, builds_ahead=in_flight - 1,
                                 reference_timeout=config.reference_timeout, log=log)  # fmt: skip
        try:
            session = build_session(
                tasks, [s.weights for s in specs], measurer, config, model,
                records=all_records,  # this run's tasks and the others of the records file
                callbacks=[StoreRecords(store), timeline, *callbacks],
                targets=latency_targets, learnt_programs=learnt, groups=[s.group for s in specs],
                max_in_flight=in_flight, log=log,
            )  # fmt: skip
            if session.resumed:
                log(f"resuming: {session.resumed} measurements of these tasks are in {records}")
            stats = session.run()
            final, final_secs = _final_rounds(session, measurer, config, [s.group for s in specs], log)
        finally:
            measurer.close()
            if cost_model_path is not None:  # what was learnt is kept, interrupted or not
                cost_model_cache.save_model(model, cost_model_path, target, learnt=learnt, log=log)
    outcomes, summary = summarize(session, timeline)
    outcomes = [replace(o, best=final[t.key].chosen) if t.key in final else o for t, o in zip(tasks, outcomes)]
    return TuneResult(tasks, [t.state for t in session.tuners], outcomes, session.infos, summary, stats, start,
                      final, final_secs)  # fmt: skip


def _final_rounds(
    session: TuningSession, measurer: LocalMeasurer, config: TuneConfig, groups: Sequence[str],
    log: Callable[[str], None],
) -> tuple[dict[str, FinalPick], float]:
    """Each task's fastest few checked kernels measured again together
    (`tunefarm.measure.finalists`), and each task's pick by the medians of those rounds
    (task key -> pick); the rounds' wall time. A task with a single finalist takes part
    only when it has alternatives (`groups`, as `build_session` takes them): its time is
    then compared with theirs, all taken in the same rounds."""
    chosen = {}
    for tuner, mt, group in zip(session.tuners, session.measure_tasks, groups, strict=True):
        recs = finalists_of(tuner.state.records, config.final)
        if len(recs) > 1 or (recs and group):
            chosen[mt.key] = (mt, recs)
    if not chosen:
        return {}, 0.0
    n = sum(len(recs) for _, recs in chosen.values())
    log(f"final rounds: the {n} fastest kernels of {len(chosen)} tasks measured again together "
        f"({config.final.rounds} alternating rounds)")  # fmt: skip
    got = remeasure(
        [Finalist(mt, r) for mt, recs in chosen.values() for r in recs], measurer.builder, measurer.runner,
        rounds=config.final.rounds, timing=config.final.timing(config.timing), build_timeout=config.build_timeout,
        run_timeout=config.run_timeout, log=log,
    )  # fmt: skip
    picks = {}
    for key, (_, recs) in chosen.items():
        found = pick(key, recs, {r.key: got.rounds.get((key, r.key), ()) for r in recs})
        if found is not None:
            picks[key] = found
    changed = sum(p.changed for p in picks.values())
    by_record = sum(p.medians.get(p.by_record.key, p.chosen.cost) for p in picks.values())
    final = sum(p.chosen.cost for p in picks.values())
    log(f"final rounds ({got.secs:.1f} s): {changed} of {len(picks)} tasks take another kernel than their best "
        f"record; their records sum to {sum(p.by_record.cost for p in picks.values()) * 1e3:.3f} ms, measured "
        f"again {by_record * 1e3:.3f} ms, chosen {final * 1e3:.3f} ms")  # fmt: skip
    return picks, got.secs


def _search_tasks(
    specs: Sequence[TaskSpec], target: dict[str, Any], log: Callable[[str], None]
) -> tuple[list[TaskSpec], list[SearchTask]]:
    """A search task per spec, with the specs kept; an alternative (a spec of a group that
    is not its first) that no sketch fits is left out, and the log says so (its task is
    tuned as it is); any other task's `WorkloadError` stops the run."""
    kept, tasks = [], []
    for s in specs:
        try:
            tasks.append(make_task(s.workload, target))
        except WorkloadError as exc:
            if not s.group or s.group == s.workload.key:
                raise
            log(f"{s.workload.name} is not tuned: {exc}")
            continue
        kept.append(s)
    return kept, tasks


def _check_can_measure(config: TuneConfig, target: dict[str, Any]) -> None:
    """Usage errors for a budget or batch below 1 and for a target this machine cannot run."""
    if config.trials < 1:
        raise UsageError("--trials must be at least 1")
    if config.batch_size < 1:
        raise UsageError("--batch-size must be at least 1")
    if is_gpu(target):
        require_local_gpu(target)
    else:
        check_runs_on_host(target, f"the target ({targets.describe(target)})")  # measured here


def tune_workload(
    workload: Workload,
    target: dict[str, Any],
    config: TuneConfig,
    *,
    records: Path,
    work_dir: Path | None = None,
    cost_model_path: Path | None = None,
    callbacks: Sequence[SessionCallback] = (),
    pretrained: bool = True,
    log: Callable[[str], None] = _stderr,
) -> TuneResult:
    """Tune one operator (`tunefarm tune-op`): a session with a single task."""
    return tune_tasks(
        [TaskSpec(workload, {workload.name: 1})], target, config, records=records, work_dir=work_dir,
        cost_model_path=cost_model_path, callbacks=callbacks, pretrained=pretrained, log=log,
    )  # fmt: skip


# -- whole models ------------------------------------------------------------------------------


@dataclass
class ModelTuneResult:
    out: Path
    models: list[ModelOutcome]
    tune: TuneResult
    report: dict
    schedules: dict[str, Any]  # schedule key -> the trace the models were built with


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
    peers: Sequence[str] | None = None,
    callbacks: Sequence[SessionCallback] = (),
    work_dir: Path | None = None,
    cost_model: Path | None = None,
    search: SearchConfig | None = None,
    conv_layout: str = "nhwc",
    algorithms: Sequence[str] = ALGORITHMS,
    pretrained: bool = True,
    precision: str = FP32,
    timing: TimingConfig | None = None,
    final_rounds: int = 0,
    log: Callable[[str], None] = _stderr,
) -> ModelTuneResult:
    """Tune one or several models together and write the tuned models to `out`.
    `cost_model`: a cost model file to start from (if it is there and fits the target)
    and to save the run's model to; None: a fresh model, not kept. `search`: the
    evolutionary search's parameters (default `SearchConfig()`). `conv_layout`: the
    layout convolutions compute in, a key of `CONV_LAYOUT_CHOICES` ("nhwc" or "model").
    `algorithms`: the other algorithms a task may be computed by, each tuned as an
    alternative beside it (`tunefarm.models.alternatives`; () for none). `pretrained`:
    without a cost model of its own, start from the shipped pretrained one. `peers`: the
    engines each tuned model is timed beside (None: those installed; (): none; its
    output is checked against its reference either way). `precision`: "fp32" (the
    default: the models as imported) or "fp16" (CUDA targets with tensor cores: float16
    operands with float32 accumulation, `tunefarm.models.precision`; the check's
    tolerance and the report say so). `timing`: how each kernel is timed (default
    `TimingConfig()`). `final_rounds`: once the budget is spent, each task's fastest
    kernels are measured again together in this many alternating rounds and the models
    take the one with the lowest median (`tunefarm.search.finalists`; 0, the default:
    none, each task's best record)."""
    _check_tune_arguments(trials, out, conv_layout)
    out = Path(out)
    target = target or host_target_dict()
    check_precision(precision, target)
    t_start = time.perf_counter()
    models = _load_models(sources, input_shapes, example_inputs, CONV_LAYOUT_CHOICES[conv_layout], log, precision)
    if precision != FP32:
        log(f"computing in {precision}: float16 operands, float32 accumulation (tensor cores where shapes allow)")
    latency_targets = _latency_targets_by_model(latency_targets, models)
    shared = merge_tasks([m.tasks for m in models])
    log(
        f"{len(shared)} tasks in {len(models)} model{'s' if len(models) > 1 else ''}: "
        + ", ".join(f"{m.name} ({len(m.tasks.tasks)} tasks)" for m in models)
    )
    specs, groups = _task_specs(shared, () if is_gpu(target) else algorithms, trials, log)
    out.mkdir(parents=True, exist_ok=True)
    config = TuneConfig(trials=trials, batch_size=batch_size_for(trials, len(specs)), seed=seed,
                        strategy=strategy, search=search or SearchConfig(), timing=timing or TimingConfig(),
                        final=FinalConfig(rounds=final_rounds))  # fmt: skip
    result = tune_tasks(
        specs, target, config, records=out / RECORDS_NAME,
        work_dir=work_dir, cost_model_path=cost_model, callbacks=callbacks,
        latency_targets=latency_targets or None, pretrained=pretrained, log=log,
    )  # fmt: skip
    chosen = _choose_members(shared, groups, result)
    schedules = {c.schedule_key: c.chosen.best.trace for c in chosen.values() if c.chosen is not None}
    outcomes = [
        finish_model(m, out if len(models) == 1 else out / m.name, target, schedules,
                     compare_default=compare_default, peers=peers, log=log)  # fmt: skip
        for m in models
    ]
    by_workload = {t.workload.key: o for t, o in zip(result.tasks, result.outcomes)}
    by_key = {k: by_workload[c.chosen.key if c.chosen else k] for k, c in chosen.items()}
    report = model_report(models, outcomes, by_key, result.summary, target, trials, time.perf_counter() - t_start,
                          choices=chosen)  # fmt: skip
    report["conv_layout"] = conv_layout
    report["cost_model"] = result.cost_model.as_report() if result.cost_model else None
    report["algorithms"] = list(algorithms)
    report["precision"] = precision
    names = {t.key: t.workload.name for t in result.tasks}
    report["final_rounds"] = {
        "rounds": final_rounds, "seconds": result.final_secs,
        "tasks": {names[key]: p.as_report() for key, p in result.final.items()},
    }  # fmt: skip
    (out / REPORT_NAME).write_text(json.dumps(plain(report), indent=1) + "\n")
    return ModelTuneResult(out, outcomes, result, report, schedules)


def _task_specs(
    shared: Sequence[Any], algorithms: Sequence[str], trials: int, log: Callable[[str], None] = _stderr
) -> tuple[list[TaskSpec], dict[str, list[str]]]:
    """The tasks to tune: every shared task, each followed by its alternatives in its group;
    and per task with alternatives the workload keys of its group (the task first). No
    alternatives when `trials` do not give every task and alternative one round: they would
    only cost their preparation (the model's own tasks warm up first)."""
    specs: list[TaskSpec] = []
    groups: dict[str, list[str]] = {}
    for t in shared:
        alts = alternatives_of(t.workload, algorithms)
        group = t.key if alts else ""
        specs.append(TaskSpec(t.workload, dict(t.weights), group))
        specs += [TaskSpec(a, dict(t.weights), group) for a in alts]
        if alts:
            groups[t.key] = [t.key, *(a.key for a in alts)]
    n_alts = len(specs) - len(shared)
    if not n_alts:
        return specs, groups
    if rounds_with_alternatives(trials, len(specs)) is None:
        log(f"{len(groups)} tasks could also be computed by Winograd, but {trials} trials do not give "
            f"their {n_alts} alternatives a round each: tuned as they are")  # fmt: skip
        return [TaskSpec(t.workload, dict(t.weights)) for t in shared], {}
    log(f"{len(groups)} tasks can also be computed by Winograd: {n_alts} alternatives tuned beside them")
    return specs, groups


def _choose_members(shared: Sequence[Any], groups: Mapping[str, Sequence[str]], result: TuneResult) -> dict[str, Choice]:
    """Per shared task (by key) which program the models take: the task's own, or one of
    its alternatives where that measured faster."""
    members = {
        t.workload.key: Member(t.workload.name, t.workload.key, o.best, o.trials)
        for t, o in zip(result.tasks, result.outcomes)
    }
    return choices({t.key: groups.get(t.key, [t.key]) for t in shared}, members)


def _check_tune_arguments(trials: int, out: str | Path, conv_layout: str) -> None:
    """`UsageError` for a trial count below 1, an `out` that is a file, an unknown layout."""
    if trials < 1:
        raise UsageError("--trials must be at least 1")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} exists and is not a directory")
    if conv_layout not in CONV_LAYOUT_CHOICES:
        raise UsageError(f"--conv-layout {conv_layout!r}: choose one of {', '.join(CONV_LAYOUT_CHOICES)}")


def _latency_targets_by_model(
    latency_targets: Mapping[str, float] | None, models: Sequence[Any]
) -> dict[str, float]:
    """The latency targets as a dict; `UsageError` if one names none of `models`."""
    targets = dict(latency_targets or {})
    unknown = sorted(set(targets) - {m.name for m in models})
    if unknown:
        raise UsageError(f"--latency-target names no model: {', '.join(unknown)}")
    return targets


def _load_models(sources, input_shapes, example_inputs, conv_layouts, log: Callable[[str], None],
                 precision: str = FP32) -> list:  # fmt: skip
    taken: set[str] = set()
    models = []
    for src in sources:
        name = model_name(src, taken)
        models.append(load_model(src, input_shapes, name=name, example_inputs=example_inputs, conv_layouts=conv_layouts,
                                 precision=precision))  # fmt: skip
        for w in models[-1].imported.warnings:
            log(f"{name}: {w}")
    return models


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

