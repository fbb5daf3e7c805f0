"""The device agent: `tunefarm agent --server HOST:PORT --token T [--device-class C] [--name N]`.

One agent runs on each board. It opens every connection itself (a board may sit behind
NAT) to the lease service, and loops:

    register (capabilities detected here) -> lease a batch (long poll) -> fetch its kernels
    and, unless cached, its task data (one stream) -> run each kernel in an isolated
    process with a timeout (`LocalRunner`, the same `run_kernel` as embedded mode) and
    stream each result as soon as it exists -> finish the lease

An agent also runs whole tuned models when the lease service hands it one instead of a
batch (`LeasedModelRun`: the scheduler cannot run code built for this board): fetch the
library and its inputs -> run it once for the outputs and time `repeat` inferences in
the same runner process (`Runner.run_model`) -> send outputs and latencies
(`ReportModelRun`).

A heartbeat thread keeps alive the leases the agent names (`_Holding`: what it is
measuring or finishing) and tells it when it lost one (the batch then goes to another
agent, and this one drops it). Each LeaseBatch names them too, and the server ends any
other lease of the agent: a grant whose answer never arrived is leased again at once. A bad kernel never takes the
agent down: a crash, a hang or a wrong output is a result. The server going away is
survived: every call is retried with exponential backoff, the results stream is reopened
and the results it had not acknowledged are sent again (storing is idempotent).

Settings come from the command line or the environment (`AgentSettings.from_env`,
TUNEFARM_AGENT_*). The agent needs only TVM's runtime, numpy, grpcio, protobuf and
cryptography (the `agent` extra): it imports no search, build or database code.

An agent under an emulator (qemu-user) detects it and registers as emulated
(`capabilities.emulation`; TUNEFARM_AGENT_EMULATED overrides): its kernels' outputs are
checked as usual, its timings are flagged and never train a cost model.

What an agent trusts, and what it does not (it loads native code that came over the
network):

- the server: TLS (`--tls`, `--tls-ca`, ...) to anything but this machine; plaintext to
  another host is refused unless `--insecure-plaintext` says so (the token would travel
  in clear, and anyone on the path could answer in the server's place);
- the code: a kernel or model library is loaded only when the farm's signature on it
  verifies with the farm's public key (`--signing-public-key`; services/protocol/signing.py),
  over the sha256 of the bytes received: anything else is a RUN_ERROR result, deleted
  unloaded. An agent without the key does not start unless `--accept-unsigned-code`;
- file names: a kernel is saved as `<candidate id><suffix>` (one of `LOADABLE_SUFFIXES`),
  task data as `<sha256>.npz` with the sha256 checked to be 64 hex digits and to be that
  of the bytes received: nothing a server sends names a path;
- the kernels: they run in a sandboxed child (`tunefarm.isolation.Sandbox`): when the
  agent runs as root, as `--kernel-user` (default nobody) in a network namespace of its
  own; otherwise as the agent's user, without network where unprivileged user
  namespaces are allowed. The agent logs which protections are active when it starts.
  The files a kernel needs are readable by that user's group only (a lease's own
  directory writable), under the work directory, or, when a parent of it is closed to
  that user (/root), under a private temporary directory (`KernelFiles`);
- the registration: `Register` answers with a secret for this run of the agent, kept in
  memory only and sent with every later call (`x-tunefarm-agent-secret`): another process
  with the same token cannot act as this agent. A registration under the same name
  elsewhere replaces it; this agent is then refused and stops (PermissionDenied).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import queue
import random
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
from google.protobuf.json_format import ParseDict

from services.measurer import capabilities as caps_mod
from services.measurer.kernel_files import LOADABLE_SUFFIXES, KernelFiles, local_file_name
from services.protocol import wire
from services.protocol.errors import (
    BadRequest,
    LeaseLost,
    MeasurerError,
    NameTaken,
    NotFound,
    PermissionDenied,
    Transient,
    Unauthenticated,
    UnknownAgent,
    from_rpc_error,
)
from services.protocol.generated import measurer_pb2 as pb
from services.protocol.generated import measurer_pb2_grpc as pb_grpc
from services.protocol.signing import SHA256_HEX, ArtifactVerifier, BadSignature, KeyFileError, SignedKind
from tunefarm.measure.runner import LocalRunner, ModelRunInput, Runner
from tunefarm.records import ErrorKind, RunInput, RunResult
from tunefarm.sandbox import Sandbox
from tunefarm.target import physical_cores

log = logging.getLogger("tunefarm.agent")

T = TypeVar("T")

ENV_PREFIX = "TUNEFARM_AGENT_"

FATAL_ERRORS = (Unauthenticated, PermissionDenied, NameTaken, BadRequest)
"""Errors no retry fixes (a wrong token, a taken name, a class this machine cannot serve)."""

TASK_DATA_CACHE = 8
"""Task data files kept in the agent's work directory (least recently used go first)."""

HEALTH_INTERVAL_SECS = 60.0
"""How often the agent reports its health (besides at registration)."""

FETCH_ATTEMPTS = 5
"""Tries of a batch's Fetch before its missing files count as unavailable."""

STOP_GRACE_SECS = 10.0
"""A stopping agent tries this long to deliver the results it has and finish its lease."""

LOCAL_TARGETS = ("localhost", "unix:", "unix-abstract:")
"""Servers on this machine besides loopback addresses: the only ones reached in
plaintext without `--insecure-plaintext`."""

SIGNED_KINDS = {pb.ARTIFACT_KIND_KERNEL: SignedKind.KERNEL, pb.ARTIFACT_KIND_MODEL_LIBRARY: SignedKind.MODEL_LIBRARY}
"""The files that are code: loaded only with the farm's signature."""

CHANNEL_OPTIONS = (
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 5_000),
)


def _default_work_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tunefarm" / "agent"


