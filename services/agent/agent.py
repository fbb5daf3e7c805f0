"""The device agent's loop: `tunefarm agent --server HOST:PORT [--token-file F] [--device-class C] [--name N]`
(the token from TUNEFARM_AGENT_TOKEN or the file, never the command line: `ps` shows it).

One agent runs on each board. It opens every connection itself (a board may sit behind
NAT) to the lease service, and loops:

    register (capabilities detected here) -> lease a batch (long poll) -> fetch its kernels
    and, unless cached, its task data (one stream) -> run each kernel in an isolated
    process with a timeout (`LocalRunner`, the same `run_kernel` as embedded mode) and
    stream each result as soon as it exists -> finish the lease

An agent also runs whole tuned models when the lease service hands it one instead of a
batch (`LeasedModelRun`: every tuned model of its class is checked and timed on one of
the class's agents): fetch the library, its inputs and, for a timed run, the ONNX graph
-> run it once for the outputs in the runner process, then time `repeat` inferences of
it there and as many of onnxruntime's (and OpenVINO's, where installed) on the graph,
in alternating rounds (`Runner.run_model`) -> send outputs and latencies
(`ReportModelRun`; services/agent/model_runs.py).

Stopped (SIGTERM/SIGINT, `stop`), it finishes what it reports, then says `GoOffline`:
the leases it still holds are leased again at once, and it is offline, not idle, until
it registers again. A LeaseBatch it is waiting on is cancelled: it does not wait out the
long poll first.

A heartbeat thread keeps alive the leases the agent names (`_Holding`: what it is
measuring or finishing) and tells it when it lost one (the batch then goes to another
agent, and this one drops it). Each LeaseBatch names them too, and the server ends any
other lease of the agent: a grant whose answer never arrived is leased again at once. A
bad kernel never takes the agent down: a crash, a hang or a wrong output is a result.
The server going away is survived: every call is retried with exponential backoff
(services/agent/channel.py), the results stream is reopened and the results it had not
acknowledged are sent again (services/agent/results.py).

An agent under an emulator (qemu-user) detects it and registers as emulated
(`capabilities.emulation`; TUNEFARM_AGENT_EMULATED overrides): its kernels' outputs are
checked as usual, its timings are flagged and never train a cost model.

The kernels run in a sandboxed child (the runner made here, `--kernel-user`); `Register`
answers with a secret for this run of the agent, kept in memory only and sent with every
later call. What an agent trusts, and what it does not: the package's docstring
(services/agent/__init__.py).
"""

from __future__ import annotations

import logging
import shutil
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc
from google.protobuf.json_format import ParseDict

from services.agent import capabilities as caps_mod
from services.agent.channel import FATAL_ERRORS, Backoff, open_channel
from services.agent.files import Downloads
from services.agent.kernel_files import KernelFiles
from services.agent.model_runs import fetch_model_run, model_run_message
from services.agent.results import STOP_GRACE_SECS, ResultStream
from services.agent.settings import AgentSettings
from services.protocol import wire
from services.protocol.errors import (
    BadRequest,
    LeaseLost,
    MeasurerError,
    NotFound,
    UnknownAgent,
    from_rpc_error,
)
from services.protocol.generated import measurer_pb2 as pb
from services.protocol.generated import measurer_pb2_grpc as pb_grpc
from services.protocol.signing import ArtifactVerifier, KeyFileError
from tunefarm.display import printable
from tunefarm.measure.runner import LocalRunner, Runner
from tunefarm.records import ErrorKind, RunInput, RunResult
from tunefarm.sandbox import Sandbox
from tunefarm.target import physical_cores

log = logging.getLogger("tunefarm.agent")

T = TypeVar("T")

HEALTH_INTERVAL_SECS = 60.0

WITHHELD_LOG_SECS = 600.0
"""How often an agent the server leases nothing (flagged, quarantined) says so again."""
"""How often the agent reports its health (besides at registration)."""

GO_OFFLINE_TIMEOUT_SECS = 5.0
"""How long a stopping agent waits for the server to take its leases back."""

STOP_CHECK_SECS = 0.1
"""How often a long poll looks whether the agent stops (it is cancelled then)."""


