"""`farm up`'s supervisor: a detached process that starts the farm and then starts again
whatever of it dies.

`tunefarm farm up` forks (`up_supervised`). The child leaves the terminal's session,
writes to `D/logs/farm.log` (the farm's log) and runs `farm_local.up`, so that the farm's
processes are its children and it learns how each one ended; over a pipe it hands the
parent what `up` says (its lines, then "up" or the error). The parent prints them and
exits as `farm up` always did: 0 once the farm is up, 2 with the reason when it is not
(a process that exits during start-up is named with the tail of its log). The child
stays, as the supervisor (`supervisor` in farm.json: its pid and log):

- a process of the farm that exits, whatever its status, is logged with its exit status
  and the tail of its log, and started again after a delay (`RestartPolicy`): 1 s,
  doubling with each further death up to 60 s (both settings, below); one that had run
  for a minute starts again after the first delay;
- one that died 5 times in a row within 10 s of starting (a crash loop) is given up,
  however long the delays between its starts had grown: a line in farm.log, `given_up` in
  farm.json, and `tunefarm farm status` says so (`farm down` then `farm up` start it
  again);
- `farm down` stops the supervisor first (SIGTERM: it exits and leaves the processes to
  `down`), so that nothing is started again while the farm stops.

Its settings, read by `farm up` from its environment (`RestartPolicy.from_environment`; a
bad value fails `farm up` with exit 2 before anything starts):

| variable | default | meaning |
|---|---|---|
| TUNEFARM_RESTART_FIRST_DELAY_SECS | 1 | the delay before a process that died starts again, after a good run |
| TUNEFARM_RESTART_MAX_DELAY_SECS | 60 | the delay doubles with each death in a row up to this (at least the first delay) |

A detached supervisor rather than `farm up` in the foreground: `farm up` returns once the
farm is up, as scripts and tests expect. `farm_local.up` itself (tests, benches) starts a
farm nobody supervises: such a test stops and starts its processes itself.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import textwrap
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from tunefarm.errors import UsageError
from tunefarm_app import local_processes
from tunefarm_app.farm_local import LOGS_DIR, LocalFarm, read_state

FARM_LOG = "farm.log"
"""The supervisor's log in `D/logs`: the farm's own lines (starts, deaths, restarts)."""

POLL_SECS = 0.5
"""How often the supervisor looks at its processes."""

TAIL_LINES = 15
"""Lines of a dead process's log that go into farm.log."""

log = logging.getLogger("tunefarm.farm")


@dataclass(frozen=True)
class RestartPolicy:
    """When a process that died starts again, and when it is given up."""

    first_delay: float = 1.0  # after a death that follows a good run
    max_delay: float = 60.0  # the delay doubles with each death in a row, up to this
    good_run_secs: float = 60.0  # a process that ran this long before dying had a good run
    give_up_deaths: int = 5  # this many quick deaths in a row: given up
    quick_death_secs: float = 10.0  # a death this soon after its start is a quick one

    @classmethod
    def from_environment(cls, env: Mapping[str, str] = os.environ) -> RestartPolicy:
        """The policy with the delays the environment sets (module docstring: the
        TUNEFARM_RESTART_* variables); `UsageError` naming a bad value."""
        first = _positive_secs(env, "TUNEFARM_RESTART_FIRST_DELAY_SECS", cls.first_delay)
        most = _positive_secs(env, "TUNEFARM_RESTART_MAX_DELAY_SECS", cls.max_delay)
        if most < first:
            raise UsageError(f"TUNEFARM_RESTART_MAX_DELAY_SECS ({most:g}) must be at least "
                             f"TUNEFARM_RESTART_FIRST_DELAY_SECS ({first:g})")  # fmt: skip
        return cls(first_delay=first, max_delay=most)


def _positive_secs(env: Mapping[str, str], name: str, default: float) -> float:
    """`env[name]` as a positive, finite number of seconds (`default` when unset or empty)."""
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"{name} must be a number of seconds, not {text!r}") from None
    if not (0 < value < float("inf")):
        raise UsageError(f"{name} must be a positive number of seconds, not {text!r}")
    return value


