"""Live progress of a tuning session, drawn with rich.

On a terminal, a live view is redrawn as measurements arrive: trials used of the budget,
ETA, the estimated end-to-end latency now and at the start, and per task its best
latency, trials and share of the estimated latency (one line only when there is one
task). Not on a terminal (a log, CI), plain lines are printed instead: when a task's best
improves and every `log_every` trials.

The view is drawn from a `ProgressSnapshot` (plain data), made either from an embedded
session (`ProgressView`, `tunefarm tune`) or from a farm job's JSON (`JobProgressView`,
`tunefarm submit --follow` and `status --follow`): both show the same table.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TextIO

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from tunefarm.display import format_cost, format_duration
from tunefarm.records import MeasureRecord
from tunefarm.search.session import RoundSummary, SessionCallback, TuningSession
from tunefarm.search.tuner import TaskTuner

__all__ = ["JobProgressView", "ProgressSnapshot", "ProgressView", "TaskRow", "format_cost", "format_duration",
           "render_progress", "snapshot_of_job"]


@dataclass(frozen=True)
class TaskRow:
    name: str
    weight: int
    trials: int
    best_secs: float | None
    state: str  # "", "measuring" or "dead: <why>"


@dataclass(frozen=True)
class ProgressSnapshot:
    """What the live table shows, whoever runs the search."""

    trials: int
    budget: int
    elapsed_secs: float | None
    eta_secs: float | None
    estimates: Mapping[str, tuple[float | None, float | None]]  # model -> (now, at the start)
    unknown_tasks: int  # tasks without a valid measurement yet (the estimate leaves them out)
    tasks: tuple[TaskRow, ...]
    status: str = ""  # a farm job's state


def render_progress(snap: ProgressSnapshot):
    """The live table of `snap` (a rich renderable)."""
    head = Text(
        (f"{snap.status}  " if snap.status else "")
        + f"trials {snap.trials}/{snap.budget}  elapsed {format_duration(snap.elapsed_secs)}"
        f"  ETA {format_duration(snap.eta_secs)}"
    )
    for model, (now, start) in snap.estimates.items():
        was = f" (at start {format_cost(start)})" if start is not None and math.isfinite(start) else ""
        head.append(f"\n{model}: estimated latency {format_cost(now)}{was}")
    if snap.unknown_tasks:
        head.append(f"  ({snap.unknown_tasks} tasks not measured yet)")
    table = Table(box=None, pad_edge=False, show_edge=False)
    for col, justify in (("task", "left"), ("weight", "right"), ("trials", "right"), ("best", "right"),
                         ("share", "right"), ("state", "left")):
        table.add_column(col, justify=justify)
    weighted = [t.weight * t.best_secs if t.best_secs is not None and math.isfinite(t.best_secs) else 0.0
                for t in snap.tasks]
    total = sum(weighted) or 1.0
    for t, w in zip(snap.tasks, weighted):
        table.add_row(t.name[:60], str(t.weight), str(t.trials), format_cost(t.best_secs),
                      f"{w / total:.0%}" if w else "--", t.state)
    return Group(head, table)


def snapshot_of_job(job: Mapping[str, Any], *, now: datetime | None = None) -> ProgressSnapshot:
    """The live table's data from a farm job (`GET /v1/jobs/{id}`'s JSON)."""
    elapsed = None
    if job.get("started_at"):
        started = datetime.fromisoformat(job["started_at"])
        ended = datetime.fromisoformat(job["finished_at"]) if job.get("finished_at") else None
        elapsed = ((ended or now or datetime.now(UTC)) - started).total_seconds()
    trials, budget = job["trials_used"], job["trial_budget"]
    eta = elapsed * (budget - trials) / trials if elapsed is not None and trials and job["state"] == "running" else None
    tasks = tuple(
        TaskRow(t["name"], t["weight"], t["trials"], t["best_secs"], f"dead: {t['dead_reason']}" if t["dead_reason"] else "")
        for t in job["tasks"]
    )
    return ProgressSnapshot(
        trials=trials,
        budget=budget,
        elapsed_secs=elapsed,
        eta_secs=eta,
        estimates={job["model_name"]: (job["est_latency_secs"], job["est_latency_start_secs"])},
        unknown_tasks=sum(1 for t in job["tasks"] if t["best_secs"] is None),
        tasks=tasks,
        status=job["state"],
    )


class JobProgressView:
    """Follows a farm job: the live table on a terminal, a line per change otherwise.
    `note` prints a message (a lost connection, a retry) above the table."""

    def __init__(self, stream: TextIO | None = None, *, force_terminal: bool | None = None):
        self.console = Console(file=stream or sys.stderr, force_terminal=force_terminal, highlight=False)
        self.live_mode = self.console.is_terminal
        self._live: Live | None = None
        self._waiting: str | None = None

    def update(self, job: Mapping[str, Any]) -> None:
        self._note_waiting(job)
        snap = snapshot_of_job(job)
        if not self.live_mode:
            est = format_cost(job["est_latency_secs"]) if job["est_latency_secs"] else "-"
            self.console.print(f"{job['state']:<10} trials {job['trials_used']}/{job['trial_budget']}  est latency {est}",
                               markup=False, soft_wrap=True)
            return
        if self._live is None:
            self._live = Live(render_progress(snap), console=self.console, refresh_per_second=4, transient=False)
            self._live.start()
        else:
            self._live.update(render_progress(snap))

    def note(self, message: str) -> None:
        self.console.print(message, markup=False, soft_wrap=True)

    def _note_waiting(self, job: Mapping[str, Any]) -> None:
        """Say when the job starts and stops waiting for an agent of its class (`waiting`):
        without it, a job no agent serves shows the same trials for ever."""
        waiting = job.get("waiting")
        if waiting and waiting != self._waiting:
            self.note(waiting)
        elif self._waiting and not waiting and job.get("state") not in ("succeeded", "failed", "cancelled"):
            self.note(f"agents     class {job['device_class']} has an agent online again")
        self._waiting = waiting

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None


class ProgressView(SessionCallback):
    def __init__(self, stream: TextIO | None = None, *, log_every: int = 64, force_terminal: bool | None = None):
        self.stream = stream or sys.stderr
        self.console = Console(file=self.stream, force_terminal=force_terminal, highlight=False)
        self.live_mode = self.console.is_terminal
        self.log_every = log_every
        self._live: Live | None = None
        self._session: TuningSession | None = None
        self._best: dict[str, float] = {}
        self._last_logged = 0
        self._start_estimate: dict[str, float] = {}

    # -- callbacks --------------------------------------------------------------------------

    def on_start(self, session: TuningSession) -> None:
        self._session = session
        self._note_start_estimate(session)
        if self.live_mode:
            self._live = Live(self._render(), console=self.console, refresh_per_second=4, transient=False)
            self._live.start()

    def on_records(self, session: TuningSession, tuner: TaskTuner, records: list[MeasureRecord]) -> None:
        if self._live is not None:
            self._live.update(self._render())
            return
        best = tuner.state.best_cost
        improved = best < self._best.get(tuner.key, math.inf)
        self._best[tuner.key] = min(best, self._best.get(tuner.key, math.inf))
        trials = session.trials
        if improved or trials - self._last_logged >= self.log_every or trials >= session.config.trials:
            self._last_logged = trials
            self.console.print(self._line(session, tuner), soft_wrap=True, markup=False)

    def on_round(self, session: TuningSession, tuner: TaskTuner, summary: RoundSummary) -> None:
        self._note_start_estimate(session)
        if self._live is not None:
            self._live.update(self._render())

    def on_end(self, session: TuningSession) -> None:
        if self._live is not None:
            self._live.update(self._render())
            self._live.stop()
            self._live = None

    def _note_start_estimate(self, session: TuningSession) -> None:
        """The estimate "at the start": the first one with every task measured (before
        that the sum leaves tasks out and means nothing)."""
        if self._start_estimate:
            return
        est = session.scheduler.estimate()
        if not est.unknown_tasks:
            self._start_estimate = dict(est.per_model)

    # -- drawing ----------------------------------------------------------------------------

    def _line(self, session: TuningSession, tuner: TaskTuner) -> str:
        wl = tuner.task.workload
        best = tuner.state.best_cost
        errors = sum(tuner.state.errors.values())
        head = f"trial {session.trials}/{session.config.trials}"
        if len(session.tuners) == 1:
            tput = wl.throughput(best)
            return (
                f"[{wl.name}] {head} | best {tput:.1f} {wl.throughput_unit} ({format_cost(best)})"
                f" | errors {errors} | ETA {format_duration(session.eta())}"
            )
        est = session.scheduler.estimate()
        return (
            f"{head} | {wl.name}: {tuner.state.trials} trials, best {format_cost(best)}"
            f" | estimated latency {format_cost(est.total)} | ETA {format_duration(session.eta())}"
        )

    def _render(self):
        session = self._session
        assert session is not None
        if len(session.tuners) != 1:
            return render_progress(self._snapshot(session))
        tuner = session.tuners[0]
        wl = tuner.task.workload
        best = tuner.state.best_cost
        errors = sum(tuner.state.errors.values())
        return Text(
            f"trials {session.trials}/{session.config.trials}  elapsed {format_duration(session.elapsed)}"
            f"  ETA {format_duration(session.eta())}"
            f"  {wl.name}: best {wl.throughput(best):.1f} {wl.throughput_unit} ({format_cost(best)})"
            f"  errors {errors}"
        )

    def _snapshot(self, session: TuningSession) -> ProgressSnapshot:
        est = session.scheduler.estimate()
        rows = []
        for tuner, info, st in zip(session.tuners, session.infos, session.scheduler.states):
            best = tuner.state.best_cost
            rows.append(TaskRow(
                tuner.task.workload.name,
                sum(info.weights.values()),
                tuner.state.trials,
                best if math.isfinite(best) else None,
                "dead: " + st.dead_reason if st.dead_reason else ("measuring" if st.in_flight else ""),
            ))
        return ProgressSnapshot(
            trials=session.trials,
            budget=session.config.trials,
            elapsed_secs=session.elapsed,
            eta_secs=session.eta(),
            estimates={m: (secs, self._start_estimate.get(m)) for m, secs in est.per_model.items()},
            unknown_tasks=len(est.unknown_tasks),
            tasks=tuple(rows),
        )