class DeviceAgent:
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
        self.downloads = Downloads(self, self.files, self.verifier)
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
        self._withheld_reason: str | None = None  # why the server last leased it nothing (flagged...)
        self._withheld_logged = 0.0

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
                    if isinstance(exc, NotFound) and self.agent_id is None:
                        raise  # Register: its device class does not exist (a typo); no retry helps
                    delay = backoff.next()
                    log.warning("%s; retrying in %.1f s", exc, delay)
                    self.stop.wait(delay)
        finally:
            self.stop.set()
            self._join_finisher()
            beat.join(timeout=5)
            self._go_offline()
            self.runner.close()
            self._probe.close()
            self.channel.close()
            self.files.close()

    def _go_offline(self) -> None:
        """Stopping: tell the server, so that the leases this agent still holds are leased
        again now (not after the lease window) and it is not counted live meanwhile. Once,
        briefly: a server that does not answer expires them as before."""
        if self.agent_id is None:
            return
        try:
            resp = self._call(self.stub.GoOffline, pb.GoOfflineRequest(agent_id=self.agent_id),
                              timeout=GO_OFFLINE_TIMEOUT_SECS)  # fmt: skip
        except MeasurerError as exc:
            log.warning("stopping without telling the server (%s): its leases expire on their own", exc)
            return
        released = list(resp.released_batch_ids)
        log.info("offline; %s", f"batches {released} given back" if released else "it held no lease")

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

    def _long_poll(self, method: Any, request: Any, timeout: float) -> Any | None:
        """`_call` for a call the server may hold until `timeout` (a LeaseBatch waits for
        work): cancelled once the agent stops, which then goes offline at once instead of
        after the long poll; None when it was. A grant the server made meanwhile, whose
        answer never arrives, ends with GoOffline (it ends every lease of the agent)."""
        call = method.future(request, metadata=self.metadata, timeout=timeout)
        answered = threading.Event()
        call.add_done_callback(lambda _call: answered.set())
        while not answered.wait(STOP_CHECK_SECS):
            if self.stop.is_set() and call.cancel():
                return None
        try:
            return call.result()
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
        resp = self._long_poll(
            self.stub.LeaseBatch,
            pb.LeaseBatchRequest(
                agent_id=self.agent_id, model_runs=True, held_lease_ids=leases, held_model_run_ids=runs
            ),
            timeout=self.settings.lease_wait_secs,
        )
        if resp is None:  # stopping
            return None
        if resp.withheld:
            self._log_withheld(resp.withheld)
            self.stop.wait(self.settings.lease_wait_secs)  # the heartbeats go on meanwhile
            return None
        if self._withheld_reason is not None:
            log.warning("the server leases this agent work again")
            self._withheld_reason = None
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

    def _log_withheld(self, reason: str) -> None:
        """The server leases this agent nothing (flagged, quarantined): said once per
        reason, and again every `WITHHELD_LOG_SECS`, not on every poll."""
        now = time.monotonic()
        if reason != self._withheld_reason or now - self._withheld_logged >= WITHHELD_LOG_SECS:
            log.warning("the server leases this agent nothing: %s", printable(reason))
            self._withheld_reason, self._withheld_logged = reason, now

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
        stream: ResultStream | None = ResultStream(self, batch.lease_id)
        assert stream is not None
        try:
            files, task_data = self.downloads.batch_files(batch, lease_dir)
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
        self, stream: ResultStream, batch: pb.LeasedBatch, secs: tuple[float, float]
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
        fetched = fetch_model_run(run, run_dir, self.downloads)
        if isinstance(fetched, str):
            return pb.ModelRunResult(error=fetched)
        return model_run_message(self.runner.run_model(fetched.input), fetched)

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


def _error(key: str, message: str) -> RunResult:
    return RunResult(key, (), 0.0, ErrorKind.RUN_ERROR, message)


def run_agent(
    settings: AgentSettings,
    *,
    runner: Runner | None = None,
    stop: threading.Event | None = None,
    capabilities: dict[str, Any] | None = None,
) -> None:
    """Run an agent until `stop` is set (or a fatal error: a bad token, a taken name, a
    device class this machine cannot serve, which raise)."""
    DeviceAgent(settings, runner=runner, capabilities=capabilities, stop=stop).run()