@dataclass
class ProcessLife:
    """One process under the supervisor: when it last started, its recent deaths."""

    policy: RestartPolicy
    started_at: float  # monotonic
    restarts: int = 0
    deaths_in_a_row: int = 0  # since its last good run: how far the delay has doubled
    quick_deaths: int = 0  # in a row, each within `quick_death_secs` of its start
    start_at: float | None = None  # when it starts again (None: it runs, or was given up)
    given_up: bool = False

    def died(self, now: float) -> float | None:
        """Note a death at `now`: the delay before it starts again, None when given up."""
        p = self.policy
        ran = now - self.started_at
        if ran >= p.good_run_secs:
            self.deaths_in_a_row = 0
        self.quick_deaths = self.quick_deaths + 1 if ran < p.quick_death_secs else 0
        if self.quick_deaths >= p.give_up_deaths:
            self.given_up = True
            return None
        delay = min(p.max_delay, p.first_delay * 2**self.deaths_in_a_row)
        self.deaths_in_a_row += 1
        self.start_at = now + delay
        return delay

    def started(self, now: float) -> None:
        self.started_at = now
        self.start_at = None
        self.restarts += 1


class Supervisor:
    """Starts again the processes of `farm` that die (module docstring)."""

    def __init__(self, farm: LocalFarm, policy: RestartPolicy = RestartPolicy()):
        self.farm = farm
        self.policy = policy
        self.lives = {name: ProcessLife(policy, process.since) for name, process in farm.processes.items()}

    def run(self, stopping: Callable[[], bool]) -> None:
        """Look after the processes until `stopping()`."""
        log.info("supervising %s", ", ".join(self.lives))
        while not stopping():
            self.check()
            time.sleep(POLL_SECS)
        log.info("stopping: the farm's processes are no longer started again")

    def check(self) -> None:
        """Note the processes that died; start again those whose delay is over."""
        now = time.monotonic()
        for name, life in self.lives.items():
            if life.given_up:
                continue
            if life.start_at is None and not self.farm.alive(name):
                self._died(name, life, now)
            elif life.start_at is not None and now >= life.start_at:
                self._start_again(name, life, now)

    def _died(self, name: str, life: ProcessLife, now: float, how: str | None = None) -> None:
        """Log a death (`how`: default, its exit status) and when it starts again, or that
        it is given up; farm.json notes it."""
        how = how or exit_text(self.farm.exit_status(name))
        ran = now - life.started_at
        delay = life.died(now)
        path = Path(self.farm.processes[name].log)
        tail = textwrap.indent(local_processes.log_tail(path, TAIL_LINES), "    | ")
        notes = {"restarts": life.restarts, "last_exit": how}
        if delay is None:
            reason = (f"died {life.quick_deaths} times in a row within {self.policy.quick_death_secs:.0f} s of starting "
                      f"(last: {how})")  # fmt: skip
            log.error("%s %s after %.0f s; it %s: GIVEN UP, not started again (farm down, then farm up, starts it); "
                      "the end of %s:\n%s", name, how, ran, reason, path, tail)  # fmt: skip
            notes |= {"running": False, "given_up": reason}
        else:
            log.warning("%s %s after %.0f s; starting it again in %g s; the end of %s:\n%s",
                        name, how, ran, delay, path, tail)  # fmt: skip
        self.farm.supervision[name] = notes
        self.farm.write_state()

    def _start_again(self, name: str, life: ProcessLife, now: float) -> None:
        try:
            process = self.farm.start(name)  # farm.json gets its new pid
        except OSError as exc:
            life.started_at = now
            self._died(name, life, now, how=f"could not be started again ({exc})")
            return
        life.started(now)
        self.farm.supervision[name] = {**self.farm.supervision.get(name, {}), "restarts": life.restarts}
        self.farm.write_state()
        log.info("%s started again: pid %d (restart %d)", name, process.pid, life.restarts)


def exit_text(status: int | None) -> str:
    """How a process ended, from its Popen return code (-N: killed by signal N)."""
    if status is None:
        return "exited"
    if status < 0:
        try:
            return f"was killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"was killed by signal {-status}"
    return f"exited with status {status}"


# -- farm up's fork -------------------------------------------------------------------------


