"""Run untrusted work in a long-lived child process that may crash or hang.

`IsolatedWorker` keeps one child Python process and executes calls in it, one at a
time: `call("package.module:function", *args, timeout=...)`. The child persists across
calls so that the ~2 s `import tvm` is paid once per worker, not once per kernel.

Whatever the called function does, `call` returns a `CallOutcome` and never raises:

- ``ok``: the function returned; `value` holds the (pickled, copied) return value.
- ``raised``: the function raised; `message` is "ExceptionType: text". The child stays alive.
- ``crashed``: the child died (segfault, abort, `os._exit`...). `message` names the
  signal or exit code and the last line the child printed.
- ``timed_out``: no answer within `timeout` seconds; the child is killed.

After a crash or a timeout the whole process group of the child is SIGKILLed (this also
takes down grandchildren such as the linker), and a fresh child starts at the next call.

Protocol: the parent and the child talk over a private socket pair, with pickled
messages framed by `multiprocessing.connection.Connection`. The child's stdout and
stderr go to a log file (`IsolatedWorker.log_path`), so TVM's warnings can neither
corrupt the protocol nor flood the tuner's console; on a crash the last line of that
log ends up in the message.

Child life cycle::

    spawn -> import preload modules -> send ("ready", pid) -> loop { recv call -> send reply }
    EOF on the socket (parent closed or died) -> exit

The start-up (spawn + preload) is not counted against a call's timeout; it has its own
limit, `start_timeout`. A child given `blocked_imports` cannot import those modules (an
import fails as if they were not installed): `WITHOUT_TORCH` for a child that runs TVM's
code only, since TVM's FFI imports torch whenever it is installed (seconds of every
start, more than TVM itself) and nothing such a child runs uses it.

A worker given a `Sandbox` (a device agent's kernel runner: it loads code that came over
the network) starts its child with fewer rights, as far as the OS allows
(`tunefarm.sandbox`), and says which it got (`IsolatedWorker.sandbox_status`, from the
child's "ready" message). Its child does not inherit the parent's secrets
(`sandbox.scrubbed_env`).
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import asdict, dataclass
from enum import StrEnum
from multiprocessing.connection import Connection
from typing import Any

from tunefarm.errors import TunefarmError
from tunefarm.sandbox import (
    Sandbox,
    SandboxStatus,
    enter_as_root,
    enter_unprivileged,
    hide_host_sockets,
    scrubbed_env,
    seal,
)

DEFAULT_START_TIMEOUT = 120.0
"""Seconds a child may take to start and import its preload modules (tvm takes ~2 s idle,
much longer on a loaded machine)."""

WITHOUT_TORCH = ("torch",)
"""`blocked_imports` of a child that runs TVM's code only (builds, kernels, built models):
tvm_ffi imports torch at `import tvm` when it is installed, which no such child uses."""

LOG_ROTATE_BYTES = 1 << 20
"""The child's log file is emptied before a call once it is larger than this."""