@dataclass(frozen=True)
class AgentSettings:
    """How an agent reaches the farm and runs kernels. The only reader of the agent's
    environment (`from_env`); a plain dataclass, not pydantic-settings, to keep the
    agent's dependencies to TVM's runtime, numpy, grpcio, protobuf and cryptography."""

    server: str  # TUNEFARM_AGENT_SERVER: the lease service, host:port
    token: str = field(repr=False)  # TUNEFARM_AGENT_TOKEN: an agent token (tfa_...)
    device_class: str | None = None  # TUNEFARM_AGENT_DEVICE_CLASS; default: detected (arch-cpu-cores)
    name: str | None = None  # TUNEFARM_AGENT_NAME; default: the host name
    work_dir: Path = field(default_factory=_default_work_dir)  # TUNEFARM_AGENT_WORK_DIR: downloads, cache
    num_threads: int | None = None  # TUNEFARM_AGENT_THREADS: TVM threads per kernel; default: physical cores
    tls: bool = False  # TUNEFARM_AGENT_TLS: connect with TLS only (the system's roots, or tls_ca)
    tls_ca: Path | None = None  # TUNEFARM_AGENT_TLS_CA: PEM roots to trust instead (implies tls)
    tls_cert: Path | None = None  # TUNEFARM_AGENT_TLS_CERT: client certificate for mutual TLS (implies tls)
    tls_key: Path | None = None  # TUNEFARM_AGENT_TLS_KEY: its private key
    tls_server_name: str | None = None  # TUNEFARM_AGENT_TLS_SERVER_NAME: checked against the server's certificate
    reconnect_max_secs: float = 30.0  # TUNEFARM_AGENT_RECONNECT_MAX_SECS: longest wait between retries
    rpc_timeout_secs: float = 30.0  # TUNEFARM_AGENT_RPC_TIMEOUT_SECS: deadline of a unary call
    lease_wait_secs: float = 10.0  # TUNEFARM_AGENT_LEASE_WAIT_SECS: deadline of a long-polling LeaseBatch
    emulated: bool | None = None  # TUNEFARM_AGENT_EMULATED: runs under an emulator; default: detected
    gpu: bool = False  # TUNEFARM_AGENT_GPU: measure CUDA kernels on this machine's GPU (a CUDA class)
    # TUNEFARM_AGENT_INSECURE_PLAINTEXT: allow plaintext to a server on another host
    insecure_plaintext: bool = False
    # TUNEFARM_AGENT_SIGNING_PUBLIC_KEY: the farm's public key (PEM); code it did not sign is never loaded
    signing_public_key: Path | None = None
    # TUNEFARM_AGENT_ACCEPT_UNSIGNED_CODE: without a public key, load whatever the server sends
    accept_unsigned_code: bool = False
    # TUNEFARM_AGENT_KERNEL_USER: an agent running as root runs kernels as this user
    kernel_user: str = "nobody"

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: Any) -> AgentSettings:
        """Settings from TUNEFARM_AGENT_* variables; `overrides` (not None) win."""
        env = os.environ if environ is None else environ
        kinds = {
            "server": str,
            "token": str,
            "device_class": str,
            "name": str,
            "work_dir": Path,
            "num_threads": int,
            "tls": _flag,
            "tls_ca": Path,
            "tls_cert": Path,
            "tls_key": Path,
            "tls_server_name": str,
            "reconnect_max_secs": float,
            "rpc_timeout_secs": float,
            "lease_wait_secs": float,
            "emulated": _flag,
            "gpu": _flag,
            "insecure_plaintext": _flag,
            "signing_public_key": Path,
            "accept_unsigned_code": _flag,
            "kernel_user": str,
        }
        values: dict[str, Any] = {}
        for key, parse in kinds.items():
            var = env_name(key)
            if env.get(var):
                try:
                    values[key] = parse(env[var])
                except ValueError:
                    raise BadRequest(f"{var}={env[var]!r} is not a valid {key}") from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        for required in ("server", "token"):
            if not values.get(required):
                raise BadRequest(f"no {required}: pass --{required} or set {ENV_PREFIX}{required.upper()}")
        return cls(**values)

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise BadRequest("a client certificate needs its key: give both --tls-cert and --tls-key")
        if not self.uses_tls and not self.insecure_plaintext and not is_local(self.server):
            raise BadRequest(
                f"refusing plaintext to {self.server}: the token would travel in clear and anyone on the way "
                "could answer as the farm; use --tls (with --tls-ca), or --insecure-plaintext on a network you trust"
            )
        if self.signing_public_key is None and not self.accept_unsigned_code:
            raise BadRequest(
                "no signing public key: pass --signing-public-key FILE (the farm's public key, e.g. "
                "farm-signing.pub) so that only kernels the farm signed are loaded, or --accept-unsigned-code "
                "to load whatever the server sends"
            )

    @property
    def uses_tls(self) -> bool:
        """Connect with TLS, and never in plaintext."""
        return bool(self.tls or self.tls_ca or self.tls_cert or self.tls_server_name)


def is_local(server: str) -> bool:
    """Whether a gRPC target is on this machine (a loopback address, localhost, a unix socket)."""
    if server.startswith(LOCAL_TARGETS[1:]):
        return True
    target = server.split("///", 1)[1] if "///" in server else server
    host = target.rsplit(":", 1)[0] if target.count(":") == 1 or target.startswith("[") else target
    host = host.strip("[]")
    if host == LOCAL_TARGETS[0]:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def env_name(field_name: str) -> str:
    """The environment variable of an `AgentSettings` field."""
    return ENV_PREFIX + ("THREADS" if field_name == "num_threads" else field_name.upper())


