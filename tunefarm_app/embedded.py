"""Embedded mode, the default: one process tunes with local build and run worker
processes, a JSON-lines record store and a cost model in memory (no Redis, no Postgres).

`tune_tasks` is the one way in: workloads (one for `tune-op`, a model's tasks for
`tune`) with their weights per model, a trial budget for all of them, and a records file
that makes the run resumable. It builds the session of `tunefarm.search.session`
(task scheduler, one evolutionary search per task, one shared cost model) over a
`LocalMeasurer`. With `cost_model_path`, the shared cost model is loaded from that file
(when it fits the target) and saved back at the end (`cost_model_cache`).
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tunefarm import target as targets
from tunefarm.cuda import require_local_gpu
from tunefarm.errors import UsageError
from tunefarm.gpu import is_gpu
from tunefarm.isa import check_runs_on_host
from tunefarm.measure.builder import LocalBuilder
from tunefarm.measure.local import LocalMeasurer
from tunefarm.measure.runner import LocalRunner
from tunefarm.records import MeasureRecord
from tunefarm.search.config import TuneConfig
from tunefarm.search.cost_model import cache as cost_model_cache
from tunefarm.search.session import (
    SessionCallback,
    SessionStats,
    ShareBestPrograms,
    StoreRecords,
    TuningSession,
)
from tunefarm.search.similar_programs import SimilarPrograms
from tunefarm.search.task import SearchTask, make_task, structure_kind
from tunefarm.search.task_scheduler import TaskInfo, similarity_tag
from tunefarm.search.tuner import SearchPace, TaskState, TaskTuner
from tunefarm.store import JsonlRecordStore
from tunefarm.workloads import Workload


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def default_records_path(workload: Workload) -> Path:
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in workload.name)
    return Path("tunefarm-records") / f"{safe}.jsonl"


@dataclass(frozen=True)
class TaskSpec:
    """One workload to tune and how much it weighs in each model (1 for a single op)."""

    workload: Workload
    weights: Mapping[str, int]


@dataclass
class TaskResult:
    """How one task's tuning went."""

    task: SearchTask
    state: TaskState
    verify_available: bool  # False: no reference; kernels were checked against each other
    dead_reason: str | None  # why the task scheduler stopped giving it rounds

    @property
    def records(self) -> list[MeasureRecord]:
        return self.state.records

    @property
    def best(self) -> MeasureRecord | None:
        return self.state.best

    @property
    def errors(self) -> Counter:
        return self.state.errors


@dataclass
class TuneResult:
    """How a tuning run went: per task, and the session's accounting."""

    tasks: list[TaskResult]
    stats: SessionStats
    infos: list[TaskInfo]
    decisions: list[dict] = field(default_factory=list)  # the task scheduler's choices
    timeline: list[dict] = field(default_factory=list)  # after each round: trials, elapsed, estimate

    @property
    def trials(self) -> int:
        return sum(t.state.trials for t in self.tasks)

    @property
    def resumed(self) -> int:
        return sum(t.state.resumed for t in self.tasks)

    @property
    def single(self) -> TaskResult:
        if len(self.tasks) != 1:
            raise ValueError("not a single-task run")
        return self.tasks[0]