class _BlockedImports:
    """A `sys.meta_path` finder for which `names` (and their submodules) are not installed:
    their import raises ModuleNotFoundError. Nothing is put in `sys.modules`, so a library
    that asks whether one was imported ("torch" in sys.modules: scipy's array helpers)
    is told it was not."""

    def __init__(self, names: tuple[str, ...]):
        self.names = frozenset(names)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        if fullname.partition(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {fullname!r} (not imported by this process)", name=fullname)
        return None


def block_imports(names: tuple[str, ...]) -> None:
    """From now on this process imports none of `names` (one imported already stays):
    `WITHOUT_TORCH` for a process that runs TVM's code but never torch's (the scheduler,
    and every child given `blocked_imports`)."""
    sys.meta_path.insert(0, _BlockedImports(tuple(names)))

_CHILD_BOOTSTRAP = (
    "import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
    "from tunefarm.isolation import _child_main; "
    "_child_main(int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]), json.loads(sys.argv[5]), "
    "json.loads(sys.argv[6]))"
)


class CallStatus(StrEnum):
    """How a call in the child ended."""

    OK = "ok"
    RAISED = "raised"  # the function raised; the child is still alive
    CRASHED = "crashed"  # the child died (or could not start)
    TIMED_OUT = "timed_out"  # no answer in time; the child was killed


@dataclass(frozen=True)
class CallOutcome:
    status: CallStatus
    value: Any = None  # the function's return value when `status` is OK
    message: str = ""  # what went wrong; "" when OK
    secs: float = 0.0  # wall time from sending the call to the answer (start-up not included)

    @property
    def ok(self) -> bool:
        return self.status is CallStatus.OK


class WorkerStartError(TunefarmError):
    """The child process could not be started or failed while importing its preload modules."""


class IsolatedWorker:
    """One child process executing calls by import path, one at a time.

    `env` entries are added to the child's environment (e.g. ``TVM_NUM_THREADS``);
    `preload` modules are imported when the child starts, before any timed call;
    `blocked_imports` cannot be imported in the child (e.g. `WITHOUT_TORCH`). Calls
    are serialised by a lock, so one worker may be shared by threads, but it does one
    thing at a time. With `memory_limit_bytes`, the child's address space is capped
    (`limit_address_space`): an allocation past it fails in the child (a `MemoryError`,
    or a crash) and never takes the host's memory. With `scrub_secrets` (always with a
    `sandbox`), the child does not inherit this process's secrets (`sandbox.SECRET_ENV`:
    tokens, passwords, every TUNEFARM_ setting such as the database URL).
    """

    def __init__(
        self,
        *,
        env: dict[str, str] | None = None,
        preload: list[str] | tuple[str, ...] = (),
        start_timeout: float = DEFAULT_START_TIMEOUT,
        name: str = "worker",
        memory_limit_bytes: int | None = None,
        sandbox: Sandbox | None = None,
        cwd: str | os.PathLike[str] | None = None,
        scrub_secrets: bool = False,
        blocked_imports: list[str] | tuple[str, ...] = (),
    ):
        self.env = dict(env or {})
        self.blocked_imports = list(blocked_imports)
        self.scrub_secrets = scrub_secrets or sandbox is not None
        self.memory_limit_bytes = memory_limit_bytes
        self.preload = list(preload)
        self.start_timeout = start_timeout
        self.name = name
        self.sandbox = sandbox
        self.cwd = os.fspath(cwd) if cwd is not None else None  # the child's working directory
        self.sandbox_status: SandboxStatus | None = None  # what the last child got (with a sandbox)
        self._lock = threading.RLock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._lifeline: int | None = None  # write end of a pipe the child watches for EOF
        self._ready = False
        self._closed = False
        fd, self.log_path = tempfile.mkstemp(prefix=f"tunefarm-{name}-", suffix=".log")
        os.close(fd)
        _WORKERS.add(self)

    # -- life cycle ---------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """Process id of the current child, None when no child runs."""
        return self._proc.pid if self._proc is not None else None

    def cpu_seconds(self) -> float | None:
        """CPU time the child has used so far, all its threads (Linux /proc); None when
        no child runs or it cannot be read."""
        pid = self.pid
        if pid is None:
            return None
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    def wait_idle(self, *, poll_secs: float = 0.03, max_secs: float = 2.0) -> float:
        """Wait until the child uses no CPU over `poll_secs` (a thread pool spins for a
        while after its last task: TVM's for about 0.1-0.2 s here), at most `max_secs`;
        the seconds waited. Where the CPU time cannot be read, waits `poll_secs`."""
        t0 = time.monotonic()
        last = self.cpu_seconds()
        while True:
            time.sleep(poll_secs)
            now = self.cpu_seconds()
            if now is None or now == last or time.monotonic() - t0 >= max_secs:
                return time.monotonic() - t0
            last = now

    def start(self) -> None:
        """Start the child now (if none runs) and wait until its preload is imported.

        Optional: `call` starts the child lazily. Raises `WorkerStartError`.
        """
        with self._lock:
            if self._closed:
                raise WorkerStartError(f"{self.name}: the worker is closed")
            if self._proc is not None and self._proc.poll() is not None:
                self._discard()  # died while idle (OOM killer, ...): start afresh
            if self._proc is None:
                self._spawn()
            if not self._ready:
                self._wait_ready()

    def _spawn(self) -> None:
        parent_sock, child_sock = socket.socketpair()
        lifeline_r, lifeline_w = os.pipe()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self.scrub_secrets:
            env = scrubbed_env(env)
        env.update(self.env)  # what the caller sets for the child is the child's
        # The child starts in `cwd`: a "" entry (this process's directory) is named as such.
        path = [p or os.getcwd() for p in sys.path]
        argv = [
            sys.executable,
            "-c",
            _CHILD_BOOTSTRAP,
            json.dumps(path),
            str(child_sock.fileno()),
            str(lifeline_r),
            json.dumps(self.preload),
            json.dumps(asdict(self.sandbox) if self.sandbox is not None else None),
            json.dumps(self.blocked_imports),
            f"tunefarm-{self.name}",  # not read by the child: names it in ps and top
        ]
        with open(self.log_path, "ab") as log:
            try:
                self._proc = subprocess.Popen(
                    argv,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    pass_fds=(child_sock.fileno(), lifeline_r),
                    start_new_session=True,  # own process group: killpg reaches grandchildren
                    close_fds=True,
                    cwd=self.cwd,
                )
            except OSError as exc:
                parent_sock.close()
                os.close(lifeline_w)
                raise WorkerStartError(f"{self.name}: cannot spawn {sys.executable}: {exc}") from None
            finally:
                child_sock.close()
                os.close(lifeline_r)
        self._lifeline = lifeline_w
        self._conn = Connection(parent_sock.detach())
        self._ready = False
        if self.memory_limit_bytes is not None:
            try:
                limit_address_space(self._proc.pid, self.memory_limit_bytes)
            except OSError as exc:
                self._kill()
                raise WorkerStartError(f"{self.name}: cannot limit the child's memory: {exc}") from None

    def _wait_ready(self) -> None:
        assert self._conn is not None
        deadline = time.monotonic() + self.start_timeout
        try:
            if not self._conn.poll(max(0.0, deadline - time.monotonic())):
                self._kill()
                raise WorkerStartError(
                    f"{self.name}: the child did not start within {self.start_timeout:g} s"
                )
            kind, detail = self._conn.recv()
        except (EOFError, OSError):
            message = self._death_message()
            self._kill()
            raise WorkerStartError(f"{self.name}: the child died while starting: {message}") from None
        if kind != "ready":
            self._kill()
            raise WorkerStartError(f"{self.name}: the child failed to start: {detail}")
        got = detail.get("sandbox") if isinstance(detail, dict) else None
        self.sandbox_status = SandboxStatus(**{**got, "problems": tuple(got["problems"])}) if got else None
        self._ready = True

    def close(self) -> None:
        """Stop the child (politely, then by force) and remove the log file. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._proc is not None:
                proc = self._proc
                self._discard()  # the child sees EOF on its socket and exits
                try:
                    proc.wait(timeout=2.0)
                except subprocess.TimeoutExpired:
                    _kill_group(proc)
            try:
                os.unlink(self.log_path)
            except OSError:
                pass

    def __enter__(self) -> IsolatedWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # -- calls --------------------------------------------------------------------------

    def call(self, func_path: str, *args: Any, timeout: float) -> CallOutcome:
        """Run ``func_path(*args)`` in the child ("pkg.module:function"); wait at most `timeout` s.

        Never raises for anything the function or the child does. Arguments that cannot
        be pickled are the caller's bug and raise here.
        """
        payload = pickle.dumps((func_path, args), protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            try:
                self.start()
            except WorkerStartError as exc:
                return CallOutcome(CallStatus.CRASHED, message=str(exc))
            assert self._conn is not None
            self._rotate_log()
            log_offset = os.path.getsize(self.log_path)
            t0 = time.perf_counter()
            try:
                self._conn.send_bytes(payload)
                reply = self._conn.recv_bytes() if self._conn.poll(timeout) else None
            except (EOFError, OSError):
                message = self._death_message(log_offset)
                self._kill()
                return CallOutcome(CallStatus.CRASHED, message=message, secs=time.perf_counter() - t0)
            except BaseException:  # KeyboardInterrupt...: the child's late answer would desync the protocol
                self._kill()
                raise
            secs = time.perf_counter() - t0
            if reply is None:
                self._kill()
                return CallOutcome(CallStatus.TIMED_OUT, message=f"no answer within {timeout:g} s", secs=secs)
            try:
                kind, value, message = pickle.loads(reply)
            except Exception as exc:  # e.g. the result's class cannot be imported here; the child is fine
                message = f"cannot unpickle the result: {type(exc).__name__}: {exc}"
                return CallOutcome(CallStatus.RAISED, message=message, secs=secs)
            if kind == "ok":
                return CallOutcome(CallStatus.OK, value=value, secs=secs)
            return CallOutcome(CallStatus.RAISED, message=message, secs=secs)

    # -- internals ----------------------------------------------------------------------

    def _death_message(self, log_offset: int = 0) -> str:
        """Why the child died, once its socket reported EOF."""
        proc = self._proc
        code = None
        if proc is not None:
            try:
                code = proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                code = None
        if code is None:
            text = "worker process closed its connection"
        elif code < 0:
            try:
                text = f"worker process died with signal {signal.Signals(-code).name}"
            except ValueError:
                text = f"worker process died with signal {-code}"
        else:
            text = f"worker process exited with code {code}"
        tail = _last_line(self.log_path, log_offset)
        return f"{text} (last output: {tail})" if tail else text

    def _kill(self) -> None:
        """SIGKILL the child's process group and reap the child; the next call starts a new one."""
        proc = self._proc
        if proc is not None:
            _kill_group(proc)
        self._discard()

    def _discard(self) -> None:
        if self._conn is not None:
            self._conn.close()
        if self._lifeline is not None:
            os.close(self._lifeline)
        self._proc = None
        self._conn = None
        self._lifeline = None
        self._ready = False

    def _rotate_log(self) -> None:
        try:
            if os.path.getsize(self.log_path) > LOG_ROTATE_BYTES:
                os.truncate(self.log_path, 0)  # the child writes with O_APPEND, so this is safe
        except OSError:
            pass


def summarize_error(text: str, limit: int = 300) -> str:
    """A short, still informative version of a (long, multi-line) TVM error message.

    Keeps the first meaningful line and, when TVM appended one, its "Error message:" line
    (schedule errors print the whole IR in between).
    """
    lines = [ln.strip() for ln in text.strip().splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith(("#", "Traceback", 'File "'))]
    if not lines:
        return text.strip()[:limit]
    head = re.sub(r"^(\w+): \1: ", r"\1: ", lines[0])  # "ScheduleError: ScheduleError: ..."
    detail = next((ln for ln in lines[1:] if ln.startswith(("Error message:", "Check failed"))), "")
    short = f"{head} {detail}" if detail else head
    return short if len(short) <= limit else short[: limit - 3] + "..."


def limit_address_space(pid: int, limit_bytes: int) -> None:
    """Cap process `pid`'s address space (RLIMIT_AS, soft and hard) at `limit_bytes`,
    from outside, right after it was spawned (before it imports anything large); its
    own children inherit the cap. Linux only (`prlimit`); raises `OSError`."""
    import resource

    if not hasattr(resource, "prlimit"):
        raise OSError("RLIMIT_AS of another process can only be set on Linux (prlimit)")
    resource.prlimit(pid, resource.RLIMIT_AS, (limit_bytes, limit_bytes))


def _last_line(path: str, offset: int, max_bytes: int = 4096) -> str:
    """The last non-empty line written to `path` after `offset`."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            start = offset if offset <= size else 0  # the log was emptied meanwhile
            f.seek(max(start, size - max_bytes))
            data = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    lines = [ln.strip() for ln in data.splitlines() if ln.strip()]
    return lines[-1][:200] if lines else ""


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.kill()
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=10.0)
    except subprocess.TimeoutExpired:
        pass


_WORKERS: weakref.WeakSet[IsolatedWorker] = weakref.WeakSet()
"""Workers not yet garbage-collected; their children are killed at interpreter exit."""


@atexit.register
def _kill_children_at_exit() -> None:
    for worker in list(_WORKERS):
        if worker._proc is not None:
            _kill_group(worker._proc)
        try:
            os.unlink(worker.log_path)
        except OSError:
            pass


# -- child side ---------------------------------------------------------------------------


def _child_main(
    fd: int, lifeline: int, preload: list[str], sandbox: dict[str, Any] | None = None, blocked: list[str] = ()
) -> None:
    """Entry point of the child process (see the module docstring for the protocol)."""
    if blocked:
        block_imports(tuple(blocked))
    spec = Sandbox(**sandbox) if sandbox is not None else None
    # User and mount namespaces need a process with one thread: before the lifeline thread.
    entered = enter_unprivileged(spec) if spec is not None and os.geteuid() != 0 else None
    mounts = hide_host_sockets(spec) if spec is not None and os.geteuid() == 0 else (0, ())
    threading.Thread(target=_exit_on_eof, args=(lifeline,), daemon=True, name="lifeline").start()
    conn = Connection(fd)
    try:
        for module in preload:
            importlib.import_module(module)
    except BaseException as exc:
        conn.send(("failed", f"importing the preload modules failed: {type(exc).__name__}: {exc}"))
        return
    status = None
    if spec is not None:
        # Root gives up its rights after the preload: its imports may come from places
        # the sandbox user cannot read.
        if entered is None:
            entered = enter_as_root(spec)
        own_network, problems, hidden = entered
        status = seal(own_network, problems + mounts[1], hidden + mounts[0])
    conn.send(("ready", {"pid": os.getpid(), "sandbox": asdict(status) if status is not None else None}))
    functions: dict[str, Any] = {}
    while True:
        try:
            request = conn.recv_bytes()
        except (EOFError, OSError):
            return  # the parent closed the connection or died
        try:
            func_path, args = pickle.loads(request)
            func = functions.get(func_path) or _resolve(func_path)
            functions[func_path] = func
            reply = ("ok", func(*args), "")
        except Exception as exc:
            reply = ("raised", None, f"{type(exc).__name__}: {exc}")
        try:
            data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # the return value does not pickle
            data = pickle.dumps(("raised", None, f"cannot pickle the result: {type(exc).__name__}: {exc}"))
        try:
            conn.send_bytes(data)
        except OSError:
            return


def _resolve(func_path: str) -> Any:
    module_name, sep, attr = func_path.partition(":")
    if not sep or not attr:
        raise ValueError(f"function path must look like 'package.module:function', got {func_path!r}")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _exit_on_eof(fd: int) -> None:
    """Exit as soon as the parent dies (or drops this child), even while a kernel hangs.

    The parent holds the only write end of the pipe and never writes; the read returns
    when that end closes. It blocks without waking up, so it adds no timing noise, and
    TVM releases the GIL while a kernel runs, so this thread gets to run.
    """
    try:
        while os.read(fd, 1):
            pass
    finally:
        os._exit(0)