def up_supervised(
    state_dir: Path,
    start: Callable[[Callable[[str], None]], LocalFarm],
    log_line: Callable[[str], None] = print,
    policy: RestartPolicy = RestartPolicy(),
) -> dict[str, Any]:
    """Start a farm under a detached supervisor (module docstring) that starts again what
    dies by `policy`: `start(log)` runs in the supervisor and returns the farm up
    (`farm_local.up`), or raises `UsageError`. Returns farm.json once the farm is up;
    raises `UsageError` with `start`'s reason otherwise."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(reader)
        _be_the_supervisor(Path(state_dir), start, writer, policy)  # never returns
    os.close(writer)
    return _await_the_farm(Path(state_dir), pid, reader, log_line)


def _await_the_farm(state_dir: Path, pid: int, reader: int, log_line: Callable[[str], None]) -> dict[str, Any]:
    """What the supervisor says until the farm is up (farm.json) or is not (`UsageError`)."""
    with os.fdopen(reader) as report:
        try:
            for line in report:
                said = json.loads(line)
                if "log" in said:
                    log_line(said["log"])
                elif "error" in said:
                    os.waitpid(pid, 0)
                    raise UsageError(said["error"])
                elif said.get("up"):
                    return read_state(state_dir)
        except KeyboardInterrupt:  # the farm is not up: the supervisor stops what it started
            os.kill(pid, signal.SIGTERM)
            os.waitpid(pid, 0)
            raise
    os.waitpid(pid, 0)
    farm_log = state_dir / LOGS_DIR / FARM_LOG
    raise UsageError(f"farm up's supervisor exited during start-up; the end of {farm_log}:\n"
                     f"{local_processes.log_tail(farm_log)}")  # fmt: skip


class _StopRequests:
    """SIGTERM and SIGINT in the supervisor: while the farm starts, they end the start
    (`up` stops what it started); once it is up, the supervision."""

    def __init__(self) -> None:
        self.requested = False
        self.farm_up = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.requested = True
        if not self.farm_up:
            raise SystemExit(f"farm up was stopped ({signal.Signals(signum).name}) while the farm started")


def _be_the_supervisor(
    state_dir: Path, start: Callable[[Callable[[str], None]], LocalFarm], writer: int, policy: RestartPolicy
) -> None:
    """The forked child: start the farm, tell farm up, supervise; never returns."""
    status = 1
    report = os.fdopen(writer, "w", buffering=1)
    try:
        os.setsid()  # out of the terminal's session: farm up's Ctrl-C and hangup are not ours
        farm_log = _write_to_farm_log(state_dir)
        stop = _StopRequests()
        farm = _start(start, report)
        if farm is None:
            status = 2
            return
        me = os.getpid()
        farm.supervisor = {"pid": me, "started": local_processes.started_at(me), "log": str(farm_log),
                           "running": True}  # fmt: skip
        farm.write_state()
        stop.farm_up = True
        _tell(report, up=True)
        report.close()
        Supervisor(farm, policy).run(lambda: stop.requested)
        farm.supervisor["running"] = False
        farm.write_state()
        status = 0
    except BaseException as exc:
        traceback.print_exc()
        _tell(report, error=f"farm up's supervisor failed: {type(exc).__name__}: {exc}")
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def _start(start: Callable[[Callable[[str], None]], LocalFarm], report: IO[str]) -> LocalFarm | None:
    """The farm `start` brings up, its lines told to farm up; None (the reason told) if it
    does not come up."""

    def say(line: str) -> None:
        log.info("%s", line)
        _tell(report, log=line)

    try:
        return start(say)
    except UsageError as exc:
        log.error("farm up failed: %s", exc)
        _tell(report, error=str(exc))
    except SystemExit as exc:
        log.error("%s", exc)
        _tell(report, error=str(exc))
    except Exception as exc:  # noqa: BLE001 (told to farm up in one line; the traceback is in farm.log)
        log.exception("farm up failed")
        _tell(report, error=f"farm up failed: {type(exc).__name__}: {exc} (see logs/{FARM_LOG})")
    return None


def _tell(report: IO[str], **said: Any) -> None:
    """One line to farm up (nothing once the pipe is closed: the farm is up, or farm up is
    gone; the farm's log has it all)."""
    if report.closed:
        return
    try:
        report.write(json.dumps(said) + "\n")
    except BrokenPipeError:
        pass


def _write_to_farm_log(state_dir: Path) -> Path:
    """stdin from /dev/null, stdout and stderr to D/logs/farm.log (0600), log lines there."""
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # as `LocalFarm.prepare` makes them
    logs = state_dir / LOGS_DIR
    logs.mkdir(mode=0o700, exist_ok=True)
    path = logs / FARM_LOG
    out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(null)
    os.close(out)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stdout, force=True)  # fmt: skip
    log.setLevel(logging.INFO)
    return path