class _Timeline(SessionCallback):
    """Records the time series of the report: after every round, the trials, the elapsed
    time, and the task scheduler's estimated latency per model."""

    def __init__(self, out: list[dict]):
        self.out = out

    def on_round(self, session, tuner, summary) -> None:
        est = session.scheduler.estimate()
        self.out.append(
            {
                "round": summary.index,
                "task": summary.task,
                "trials": summary.trials,
                "elapsed": round(summary.elapsed, 3),
                "best_seconds": summary.best_cost if math.isfinite(summary.best_cost) else None,
                "estimated_seconds": {m: v for m, v in est.per_model.items()},
                "unknown_tasks": list(est.unknown_tasks),
            }
        )


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
    log: Callable[[str], None] = _stderr,
) -> TuneResult:
    """Tune `specs` on `target` within `config.trials` measurements in all (resumed ones
    included), in embedded mode."""
    if config.trials < 1:
        raise UsageError("--trials must be at least 1")
    if config.batch_size < 1:
        raise UsageError("--batch-size must be at least 1")
    if is_gpu(target):
        require_local_gpu(target)
    else:
        check_runs_on_host(target, f"the target ({targets.describe(target)})")  # measured here
    tasks = [make_task(s.workload, target) for s in specs]
    store = JsonlRecordStore(records)
    for task in tasks:
        store.put_workload(task.key, task.workload.name, task.workload.to_json())
    all_records = store.load()
    if store.skipped_lines:
        log(f"warning: {store.skipped_lines} unreadable lines in the records file were skipped (left in place)")
    by_task: dict[str, list[MeasureRecord]] = {}
    for r in all_records:
        by_task.setdefault(r.task, []).append(r)
    log(
        f"tuning {len(tasks)} task{'s' if len(tasks) != 1 else ''} on {targets.describe(target)}: "
        f"{config.trials} trials, seed {config.seed}, {config.strategy} task scheduler"
    )
    log("config " + json.dumps(config.as_dict(), separators=(",", ":"), default=str))
    model = cost_model_cache.load_model(cost_model_path, target, seed=config.seed, batch_size=config.batch_size, log=log)
    learnt = cost_model_cache.learnt_programs(model)
    cores = targets.num_cores(target)
    infos = [
        TaskInfo(
            key=task.key,
            flops=task.workload.flops,
            weights=dict(spec.weights),
            similarity_tag=similarity_tag(structure_kind(task.dag), task.workload.flops),
        )
        for task, spec in zip(tasks, specs)
    ]
    timeline: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="tunefarm-") as tmp:
        wd = Path(work_dir) if work_dir is not None else Path(tmp)
        builder = LocalBuilder(wd / "build", n_workers=cores)
        runner = LocalRunner(num_threads=cores)
        measurer = LocalMeasurer(builder, runner, wd, reference_timeout=config.reference_timeout, log=log)
        try:
            measure_tasks = [measurer.prepare(t.workload, t.key, target) for t in tasks]
            pace = SearchPace()
            similar = SimilarPrograms()
            similar.add(all_records)  # this run's tasks and the others of the records file
            tuners = [
                TaskTuner(t, config, model, verify=m.verify, pace=pace, similar=similar, log=log)
                for t, m in zip(tasks, measure_tasks)
            ]
            session = TuningSession(
                tuners,
                infos,
                measure_tasks,
                measurer,
                config,
                model=model,
                callbacks=[StoreRecords(store), ShareBestPrograms(similar), _Timeline(timeline), *callbacks],
                targets=latency_targets,
                learnt_programs=learnt,
                log=log,
            )
            session.resume([by_task.get(t.key, []) for t in tasks])
            resumed = session.resumed
            if resumed:
                log(f"resuming: {resumed} measurements of these tasks are in {records}")
            stats = session.run()
        finally:
            measurer.close()
            if cost_model_path is not None:  # what was learnt is kept, interrupted or not
                cost_model_cache.save_model(model, cost_model_path, target, learnt=learnt, log=log)
    states = session.scheduler.states
    results = [
        TaskResult(t, tuner.state, m.verify, st.dead_reason)
        for t, tuner, m, st in zip(tasks, tuners, measure_tasks, states)
    ]
    decisions = [
        {
            "round": d.round,
            "task": d.task,
            "reason": str(d.reason),
            "gradient": d.gradient,
        }
        for d in session.scheduler.decisions
    ]
    return TuneResult(results, stats, infos, decisions, timeline)


def tune_workload(
    workload: Workload,
    target: dict[str, Any],
    config: TuneConfig,
    *,
    records: Path,
    work_dir: Path | None = None,
    cost_model_path: Path | None = None,
    callbacks: Sequence[SessionCallback] = (),
    log: Callable[[str], None] = _stderr,
) -> TuneResult:
    """Tune one operator (`tunefarm tune-op`): a session with a single task."""
    return tune_tasks(
        [TaskSpec(workload, {workload.name: 1})],
        target,
        config,
        records=records,
        work_dir=work_dir,
        cost_model_path=cost_model_path,
        callbacks=callbacks,
        log=log,
    )
