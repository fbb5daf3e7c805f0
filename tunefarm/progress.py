"""The live progress line: trials, best throughput, errors, ETA.

On a terminal one line is rewritten in place after every measured candidate; in a log
(not a TTY) a line is printed when the best improves and every `log_every` trials.
"""

from __future__ import annotations

import math
import sys
from typing import TextIO

from services.scheduler.tuner import TrialEvent
from tunefarm.workloads import Workload


def format_duration(secs: float | None) -> str:
    if secs is None or not math.isfinite(secs):
        return "--"
    secs = int(round(secs))
    if secs < 60:
        return f"{secs}s"
    if secs < 3600:
        return f"{secs // 60}m{secs % 60:02d}s"
    return f"{secs // 3600}h{(secs % 3600) // 60:02d}m"


def format_cost(secs: float) -> str:
    if not math.isfinite(secs):
        return "--"
    if secs < 1e-3:
        return f"{secs * 1e6:.1f} us"
    if secs < 1:
        return f"{secs * 1e3:.3f} ms"
    return f"{secs:.3f} s"


class ProgressLine:
    def __init__(self, workload: Workload, stream: TextIO | None = None, log_every: int = 64):
        self.workload = workload
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.log_every = log_every
        self._best = math.inf
        self._width = 0

    def __call__(self, ev: TrialEvent) -> None:
        tput = self.workload.throughput(ev.best_cost)
        text = (
            f"[{ev.task}] trial {ev.trial}/{ev.total} | best {tput:.1f} {self.workload.throughput_unit}"
            f" ({format_cost(ev.best_cost)}) | errors {ev.errors} | ETA {format_duration(ev.eta)}"
        )
        improved = ev.best_cost < self._best
        self._best = min(self._best, ev.best_cost)
        if self.tty:
            pad = max(0, self._width - len(text))
            self.stream.write("\r" + text + " " * pad)
            self.stream.flush()
            self._width = len(text)
        elif improved or ev.trial % self.log_every == 0 or ev.trial == ev.total:
            self.stream.write(text + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.tty and self._width:
            self.stream.write("\n")
            self.stream.flush()
            self._width = 0
