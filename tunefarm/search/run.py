"""One tuning run over a set of tasks, as embedded mode and the farm's jobs both make it:
its session built (`build_session`), its time series recorded (`Timeline`), and what it
came to as plain data (`summarize`: a `TaskOutcome` per task, a `TuningSummary`).

    build_session(tasks, weights, measurer, config, model, records=...)
        each task prepared on the measurer, a tuner per task (one search pace, one
        `SimilarPrograms` seeded with `records` and `seeds`), the task scheduler's
        `TaskInfo`s, the session, resumed from `records`

The driver decides what else a run does through callbacks (storing records, the farm's
progress rows) and who measures (`tunefarm.measure.Measurer`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tunefarm.gpu import is_gpu
from tunefarm.measure import Measurer
from tunefarm.records import MeasureRecord, TimingConfig
from tunefarm.search.config import TuneConfig
from tunefarm.search.cost_model import CostModel
from tunefarm.search.session import SessionCallback, ShareBestPrograms, TuningSession
from tunefarm.search.similar_programs import SimilarPrograms
from tunefarm.search.task import SearchTask, structure_kind
from tunefarm.search.task_scheduler import TaskInfo, similarity_tag
from tunefarm.search.tuner import SearchPace, TaskTuner


@dataclass(frozen=True)
class TaskOutcome:
    """How one task's tuning went, as the report sees it."""

    trials: int
    best: MeasureRecord | None
    verify_available: bool  # False: no reference; kernels were checked against each other
    dead_reason: str | None  # why the task scheduler stopped giving it rounds
    errors: Mapping[str, int] = field(default_factory=dict)  # error kind -> count


@dataclass(frozen=True)
class TuningSummary:
    """The search's accounting for the report (a `SessionStats` and its scheduler, as data)."""

    trials: int
    resumed: int
    stop_reason: str
    tuning_secs: float  # the session's wall time
    search_secs: float
    train_secs: float
    measure_secs: float
    strategy: str
    task_names: Sequence[str]  # in task-scheduler index order
    decisions: Sequence[Mapping[str, Any]] = ()  # {"round", "task", "reason", "gradient"}
    timeline: Sequence[Mapping[str, Any]] = ()


def task_info(task: SearchTask, weights: Mapping[str, int], group: str = "") -> TaskInfo:
    """What the task scheduler knows of a task: its FLOPs, its weight in each model, the
    group of similar tasks it belongs to, and the group of alternatives (`TaskInfo.group`)."""
    return TaskInfo(
        key=task.key,
        flops=task.workload.flops,
        weights=dict(weights),
        similarity_tag=similarity_tag(structure_kind(task.dag), task.workload.flops),
        group=group,
    )


class Timeline(SessionCallback):
    """The time series of the report: after every round, the trials, the elapsed time and
    the task scheduler's estimated latency per model."""

    def __init__(self) -> None:
        self.points: list[dict] = []

    def on_round(self, session: TuningSession, tuner: TaskTuner, summary: Any) -> None:
        est = session.scheduler.estimate()
        self.points.append(
            {
                "round": summary.index,
                "task": summary.task,
                "trials": summary.trials,
                "elapsed": round(summary.elapsed, 3),
                "best_seconds": summary.best_cost if math.isfinite(summary.best_cost) else None,
                "estimated_seconds": dict(est.per_model),
                "unknown_tasks": list(est.unknown_tasks),
            }
        )


def timed_like(records: Sequence[MeasureRecord], timing: TimingConfig) -> tuple[list[MeasureRecord], int]:
    """The records whose costs were timed as `timing` times (see `MeasureRecord.flushed_calls`),
    and how many were not."""
    same = [r for r in records if r.flushed_calls == timing.flushes_every_call(on_gpu=is_gpu(r.target))]
    return same, len(records) - len(same)


def build_session(
    tasks: Sequence[SearchTask],
    weights: Sequence[Mapping[str, int]],
    measurer: Measurer,
    config: TuneConfig,
    model: CostModel,
    *,
    records: Sequence[MeasureRecord] = (),
    seeds: Iterable[MeasureRecord] = (),
    callbacks: Sequence[SessionCallback] = (),
    targets: Mapping[str, float] | None = None,
    learnt_programs: list[str] | None = None,
    groups: Sequence[str] | None = None,
    max_in_flight: int = 1,
    log: Callable[[str], None],
) -> TuningSession:
    """A session over `tasks` (each weighing `weights[i]` per model; `groups[i]`, when
    given, names the alternatives of one computation it belongs to) measured by
    `measurer`, resumed from `records` (this run's earlier measurements; any other task's
    seed the similar ones), its searches also seeded with `seeds` (another class's best
    programs of these workloads); `max_in_flight` rounds out at once (`TuningSession`).
    Records timed otherwise than `config.timing` (with or without the caches flushed
    before every call) are left out: their costs do not compare with this run's."""
    records, other_timing = timed_like(records, config.timing)
    if other_timing:  # only CPU records are ever timed flushed
        how = "with the caches warm" if config.timing.flush_every_call else "with the caches flushed before every call"
        log(f"left out {other_timing} earlier measurements timed {how}: their costs do not compare with this run's")
    measure_tasks = measurer.prepare_all([(t.workload, t.key, t.target) for t in tasks])
    pace = SearchPace()
    similar = SimilarPrograms()  # each task's best, for its similar tasks to start from
    similar.add(records)
    similar.add(seeds)
    tuners = [
        TaskTuner(t, config, model, verify=m.verify, pace=pace, similar=similar, log=log)
        for t, m in zip(tasks, measure_tasks)
    ]
    session = TuningSession(
        tuners,
        [task_info(t, w, g) for t, w, g in zip(tasks, weights, groups or [""] * len(tasks))],
        measure_tasks,
        measurer,
        config,
        model=model,
        callbacks=[ShareBestPrograms(similar), *callbacks],
        targets=dict(targets) if targets else None,
        learnt_programs=learnt_programs,
        max_in_flight=max_in_flight,
        log=log,
    )
    by_task: dict[str, list[MeasureRecord]] = {}
    for r in records:
        by_task.setdefault(r.task, []).append(r)
    session.resume([by_task.get(t.key, []) for t in tasks])
    return session


def summarize(session: TuningSession, timeline: Timeline) -> tuple[list[TaskOutcome], TuningSummary]:
    """What the run came to: per task (in the session's order) its outcome, and the
    run's accounting, decisions and time series."""
    states = session.scheduler.states
    outcomes = [
        TaskOutcome(tuner.state.trials, tuner.state.best, tuner.verify, st.dead_reason, dict(tuner.state.errors))
        for tuner, st in zip(session.tuners, states)
    ]
    stats = session.stats
    summary = TuningSummary(
        trials=session.trials,
        resumed=session.resumed,
        stop_reason=stats.stop_reason,
        tuning_secs=stats.wall_secs or session.elapsed,  # a farm session is stepped, never `run`
        search_secs=stats.search_secs,
        train_secs=stats.train_secs,
        measure_secs=stats.measure_secs,
        strategy=session.config.strategy,
        task_names=[tuner.task.workload.name for tuner in session.tuners],
        decisions=[
            {"round": d.round, "task": d.task, "reason": str(d.reason), "gradient": d.gradient}
            for d in session.scheduler.decisions
        ],
        timeline=list(timeline.points),
    )
    return outcomes, summary
