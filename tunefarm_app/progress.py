"""Live progress of a tuning session, drawn with rich.

On a terminal, a live view is redrawn as measurements arrive: trials used of the budget,
ETA, the estimated end-to-end latency now and at the start, and per task its best
latency, trials and share of the estimated latency (one line only when there is one
task). Not on a terminal (a log, CI), plain lines are printed instead: when a task's best
improves and every `log_every` trials.
"""

from __future__ import annotations

import math
import sys
from typing import TextIO

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from services.scheduler.session import RoundSummary, SessionCallback, TuningSession
from services.scheduler.tuner import TaskTuner
from tunefarm.records import MeasureRecord


def format_duration(secs: float | None) -> str:
    if secs is None or not math.isfinite(secs):
        return "--"
    secs = int(round(secs))
    if secs < 60:
        return f"{secs}s"
    if secs < 3600:
        return f"{secs // 60}m{secs % 60:02d}s"
    return f"{secs // 3600}h{(secs % 3600) // 60:02d}m"


def format_cost(secs: float | None) -> str:
    if secs is None or not math.isfinite(secs):
        return "--"
    if secs < 1e-3:
        return f"{secs * 1e6:.1f} us"
    if secs < 1:
        return f"{secs * 1e3:.3f} ms"
    return f"{secs:.3f} s"


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
        est = session.scheduler.estimate()
        head = Text(
            f"trials {session.trials}/{session.config.trials}  elapsed {format_duration(session.elapsed)}"
            f"  ETA {format_duration(session.eta())}"
        )
        if len(session.tuners) == 1:
            tuner = session.tuners[0]
            wl = tuner.task.workload
            best = tuner.state.best_cost
            errors = sum(tuner.state.errors.values())
            head.append(
                f"  {wl.name}: best {wl.throughput(best):.1f} {wl.throughput_unit} ({format_cost(best)})"
                f"  errors {errors}"
            )
            return head
        for model, secs in est.per_model.items():
            start = self._start_estimate.get(model)
            was = f" (at start {format_cost(start)})" if start is not None and math.isfinite(start) else ""
            head.append(f"\n{model}: estimated latency {format_cost(secs)}{was}")
        if est.unknown_tasks:
            head.append(f"  ({len(est.unknown_tasks)} tasks not measured yet)")
        table = Table(box=None, pad_edge=False, show_edge=False)
        for col, justify in (("task", "left"), ("weight", "right"), ("trials", "right"), ("best", "right"),
                             ("share", "right"), ("state", "left")):
            table.add_column(col, justify=justify)
        states = session.scheduler.states
        weighted = [
            (sum(info.weights.values()) * st.best if math.isfinite(st.best) else 0.0)
            for info, st in zip(session.infos, states)
        ]
        total = sum(weighted) or 1.0
        for tuner, info, st, w in zip(session.tuners, session.infos, states, weighted):
            state = "dead: " + st.dead_reason if st.dead_reason else ("measuring" if st.in_flight else "")
            table.add_row(
                tuner.task.workload.name[:60],
                str(sum(info.weights.values())),
                str(tuner.state.trials),
                format_cost(tuner.state.best_cost),
                f"{w / total:.0%}" if w else "--",
                state,
            )
        return Group(head, table)