def _flag(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(text)


class Backoff:
    """Exponential backoff with full jitter: 0.25 s, 0.5 s, ... up to `cap`."""

    def __init__(self, cap: float, base: float = 0.25):
        self.cap = cap
        self.base = base
        self._n = 0

    def next(self) -> float:
        delay = min(self.cap, self.base * (2**self._n))
        self._n += 1
        return random.uniform(delay / 2, delay)

    def reset(self) -> None:
        self._n = 0


# -- the agent ------------------------------------------------------------------------------


class Agent:
    """Registers, leases, fetches, runs and reports until `stop` is set.

    `runner` defaults to a sandboxed `LocalRunner` with `num_threads` TVM threads;
    `capabilities` to `capabilities.detect()`. Raises `BadRequest` for a public key that
    cannot be read.
    """

    def __init__(
        self,
        settings: AgentSettings,
        *,
        runner: Runner | None = None,
        capabilities: dict[str, Any] | None = None,
        stop: threading.Event | None = None,
    ):
        self.settings = settings
        self.stop = stop or threading.Event()
        self._work = Path(settings.work_dir).absolute()
        try:
            self.verifier = ArtifactVerifier.from_file(settings.signing_public_key) if settings.signing_public_key else None
        except KeyFileError as exc:
            raise BadRequest(str(exc)) from None
        # The runner made here runs kernels as the sandbox's user, who reads (and writes)
        # what the agent puts under `files.root` (`KernelFiles`).
        self._work.mkdir(parents=True, exist_ok=True)
        self.files = KernelFiles.prepare(self._work, settings.kernel_user if runner is None else None)
        self.runner = runner or LocalRunner(
            settings.num_threads or physical_cores(), sandbox=Sandbox(user=settings.kernel_user), cwd=self.files.root
        )
        self._caps = capabilities
        self._isa_checked: dict[str, str] = {}  # class target JSON -> why this CPU cannot serve it ("" if it can)
        self._probe = caps_mod.probe_worker()  # TVM in a child: the probe, then the class's ISA check
        # The token only until Register answers; then the token and this registration's
        # secret (in this process's memory only).
        self.metadata = wire.auth_metadata(settings.token)
        self.channel = open_channel(settings)
        self.stub = pb_grpc.AgentServiceStub(self.channel)
        self.agent_id: int | None = None
        self.heartbeat_secs = 5.0
        self._held: tuple[float, frozenset[int]] = (0.0, frozenset())  # (sent at, active lease ids)
        self.holding = _Holding()  # the leases and model runs this agent works on, named to the server
        self._fatal: MeasurerError | None = None
        self.measured = 0  # candidates reported (for logs and tests)
        self._finisher: threading.Thread | None = None  # finishing the previous lease

    # -- life cycle ---------------------------------------------------------------------

    def run(self) -> None:
        """Until `stop`: raises one of `FATAL_ERRORS` when no retry can help."""
        self._prepare()
        self._log_protections()
        beat = threading.Thread(target=self._heartbeats, daemon=True, name="agent-heartbeat")
        beat.start()
        backoff = Backoff(self.settings.reconnect_max_secs)
        try:
            while not self.stop.is_set():
                if self._fatal is not None:
                    raise self._fatal
                try:
                    if self.agent_id is None:
                        self._register()
                    leased = self._lease()
                    if isinstance(leased, pb.LeasedBatch):
                        self._measure(leased)
                    elif isinstance(leased, pb.LeasedModelRun):
                        self._run_model(leased)
                    backoff.reset()
                except UnknownAgent:
                    log.warning("the server does not know this agent any more; registering again")
                    self.agent_id = None
                except FATAL_ERRORS:
                    raise
                except MeasurerError as exc:
                    delay = backoff.next()
                    log.warning("%s; retrying in %.1f s", exc, delay)
                    self.stop.wait(delay)
        finally:
            self.stop.set()
            self._join_finisher()
            beat.join(timeout=5)
            self.runner.close()
            self._probe.close()
            self.channel.close()
            self.files.close()

    def _prepare(self) -> None:
        """Start the runner (its process imports TVM) while the capabilities are probed."""
        errors: list[BaseException] = []

        def start_runner() -> None:
            try:
                self.runner.start()
            except Exception as exc:  # WorkerStartError: reported as failing health
                errors.append(exc)

        t = threading.Thread(target=start_runner, daemon=True)
        t.start()
        if self._caps is None:
            self._caps = caps_mod.detect(emulated=self.settings.emulated, worker=self._probe)
            if self._caps.get("emulated"):
                log.warning(
                    "running under an emulator (%s): outputs are checked, timings are the emulator's",
                    self._caps.get("emulation"),
                )
        t.join()
        if self.settings.gpu:
            try:
                self._caps = caps_mod.with_gpu_target(self._caps)
            except BadRequest:  # no GPU: nothing this agent can measure
                self.runner.close()
                self.channel.close()
                raise
        self._runner_error = str(errors[0]) if errors else ""
        if self._runner_error:
            log.error("the kernel runner does not start: %s", self._runner_error)

    def _log_protections(self) -> None:
        """One line each: what code this agent loads, and how its kernels are confined."""
        if self.verifier is not None:
            log.info("loads only kernels and model libraries signed by the farm (%s)", self.settings.signing_public_key)
        else:
            log.warning("ACCEPTS UNSIGNED CODE (--accept-unsigned-code): it loads whatever the server sends")
        status = self.runner.sandbox_status
        log.info("%s", self.files.describe())
        if status is None:
            log.warning("kernel sandbox: none (this runner is not sandboxed)")
        elif status.uid == 0 or not status.own_network or status.problems:
            log.warning("kernel sandbox: %s", status.describe())
        else:
            log.info("kernel sandbox: %s", status.describe())

    def _register(self) -> None:
        caps = dict(self._caps or {})
        name = self.settings.name or socket.gethostname()
        device_class = self.settings.device_class or caps_mod.default_device_class(caps)
        msg = pb.RegisterRequest(
            name=name,
            device_class=device_class,
            capabilities=ParseDict(caps, pb.Capabilities(), ignore_unknown_fields=True),
        )
        resp = self._call(self.stub.Register, msg)
        token = self.settings.token
        self.metadata = wire.agent_metadata(token, resp.agent_secret) if resp.agent_secret else wire.auth_metadata(token)
        self.agent_id = resp.agent_id
        self.heartbeat_secs = max(0.05, resp.heartbeat_interval_secs or 5.0)
        log.info("registered as %s (agent %d) for device class %s", name, resp.agent_id, device_class)
        refusal = self._isa_refusal(device_class, resp.target_json)
        if refusal:
            self._runner_error = refusal  # reported as failing health, then the agent stops
            self._report_health()
            raise BadRequest(refusal)
        self._report_health()

    def _isa_refusal(self, device_class: str, target_json: str) -> str:
        """Why this machine cannot serve the class ("" when it can, or cannot tell): an
        instruction-set extension its code uses that this CPU lacks (an AVX-512 class on
        an AVX2 machine). Asked once per class target."""
        if target_json not in self._isa_checked:
            caps = self._caps or {}
            missing = caps_mod.class_missing_extensions(target_json, caps.get("isa_features") or [], worker=self._probe)
            self._probe.close()  # its TVM is not needed any more; a new one starts on demand
            self._probe = caps_mod.probe_worker()
            if missing is None:
                log.warning("could not check device class %s's ISA against this CPU's", device_class)
            self._isa_checked[target_json] = (
                caps_mod.isa_refusal(device_class, target_json, missing, caps.get("cpu_model") or "?") if missing else ""
            )
        return self._isa_checked[target_json]

    def _report_health(self) -> None:
        if self.agent_id is None:
            return
        failing = bool(getattr(self, "_runner_error", ""))
        report = pb.HealthReport(
            agent_id=self.agent_id,
            status=pb.HEALTH_STATUS_FAILING if failing else pb.HEALTH_STATUS_OK,
            message=getattr(self, "_runner_error", ""),
            **caps_mod.health_numbers(self._work),
        )
        try:
            self._call(self.stub.ReportHealth, report)
        except MeasurerError as exc:
            log.info("health report not delivered: %s", exc)

    def _heartbeats(self) -> None:
        last_health = time.monotonic()
        while not self.stop.wait(self.heartbeat_secs):
            agent_id = self.agent_id
            if agent_id is None:
                continue
            sent = time.monotonic()
            try:
                leases, runs = self.holding.ids()
                resp = self._call(
                    self.stub.Heartbeat,
                    pb.HeartbeatRequest(agent_id=agent_id, held_lease_ids=leases, held_model_run_ids=runs),
                )
                self._held = (sent, frozenset(resp.active_lease_ids))
            except UnknownAgent:
                self.agent_id = None  # the main loop registers again
            except FATAL_ERRORS as exc:
                self._fatal = exc
                return
            except MeasurerError as exc:
                log.info("heartbeat failed: %s", exc)
            if time.monotonic() - last_health >= HEALTH_INTERVAL_SECS:
                last_health = time.monotonic()
                self._report_health()

    def _lost(self, lease_id: int, granted: float) -> bool:
        """A heartbeat sent after the lease was granted no longer lists it."""
        sent, held = self._held
        return sent > granted and lease_id not in held

    def _call(self, method: Callable[..., T], request: Any, timeout: float | None = None) -> T:
        try:
            return method(request, metadata=self.metadata, timeout=timeout or self.settings.rpc_timeout_secs)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    # -- one batch ----------------------------------------------------------------------

    def _lease(self) -> pb.LeasedBatch | pb.LeasedModelRun | None:
        if getattr(self, "_runner_error", ""):
            # A runner that does not start would turn every kernel into a crash: measure
            # nothing, say so, and try again later.
            self._report_health()
            self.stop.wait(self.settings.reconnect_max_secs)
            self._prepare()
            return None
        assert self.agent_id is not None
        t0 = time.monotonic()
        leases, runs = self.holding.ids()
        resp = self._call(
            self.stub.LeaseBatch,
            pb.LeaseBatchRequest(
                agent_id=self.agent_id, model_runs=True, held_lease_ids=leases, held_model_run_ids=runs
            ),
            timeout=self.settings.lease_wait_secs,
        )
        if resp.HasField("model_run"):
            self.holding.add_model_run(resp.model_run.model_run_id)
            return resp.model_run
        if not resp.HasField("batch"):
            # The server waits for a batch before answering; one that answers at once (an
            # older server, a short deadline) is not asked again at once.
            if time.monotonic() - t0 < 0.05:
                self.stop.wait(0.2)
            return None
        self.holding.add_lease(resp.batch.lease_id)
        return resp.batch

    def _measure(self, batch: pb.LeasedBatch) -> None:
        granted = time.monotonic()
        lease_dir = self.files.root / "leases" / str(batch.lease_id)
        log.info(
            "lease %d: batch %d (%s), %d candidates, attempt %d",
            batch.lease_id,
            batch.batch_id,
            batch.workload_name,
            len(batch.candidates),
            batch.attempt,
        )
        stream: _ResultStream | None = _ResultStream(self, batch.lease_id)
        assert stream is not None
        try:
            files, task_data = self._fetch(batch, lease_dir)
            fetched = time.monotonic()
            timing = wire.timing_from_pb(batch.timing)
            for cand in batch.candidates:
                if self.stop.is_set() or self._lost(batch.lease_id, granted):
                    break
                kernel = files.get(cand.batch_candidate_id, "not fetched")
                if isinstance(task_data, str):
                    result = _error(cand.candidate_key, f"task data unavailable: {task_data}")
                elif isinstance(kernel, str):
                    result = _error(cand.candidate_key, f"kernel unavailable: {kernel}")
                else:
                    result = self._run(
                        RunInput(
                            candidate_key=cand.candidate_key,
                            artifact=str(kernel),
                            task_data=str(task_data),
                            n_inputs=batch.n_inputs,
                            n_outputs=batch.n_outputs,
                            verify=batch.verify,
                            timing=timing,
                            timeout_secs=batch.run_timeout_secs,
                        )
                    )
                    kernel.unlink(missing_ok=True)
                stream.send(wire.result_to_pb(cand.batch_candidate_id, result))
                self.measured += 1
            if self._lost(batch.lease_id, granted):
                log.warning("lease %d was lost (expired or given to another agent); dropping it", batch.lease_id)
                return
            # Finishing waits for the server to store the last results: done in the
            # background while this agent leases and fetches its next batch.
            self._finish_in_background(stream, batch, (fetched - granted, time.monotonic() - fetched))
            stream = None
        except LeaseLost as exc:
            log.warning("lease %d: %s; dropping the batch", batch.lease_id, exc)
        finally:
            if stream is not None:  # not handed to the finisher: this agent is done with the lease
                stream.close()
                self.holding.drop_lease(batch.lease_id)
            shutil.rmtree(lease_dir, ignore_errors=True)

    def _finish_in_background(
        self, stream: _ResultStream, batch: pb.LeasedBatch, secs: tuple[float, float]
    ) -> None:
        """Finish `stream`'s lease in a thread; at most one such thread at a time."""
        self._join_finisher()

        def finish() -> None:
            t0 = time.monotonic()
            try:
                state = stream.finish()
                log.info(
                    "lease %d finished: batch %d is %s (fetch %.3f s, run %.3f s, finish %.3f s)",
                    batch.lease_id,
                    batch.batch_id,
                    state,
                    *secs,
                    time.monotonic() - t0,
                )
            except MeasurerError as exc:
                log.warning("lease %d not finished: %s", batch.lease_id, exc)
            finally:
                stream.close()
                self.holding.drop_lease(batch.lease_id)

        self._finisher = threading.Thread(target=finish, daemon=True, name="agent-finish")
        self._finisher.start()

    def _join_finisher(self) -> None:
        if self._finisher is not None:
            self._finisher.join()
            self._finisher = None

    def _run(self, inp: RunInput) -> RunResult:
        try:
            return self.runner.run([inp])[0]
        except Exception as exc:  # the runner never raises for a kernel; be sure anyway
            return _error(inp.candidate_key, f"runner failed: {type(exc).__name__}: {exc}")

    # -- one model run ------------------------------------------------------------------

    def _run_model(self, run: pb.LeasedModelRun) -> None:
        """Fetch, run and report one leased model run (see the module docstring)."""
        run_dir = self.files.root / "model_runs" / str(run.model_run_id)
        self.files.make_dir(run_dir.parent)
        self.files.make_dir(run_dir, writable=True)  # the runner writes the outputs there
        log.info("model run %d: %d timed inferences", run.model_run_id, run.repeat)
        try:
            result = self._model_result(run, run_dir)
            result.agent_id = self.agent_id or 0
            result.model_run_id = run.model_run_id
            self._report_model_run(result)
        except LeaseLost as exc:
            log.warning("model run %d: %s; dropping it", run.model_run_id, exc)
        finally:
            self.holding.drop_model_run(run.model_run_id)
            shutil.rmtree(run_dir, ignore_errors=True)

    def _model_result(self, run: pb.LeasedModelRun, run_dir: Path) -> pb.ModelRunResult:
        name = local_file_name(run.library.file_name, "model")
        if name is None:
            return pb.ModelRunResult(error=f"refused: the library's file name ends in none of {LOADABLE_SUFFIXES}")
        if run.library.id != run.model_run_id:
            return pb.ModelRunResult(error="refused: the library offered is another model run's")
        library, inputs, outputs = run_dir / name, run_dir / "inputs.npz", run_dir / "outputs.npz"
        got = self._fetch_files([(run.library, library), (run.inputs, inputs)], model_run_id=run.model_run_id)
        missing = [why for why in (got.get(i, "not fetched") for i in range(2)) if isinstance(why, str)]
        if missing:
            return pb.ModelRunResult(error=f"files unavailable: {'; '.join(missing)}")
        ran = self.runner.run_model(
            ModelRunInput(str(library), str(inputs), str(outputs), run.repeat, run.warmup, run.timeout_secs)
        )
        return pb.ModelRunResult(
            latency_samples=ran.latency_samples,
            run_secs=ran.run_secs,
            error=ran.error,
            outputs_npz=b"" if ran.error else outputs.read_bytes(),
        )

    def _report_model_run(self, result: pb.ModelRunResult) -> None:
        """Send a model run's result until the server stored it (retrying while it is
        away); a refusal (the run was given to another agent) raises `LeaseLost`."""
        backoff = Backoff(self.settings.reconnect_max_secs)
        deadline: float | None = None
        while deadline is None or time.monotonic() < deadline:
            if deadline is None and self.stop.is_set():
                deadline = time.monotonic() + STOP_GRACE_SECS
            try:
                self._call(self.stub.ReportModelRun, result)
                log.info("model run %d reported%s", result.model_run_id, f": {result.error}" if result.error else "")
                return
            except (LeaseLost, *FATAL_ERRORS):
                raise
            except MeasurerError as exc:
                delay = backoff.next()
                log.warning("model run %d not reported (%s); retrying in %.1f s", result.model_run_id, exc, delay)
                self.stop.wait(delay)
        log.warning("stopped before model run %d was reported", result.model_run_id)

    # -- files --------------------------------------------------------------------------

    def _fetch(self, batch: pb.LeasedBatch, lease_dir: Path) -> tuple[dict[int, Path | str], Path | str]:
        """Download the batch's kernels, and its task data unless cached: one Fetch stream
        (retried for what is missing after a transport error). Returns each candidate's
        kernel path or why it is unavailable, and the task data's path or why not. Files
        are saved under names made here (`local_file_name`, the task data's checked
        sha256), never under a name the server sent."""
        self.files.make_dir(lease_dir.parent)
        self.files.make_dir(lease_dir, writable=True)  # a CUDA or .tar kernel unpacks next to itself
        cache = self.files.root / "task_data"
        self.files.make_dir(cache)
        out: dict[int, Path | str] = {}
        wanted: list[tuple[pb.ArtifactRef, Path]] = []
        for cand in batch.candidates:
            name = local_file_name(cand.kernel.file_name, str(cand.batch_candidate_id))
            if not cand.kernel.file_name:
                out[cand.batch_candidate_id] = "the candidate has no built kernel"
            elif name is None:
                out[cand.batch_candidate_id] = f"refused: its file name ends in none of {LOADABLE_SUFFIXES}"
            elif cand.kernel.id != cand.batch_candidate_id:
                out[cand.batch_candidate_id] = "refused: the kernel offered is another candidate's"
            else:
                wanted.append((cand.kernel, lease_dir / name))
        td_ref = batch.task_data
        task_data: Path | str
        if not td_ref.id:
            task_data = "the workload has no task data"
        elif not SHA256_HEX.fullmatch(td_ref.sha256):
            task_data = "refused: the server named it by something other than a sha256"
        else:
            task_data = cache / f"{td_ref.sha256}.npz"
            if task_data.is_file() and (not td_ref.size or task_data.stat().st_size == td_ref.size):
                task_data.touch()  # most recently used
                self.files.share_file(task_data)
            else:
                wanted.append((td_ref, task_data))
        done = self._fetch_files(wanted, lease_id=batch.lease_id)
        for i, (ref, _) in enumerate(wanted):
            got = done.get(i, "not fetched")
            if ref.kind == pb.ARTIFACT_KIND_TASK_DATA:
                task_data = got
            else:
                out[ref.id] = got
        if isinstance(task_data, Path):
            _evict(cache, keep=TASK_DATA_CACHE)
        return out, task_data

    def _fetch_files(
        self, wanted: list[tuple[pb.ArtifactRef, Path]], *, lease_id: int = 0, model_run_id: int = 0
    ) -> dict[int, Path | str]:
        """Download the files of a lease (or of a model run) to their paths: one Fetch
        stream, retried for what is missing after a transport error. Returns, by index
        in `wanted`, each file's path or why it is unavailable."""
        done: dict[int, Path | str] = {}
        backoff = Backoff(self.settings.reconnect_max_secs)
        for attempt in range(FETCH_ATTEMPTS):
            todo = [i for i in range(len(wanted)) if i not in done]
            if not todo:
                break
            try:
                self._fetch_once([wanted[i] for i in todo], todo, done, lease_id=lease_id, model_run_id=model_run_id)
            except LeaseLost:
                raise
            except MeasurerError as exc:
                if isinstance(exc, FATAL_ERRORS) or attempt == FETCH_ATTEMPTS - 1:
                    for i in todo:
                        done.setdefault(i, f"fetch failed: {exc}")
                    break
                self.stop.wait(backoff.next())
        return done

    def _fetch_once(
        self,
        files: list[tuple[pb.ArtifactRef, Path]],
        indices: list[int],
        done: dict[int, Path | str],
        *,
        lease_id: int,
        model_run_id: int,
    ) -> None:
        assert self.agent_id is not None
        request = pb.FetchRequest(
            agent_id=self.agent_id, lease_id=lease_id, model_run_id=model_run_id, refs=[ref for ref, _ in files]
        )
        sinks: dict[int, _Sink] = {}
        timeout = max(60.0, self.settings.rpc_timeout_secs * 4)
        try:
            for chunk in self.stub.Fetch(request, metadata=self.metadata, timeout=timeout):
                for part in chunk.parts:
                    if not 0 <= part.index < len(files):
                        raise Transient(f"the server sent part of file {part.index}; {len(files)} were asked for")
                    ref, dest = files[part.index]
                    sink = sinks.get(part.index)
                    if part.error:
                        if sink is not None:
                            sink.discard()
                        done[indices[part.index]] = part.error
                        continue
                    if sink is None:
                        sink = sinks[part.index] = _Sink(dest)
                    sink.write(part.offset, part.data)
                    if part.last:
                        got = sink.close(part.sha256)
                        done[indices[part.index]] = self._accepted(ref, got, sink.sha256) if isinstance(got, Path) else got
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        finally:
            for sink in sinks.values():
                sink.discard()

    def _accepted(self, ref: pb.ArtifactRef, path: Path, sha256: str) -> Path | str:
        """`path` once downloaded, if it may be used: task data whose bytes are the sha256
        it is cached under; code with the farm's signature over the bytes received (when
        the agent has the farm's public key). Otherwise it is deleted: why, as a string."""
        problem = ""
        if ref.kind == pb.ARTIFACT_KIND_TASK_DATA and sha256 != ref.sha256:
            problem = "refused: its bytes are not the sha256 it was named by"
        kind = SIGNED_KINDS.get(ref.kind)
        if kind is not None and self.verifier is not None:
            try:
                self.verifier.verify(kind, ref.signed_as or ref.id, sha256, ref.signature)
            except BadSignature as exc:
                problem = f"not loaded: {exc}"
                log.warning("%s %d %s", kind, ref.id, problem)
        if problem:
            path.unlink(missing_ok=True)
            return problem
        self.files.share_file(path)
        return path


class _Sink:
    """One file being downloaded: written to `<dest>.part`, checked, then renamed."""

    def __init__(self, dest: Path):
        import hashlib

        self.dest = dest
        self.part = dest.with_name(dest.name + ".part")
        self._file: Any = open(self.part, "wb")
        self._sha = hashlib.sha256()
        self._size = 0
        self.sha256 = ""  # of the bytes received, once closed

    def write(self, offset: int, data: bytes) -> None:
        if offset != self._size:
            raise Transient(f"{self.dest.name}: chunk at {offset}, expected {self._size}")
        self._file.write(data)
        self._sha.update(data)
        self._size += len(data)

    def close(self, sha256: str) -> Path | str:
        self._file.close()
        self._file = None
        self.sha256 = self._sha.hexdigest()
        if sha256 and sha256 != self.sha256:
            self.part.unlink(missing_ok=True)
            return f"{self.dest.name}: checksum mismatch"
        os.replace(self.part, self.dest)
        return self.dest

    def discard(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
            self.part.unlink(missing_ok=True)


class _Holding:
    """The leases and model runs the agent works on: from LeaseBatch's answer until it is
    done with them (finished, reported, or dropped). Heartbeats renew these and no others,
    and LeaseBatch names them so that the server ends any other (a grant that never
    arrived). Shared by the main loop, the finisher and the heartbeat thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._leases: set[int] = set()
        self._runs: set[int] = set()

    def ids(self) -> tuple[list[int], list[int]]:
        with self._lock:
            return sorted(self._leases), sorted(self._runs)

    def add_lease(self, lease_id: int) -> None:
        with self._lock:
            self._leases.add(lease_id)

    def drop_lease(self, lease_id: int) -> None:
        with self._lock:
            self._leases.discard(lease_id)

    def add_model_run(self, run_id: int) -> None:
        with self._lock:
            self._runs.add(run_id)

    def drop_model_run(self, run_id: int) -> None:
        with self._lock:
            self._runs.discard(run_id)


def _evict(directory: Path, keep: int) -> None:
    files = sorted((p for p in directory.glob("*.npz")), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in files[keep:]:
        old.unlink(missing_ok=True)


def _error(key: str, message: str) -> RunResult:
    return RunResult(key, (), 0.0, ErrorKind.RUN_ERROR, message)


# -- the results stream ---------------------------------------------------------------------


_CLOSE = object()


class _ResultStream:
    """The results of one lease on a ReportResults stream.

    Results are kept until the server acknowledges them. When the stream breaks (server
    restart, network), it is opened again and every unacknowledged result is sent again;
    `finish` sends Finish and waits for the server's answer, reopening as needed. A
    refused lease (FAILED_PRECONDITION) raises `LeaseLost`.
    """

    def __init__(self, agent: Agent, lease_id: int):
        self.agent = agent
        self.lease_id = lease_id
        self._lock = threading.Lock()
        self._unacked: dict[int, pb.Result] = {}
        self._outbox: queue.SimpleQueue[object] | None = None
        self._reader: threading.Thread | None = None
        self._call: Any = None
        self._failure: MeasurerError | None = None
        self._finished: str | None = None  # the batch state the server answered Finish with
        self._backoff = Backoff(agent.settings.reconnect_max_secs)
        self._next_open = 0.0

    def send(self, result: pb.Result) -> None:
        with self._lock:
            self._unacked[result.batch_candidate_id] = result
        self._check()
        if self._outbox is not None:
            self._outbox.put(self._message(result=result))
        else:
            self._try_open()  # sends everything unacknowledged, this one included

    def finish(self) -> str:
        """Send Finish; the batch's state once the server has stored everything. Keeps
        trying while the server is away; once the agent is stopping, for STOP_GRACE_SECS."""
        deadline: float | None = None
        while deadline is None or time.monotonic() < deadline:
            if deadline is None and self.agent.stop.is_set():
                deadline = time.monotonic() + STOP_GRACE_SECS
            self._check()
            if self._outbox is None and not self._try_open():
                time.sleep(min(1.0, max(0.01, self._next_open - time.monotonic())))
                continue
            assert self._outbox is not None and self._reader is not None
            self._outbox.put(self._message(finish=pb.Finish()))
            self._outbox.put(_CLOSE)
            self._outbox = None
            self._reader.join()
            if self._finished is not None:
                return self._finished
            if isinstance(self._failure, (LeaseLost, *FATAL_ERRORS)):
                raise self._failure
            log.info("results stream of lease %d broke (%s); reopening", self.lease_id, self._failure)
        raise Transient(f"stopped before lease {self.lease_id} was finished")

    def close(self) -> None:
        if self._outbox is not None:
            self._outbox.put(_CLOSE)
            self._outbox = None
        if self._call is not None:
            self._call.cancel()
        if self._reader is not None:
            self._reader.join(timeout=5)

    def _message(self, **body: Any) -> pb.ResultMessage:
        assert self.agent.agent_id is not None
        return pb.ResultMessage(agent_id=self.agent.agent_id, lease_id=self.lease_id, **body)

    def _check(self) -> None:
        """Raise a lease refusal; forget a broken stream (reopened on the next send)."""
        failure = self._failure
        if failure is None:
            return
        if isinstance(failure, (LeaseLost, *FATAL_ERRORS)):
            raise failure
        if self._outbox is not None:
            self._outbox.put(_CLOSE)
            self._outbox = None

    def _try_open(self) -> bool:
        """Open the stream and send every unacknowledged result; False while the last
        opening is too recent (backoff)."""
        now = time.monotonic()
        if now < self._next_open:
            return False
        if self._reader is not None:
            self._reader.join()
        self._failure = None
        outbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        with self._lock:
            for result in self._unacked.values():
                outbox.put(self._message(result=result))
        self._call = self.agent.stub.ReportResults(_drain(outbox), metadata=self.agent.metadata)
        self._outbox = outbox
        self._reader = threading.Thread(target=self._read, args=(self._call,), daemon=True, name="agent-acks")
        self._reader.start()
        self._next_open = now + self._backoff.next()
        return True

    def _read(self, call: Iterator[pb.ResultAck]) -> None:
        try:
            for ack in call:
                with self._lock:
                    for bc_id in ack.batch_candidate_ids:
                        self._unacked.pop(bc_id, None)
                if ack.finished:
                    self._finished = ack.batch_state or "done"
                    self._backoff.reset()
            if self._finished is None:
                self._failure = Transient("the server closed the results stream")
        except grpc.RpcError as exc:
            self._failure = from_rpc_error(exc)


def _drain(outbox: queue.SimpleQueue[object]) -> Iterator[pb.ResultMessage]:
    while True:
        item = outbox.get()
        if item is _CLOSE:
            return
        assert isinstance(item, pb.ResultMessage)
        yield item


def open_channel(settings: AgentSettings) -> grpc.Channel:
    """The agent's channel to the lease service: TLS when the settings ask for it (the
    server's certificate checked against `tls_ca`, or the system's roots; a client
    certificate for mutual TLS), and then never plaintext: a server that does not speak
    TLS, or whose certificate does not check, answers nothing (UNAVAILABLE, retried).
    Plaintext otherwise: to this machine, or where `insecure_plaintext` allows it (the
    settings refuse anything else), with a warning. Raises `BadRequest` for a file that
    cannot be read."""
    if not settings.uses_tls:
        if not is_local(settings.server):
            log.warning("connecting to %s in plaintext (--insecure-plaintext): the token travels in clear", settings.server)
        return grpc.insecure_channel(settings.server, options=CHANNEL_OPTIONS)

    def read(path: Path | None, what: str) -> bytes | None:
        try:
            return Path(path).read_bytes() if path else None
        except OSError as exc:
            raise BadRequest(f"cannot read the {what} {path}: {exc.strerror}") from None

    credentials = grpc.ssl_channel_credentials(
        root_certificates=read(settings.tls_ca, "CA certificate"),
        private_key=read(settings.tls_key, "client key"),
        certificate_chain=read(settings.tls_cert, "client certificate"),
    )
    options = CHANNEL_OPTIONS
    if settings.tls_server_name:
        options = (*options, ("grpc.ssl_target_name_override", settings.tls_server_name))
    return grpc.secure_channel(settings.server, credentials, options=options)


# -- entry points ---------------------------------------------------------------------------


def run_agent(
    settings: AgentSettings,
    *,
    runner: Runner | None = None,
    stop: threading.Event | None = None,
    capabilities: dict[str, Any] | None = None,
) -> None:
    """Run an agent until `stop` is set (or a fatal error: a bad token, a taken name, a
    device class this machine cannot serve, which raise)."""
    Agent(settings, runner=runner, capabilities=capabilities, stop=stop).run()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tunefarm agent", description="measure kernels for a tunefarm farm")
    p.add_argument("--server", help="the lease service, HOST:PORT (TUNEFARM_AGENT_SERVER)")
    p.add_argument("--token", help="agent token (TUNEFARM_AGENT_TOKEN; the environment keeps it out of `ps`)")
    p.add_argument("--device-class", help="device class to measure for (default: detected, e.g. x86_64-znver5-2c)")
    p.add_argument("--name", help="this agent's unique name (default: the host name)")
    p.add_argument("--work-dir", type=Path, help="downloads and the task data cache")
    p.add_argument("--threads", type=int, dest="num_threads", help="TVM threads per kernel (default: physical cores)")
    p.add_argument("--tls", action="store_true", default=None,
                   help="connect with TLS only, never plaintext (TUNEFARM_AGENT_TLS; implied by the flags below)")
    p.add_argument("--tls-ca", type=Path, help="PEM CA certificate(s) the server's certificate must chain to "
                   "(default: the system's roots; TUNEFARM_AGENT_TLS_CA)")
    p.add_argument("--tls-cert", type=Path, help="client certificate (PEM) for a farm that wants mutual TLS "
                   "(TUNEFARM_AGENT_TLS_CERT)")
    p.add_argument("--tls-key", type=Path, help="the client certificate's private key (PEM; TUNEFARM_AGENT_TLS_KEY)")
    p.add_argument("--tls-server-name", help="the name the server's certificate is checked against "
                   "(default: the host of --server; TUNEFARM_AGENT_TLS_SERVER_NAME)")
    p.add_argument(
        "--emulated",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="this agent runs under an emulator: its timings are not the device's (default: detected)",
    )
    p.add_argument(
        "--gpu",
        action="store_true",
        default=None,
        help="measure CUDA kernels on this machine's NVIDIA GPU (its class: a CUDA target; default class: named after the GPU)",
    )
    p.add_argument("--insecure-plaintext", action="store_true", default=None,
                   help="allow plaintext to a server on another host (the token travels in clear; "
                   "TUNEFARM_AGENT_INSECURE_PLAINTEXT)")
    p.add_argument("--signing-public-key", type=Path,
                   help="the farm's public key (PEM): only kernels and models it signed are loaded "
                   "(TUNEFARM_AGENT_SIGNING_PUBLIC_KEY)")
    p.add_argument("--accept-unsigned-code", action="store_true", default=None,
                   help="without a public key, load whatever the server sends (TUNEFARM_AGENT_ACCEPT_UNSIGNED_CODE)")
    p.add_argument("--kernel-user",
                   help="an agent running as root runs kernels as this user (default nobody; TUNEFARM_AGENT_KERNEL_USER)")
    return p


def main(argv: list[str] | None = None) -> int:
    """The `tunefarm agent` command: 0 after SIGTERM/SIGINT, 2 for a fatal error."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        settings = AgentSettings.from_env(**vars(args))
    except BadRequest as exc:
        print(f"tunefarm agent: error: {exc}", flush=True)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        run_agent(settings, stop=stop)
    except (*FATAL_ERRORS, NotFound) as exc:
        print(f"tunefarm agent: error: {type(exc).__name__}: {exc}", flush=True)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

