"""`tunefarm farm status --state-dir D`: the processes of a farm `farm up` started, as its
farm.json and the processes themselves say: running, being started again by the
supervisor (`tunefarm_app.farm_supervisor`), given up, exited, or stopped by `farm down`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunefarm_app import local_processes
from tunefarm_app.farm_local import SUPERVISOR, read_state

RUNNING = "running"
STARTING_AGAIN = "starting again"  # it exited; the supervisor starts it after its delay
GIVEN_UP = "given up"  # it kept dying; the supervisor no longer starts it
EXITED = "exited"  # it exited and no supervisor runs to start it again
STOPPED = "stopped"  # by farm down


@dataclass(frozen=True)
class ProcessStatus:
    name: str
    state: str
    pid: int
    log: str
    restarts: int = 0
    last_exit: str | None = None
    given_up: str | None = None  # why


@dataclass(frozen=True)
class FarmStatus:
    supervisor: dict[str, Any] | None  # farm.json's entry (None: farm up ran without one)
    supervisor_running: bool
    processes: list[ProcessStatus]


def farm_status(state_dir: Path) -> FarmStatus:
    """The farm's processes now (`UsageError` when `state_dir` has no farm)."""
    data = read_state(state_dir)
    supervisor = data.get(SUPERVISOR)
    supervised = bool(supervisor and supervisor.get("running") and local_processes.is_ours(supervisor))
    processes = [_process_status(name, entry, supervised) for name, entry in data.get("processes", {}).items()]
    return FarmStatus(supervisor, supervised, processes)


def _process_status(name: str, entry: dict[str, Any], supervised: bool) -> ProcessStatus:
    if entry.get("given_up"):
        state = GIVEN_UP
    elif not entry.get("running"):
        state = STOPPED
    elif local_processes.is_ours(entry):
        state = RUNNING
    else:
        state = STARTING_AGAIN if supervised else EXITED
    return ProcessStatus(name, state, int(entry["pid"]), str(entry.get("log", "")), int(entry.get("restarts", 0)),
                         entry.get("last_exit"), entry.get("given_up"))  # fmt: skip


def status_lines(status: FarmStatus) -> list[str]:
    """`farm status`'s lines."""
    s = status.supervisor
    if s is None:
        lines = ["supervisor none: processes that exit are not started again"]
    elif status.supervisor_running:
        lines = [f"supervisor running, pid {s['pid']}: starts again what exits (its log: {s.get('log')})"]
    elif not s.get("running"):
        lines = [f"supervisor stopped (its log: {s.get('log')})"]
    else:
        lines = [f"supervisor NOT RUNNING: processes that exit are not started again (its log: {s.get('log')})"]
    for p in status.processes:
        restarts = f"; started again {p.restarts} time{'s' if p.restarts != 1 else ''}" if p.restarts else ""
        last = f" (last: {p.last_exit})" if p.last_exit and p.state == RUNNING else ""
        if p.state == GIVEN_UP:
            what = f"GIVEN UP: it {p.given_up}; farm down, then farm up, starts it again"
        elif p.state == RUNNING:
            what = f"running, pid {p.pid}"
        elif p.state == STARTING_AGAIN:
            what = f"down, {p.last_exit or 'exited'}: the supervisor starts it again shortly"
        elif p.state == EXITED:
            what = "EXITED, and nothing starts it again"
        else:
            what = "stopped"
        lines.append(f"process    {p.name}: {what}{restarts}{last}; log {p.log}")
    return lines
