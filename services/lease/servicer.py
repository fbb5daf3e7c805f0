"""The lease service's RPCs (`AgentServicer`): those of proto/tunefarm/v1/measurer.proto.

Thin: each call authenticates (services/lease/auth.py), does its database work in one
transaction through `services.db`, and maps exceptions to status codes
(`_status`). All state is in PostgreSQL, so the service can restart (or run as several
replicas) at any time: an agent's calls fail with UNAVAILABLE meanwhile and it retries.

- `LeaseBatch` is a long poll (`lease_wait_secs`) that asks the database only when the
  agent's class may have work (services/lease/work_board.py), with at most
  `grpc_max_workers - RPC_THREADS_KEPT_FREE` polls waiting at once. An agent that may be
  leased nothing (flagged, quarantined: `leases.lease_withheld`) is answered at once
  with why (`LeaseBatchResponse.withheld`): its timings are not believed, so any trial
  it ran would be spent for nothing.
- Model runs: an agent that asks for them (`LeaseBatchRequest.model_runs`) gets its
  class's oldest ready `ModelRun` before any batch (it ends a job); `Fetch` serves its
  library, inputs and, for a timed run, the ONNX graph its peers are timed on
  (services/lease/files.py), `ReportModelRun` stores its outputs under the artifact root
  and its latencies and the peers' (flagged emulated when the agent is) in the row, for
  the scheduler to check.
- `ReportResults` stores a stream's results in groups and refuses what the lease was not
  handed (services/lease/results.py).

Device classes are the operators' (`tunefarm farm device-class`): an agent naming a
class that does not exist is refused (NOT_FOUND) unless `auto_create_device_classes` is
set, which lets any agent token create a class every team sees.

Kernels, model libraries and model runs' ONNX graphs are handed out with the signature their builder made
(`ArtifactRef.signature`, services/protocol/signing.py); agents check it before loading.
An error's message names only what the caller sent (never, e.g., the key a candidate
should have had), and an unexpected error is INTERNAL with no detail (it is logged here).
"""

from __future__ import annotations

import functools
import json
import logging
import platform
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
from google.protobuf.json_format import MessageToDict

from services.common import artifacts
from services.db import (
    agents,
    batches,
    codec,
    device_classes,
    leases,
    liveness,
    measurements,
    model_runs,
    tokens,
)
from services.db import exceptions as db_exc
from services.db.models import Agent, Batch, BatchCandidate, DeviceClass, Lease
from services.db.revocations import RevocationListener
from services.db.session import Session, SessionFactory, transaction
from services.lease import files, results
from services.lease.auth import AgentInfo, Auth, agent_info, new_agent_secret
from services.lease.settings import LeaseServiceSettings
from services.lease.sweeper import given_up_reason
from services.lease.work_board import WorkBoard
from services.protocol import wire
from services.protocol.errors import (
    UNKNOWN_AGENT_PREFIX,
    BadRequest,
    LeaseLost,
    NameTaken,
    NotFound,
    UnknownAgent,
    status_of,
)
from services.protocol.generated import measurer_pb2 as pb
from services.protocol.generated import measurer_pb2_grpc as pb_grpc
from tunefarm.export import arch_name, target_arch
from tunefarm.gpu import gpu_compatible, is_gpu

log = logging.getLogger("tunefarm.lease_service")

T = TypeVar("T")

STATUS_OF_DB_ERROR: tuple[tuple[type[db_exc.DatabaseError], grpc.StatusCode], ...] = (
    (db_exc.TokenRevoked, grpc.StatusCode.UNAUTHENTICATED),
    (db_exc.LeaseNotHeld, grpc.StatusCode.FAILED_PRECONDITION),
    (db_exc.InvalidTransition, grpc.StatusCode.FAILED_PRECONDITION),
    (db_exc.RowNotFound, grpc.StatusCode.NOT_FOUND),
    (db_exc.Conflict, grpc.StatusCode.ALREADY_EXISTS),
    (db_exc.Contention, grpc.StatusCode.ABORTED),
    (db_exc.Unavailable, grpc.StatusCode.UNAVAILABLE),
    (db_exc.SchemaOutOfDate, grpc.StatusCode.UNAVAILABLE),
    (db_exc.DatabaseError, grpc.StatusCode.INTERNAL),
)
"""The status code of each database error (first match wins); the agent maps them back
with `services.protocol.errors.from_rpc_error`."""

CONTENTION_RETRIES = 3
"""Times a transaction that hit a deadlock or serialization failure is run again."""

RPC_THREADS_KEPT_FREE = 16
"""RPC threads a long poll (LeaseBatch waiting for a batch) never takes: with as many
agents waiting as there are threads, heartbeats would queue behind them until their
leases expired. A LeaseBatch that finds no free place answers at once, empty."""

MAX_SKIPPED_PER_LEASE = 8
"""Batches one LeaseBatch may give up or close (nothing left) before it answers."""


def _status(error: BaseException) -> grpc.StatusCode:
    if isinstance(error, db_exc.DatabaseError):
        for cls, code in STATUS_OF_DB_ERROR:
            if isinstance(error, cls):
                return code
    return status_of(error)



def _unary(method: Callable[..., T]) -> Callable[..., T]:
    """Authenticate, run, and turn any exception into a status code."""

    @functools.wraps(method)
    def wrapper(self: AgentServicer, request: Any, context: grpc.ServicerContext) -> T:
        try:
            return method(self, request, context, self.auth.token_id(context))
        except Exception as exc:
            self._abort(context, exc, method.__name__)
            raise  # not reached: abort raises

    return wrapper


def _streaming(method: Callable[..., Iterator[T]]) -> Callable[..., Iterator[T]]:
    @functools.wraps(method)
    def wrapper(self: AgentServicer, request: Any, context: grpc.ServicerContext) -> Iterator[T]:
        try:
            yield from method(self, request, context, self.auth.token_id(context))
        except Exception as exc:
            self._abort(context, exc, method.__name__)

    return wrapper



class AgentServicer(pb_grpc.AgentServiceServicer):
    def __init__(
        self,
        settings: LeaseServiceSettings,
        sessions: SessionFactory,
        revocations: RevocationListener | None = None,
    ):
        self.settings = settings
        self.sessions = sessions
        self.auth = Auth(sessions, settings.token_cache_secs, revocations)
        self.artifact_root = Path(settings.artifact_root)
        self.work = WorkBoard(sessions, settings.lease_recheck_secs)
        # Long polls waiting at once: the other RPC threads stay free for heartbeats and results.
        self._waiting = threading.BoundedSemaphore(max(1, settings.grpc_max_workers - RPC_THREADS_KEPT_FREE))

    # -- plumbing -------------------------------------------------------------------------

    def _abort(self, context: grpc.ServicerContext, exc: Exception, rpc: str) -> None:
        if isinstance(exc, db_exc.TokenRevoked):  # before its notification, maybe: no later call passes
            self.auth.token_revoked(context)
        code = _status(exc)
        if code is grpc.StatusCode.INTERNAL:
            # Its text may hold anything (stored keys, paths, SQL): logged here, not sent.
            log.exception("%s failed", rpc)
            context.abort(code, f"{rpc} failed in the lease service (see its log)")
        log.info("%s: %s: %s", rpc, code.name, exc)
        context.abort(code, str(exc) or type(exc).__name__)

    def _tx(self, work: Callable[[Session], T]) -> T:
        """Run `work` in one transaction, again when it lost a deadlock."""
        for attempt in range(CONTENTION_RETRIES + 1):
            try:
                with transaction(self.sessions) as s:
                    return work(s)
            except db_exc.Contention:
                if attempt == CONTENTION_RETRIES:
                    raise
                time.sleep(0.01 * (attempt + 1))
        raise AssertionError("unreachable")

    # -- registration and liveness --------------------------------------------------------

    @_unary
    def Register(self, request: pb.RegisterRequest, context: Any, token_id: int) -> pb.RegisterResponse:
        name, class_name = request.name.strip(), request.device_class.strip()
        if not name or not class_name:
            raise BadRequest("Register needs a name and a device class")
        if not wire.valid_agent_name(name):
            raise BadRequest(f"agent name {name[:130]!r} refused: a name is {wire.AGENT_NAME_RULE}")
        caps = MessageToDict(request.capabilities, preserving_proto_field_name=True)
        detected = _json_dict(caps.get("target_json", ""))

        def work(s: Session) -> tuple[Agent, dict[str, Any]]:
            dc = self._class_to_join(s, class_name, name, detected)
            _check_compatible(class_name, dc.target, caps)
            try:
                agent = agents.register_agent(
                    s, name=name, device_class_id=dc.id, token_id=token_id, capabilities=caps,
                    secret_hash=tokens.hash_token(secret),
                )
            except db_exc.Conflict as exc:
                raise NameTaken(str(exc)) from None
            return agent, dict(dc.target)

        secret = new_agent_secret()
        agent, target = self._tx(work)
        self.auth.remember(agent_info(agent))
        log.info("agent %s (%d) registered for %s", name, agent.id, class_name)
        st = self.settings
        return pb.RegisterResponse(
            agent_id=agent.id,
            target_json=json.dumps(target, sort_keys=True),
            heartbeat_interval_secs=st.heartbeat_interval_secs,
            lease_secs=st.lease_secs,
            poll_interval_secs=st.lease_recheck_secs,
            agent_secret=secret,
        )

    def _class_to_join(self, s: Session, class_name: str, agent_name: str, detected: dict[str, Any]) -> DeviceClass:
        """The device class an agent registers for; created from the target the agent
        detected only when `auto_create_device_classes` lets agents create classes."""
        dc = device_classes.find_device_class(s, name=class_name)
        if dc is not None:
            return dc
        if not self.settings.auto_create_device_classes:
            known = ", ".join(device_classes.device_class_names(s)) or "none yet"
            raise NotFound(
                f"device class {class_name!r} does not exist (existing classes: {known}): an operator "
                f"creates it (tunefarm farm device-class {class_name})"
            )
        if not detected.get("kind"):
            raise BadRequest(f"device class {class_name!r} does not exist and the agent sent no target")
        if not wire.valid_agent_name(class_name):  # a class an agent names is shown as its name is
            raise BadRequest(f"device class name {class_name[:130]!r} refused: a name is {wire.AGENT_NAME_RULE}")
        return device_classes.ensure_device_class(
            s, name=class_name, target=detected, description=f"created by agent {agent_name}"
        )

    @_unary
    def Heartbeat(self, request: pb.HeartbeatRequest, context: Any, token_id: int) -> pb.HeartbeatResponse:
        agent = self.auth.agent(request.agent_id, token_id, context)
        try:
            held = self._tx(
                lambda s: leases.heartbeat(
                    s,
                    agent_id=agent.agent_id,
                    lease_secs=self.settings.lease_secs,
                    lease_ids=request.held_lease_ids,
                    model_run_ids=request.held_model_run_ids,
                )
            )
        except db_exc.RowNotFound:
            self.auth.forget(agent.agent_id)
            raise UnknownAgent(f"{UNKNOWN_AGENT_PREFIX} {agent.agent_id}: register again") from None
        return pb.HeartbeatResponse(active_lease_ids=held)

    @_unary
    def ReportHealth(self, request: pb.HealthReport, context: Any, token_id: int) -> pb.HealthResponse:
        agent = self.auth.agent(request.agent_id, token_id, context)
        health = MessageToDict(request, preserving_proto_field_name=True)
        health.pop("agent_id", None)
        health["reported_at"] = time.time()

        def work(s: Session) -> None:
            if not agents.record_health(s, agent_id=agent.agent_id, health=health):
                raise UnknownAgent(f"{UNKNOWN_AGENT_PREFIX} {agent.agent_id}: register again")

        self._tx(work)
        if request.status in (pb.HEALTH_STATUS_DEGRADED, pb.HEALTH_STATUS_FAILING):
            log.warning("agent %s: %s: %s", agent.name, pb.HealthStatus.Name(request.status), request.message)
        return pb.HealthResponse()

    @_unary
    def GoOffline(self, request: pb.GoOfflineRequest, context: Any, token_id: int) -> pb.GoOfflineResponse:
        """The agent stops (SIGTERM): what it holds is leased again now (`liveness.go_offline`)."""
        agent = self.auth.agent(request.agent_id, token_id, context)
        released = self._tx(lambda s: liveness.go_offline(s, agent_id=agent.agent_id))
        log.info("agent %s (%d) went offline%s", agent.name, agent.agent_id,
                 f"; batches {released} leased again" if released else "")  # fmt: skip
        return pb.GoOfflineResponse(released_batch_ids=released)

    # -- leasing --------------------------------------------------------------------------

    @_unary
    def LeaseBatch(self, request: pb.LeaseBatchRequest, context: Any, token_id: int) -> pb.LeaseBatchResponse:
        agent = self.auth.agent(request.agent_id, token_id, context)
        wait = self.settings.lease_wait_secs
        remaining = context.time_remaining()
        if remaining is not None:
            wait = min(wait, max(0.0, remaining - 1.0))
        deadline = time.monotonic() + wait
        self._reconcile(request, agent)
        withheld = self._withheld(agent)
        if withheld is not None:
            return pb.LeaseBatchResponse(withheld=withheld)
        leased = self._try_lease(request, agent)
        if leased is not None or wait <= 0:
            return leased or pb.LeaseBatchResponse()
        if not self._waiting.acquire(blocking=False):
            return pb.LeaseBatchResponse()  # every waiting place is taken: the agent asks again shortly
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return pb.LeaseBatchResponse()
                time.sleep(min(self.settings.lease_recheck_secs, left))
                if not context.is_active():  # the agent went away (a stopping one cancels): grant it nothing
                    return pb.LeaseBatchResponse()
                leased = self._try_lease(request, agent)
                if leased is not None:
                    return leased
        finally:
            self._waiting.release()

    def _withheld(self, agent: AgentInfo) -> str | None:
        """Why the agent is leased nothing (flagged, quarantined...), answered at once
        instead of a long poll that could never lease it anything; None: it may be."""
        try:
            reason = self._tx(lambda s: leases.lease_withheld(s, agent_id=agent.agent_id))
        except db_exc.RowNotFound:
            self.auth.forget(agent.agent_id)
            raise UnknownAgent(f"{UNKNOWN_AGENT_PREFIX} {agent.agent_id}: register again") from None
        if reason is not None:
            log.info("agent %s is leased nothing: %s", agent.name, reason)
        return reason

    def _reconcile(self, request: pb.LeaseBatchRequest, agent: AgentInfo) -> None:
        """End every active lease and leased model run of the agent that it does not say
        it holds: granted by an earlier LeaseBatch whose answer never reached it (a server
        killed, a connection cut), so its batch waits for no one."""
        released = self._tx(
            lambda s: agents.release_agent_leases(
                s,
                agent_id=agent.agent_id,
                keep_lease_ids=request.held_lease_ids,
                keep_model_run_ids=request.held_model_run_ids,
            )
        )
        if released:
            log.warning(
                "agent %s does not hold the leases of batches %s (their grants never reached it): leased again",
                agent.name,
                released,
            )

    def _try_lease(self, request: pb.LeaseBatchRequest, agent: AgentInfo) -> pb.LeaseBatchResponse | None:
        """A model run (when the agent takes them) or a batch, if its class has any."""
        if not self.work.has_work(agent.device_class_id):
            return None
        if request.model_runs:
            run = self._tx(lambda s: self._lease_model_run(s, agent))
            if run is not None:
                return pb.LeaseBatchResponse(model_run=run)
        batch = self._tx(lambda s: self._lease_one(s, agent))
        return pb.LeaseBatchResponse(batch=batch) if batch is not None else None

    def _lease_one(self, s: Session, agent: AgentInfo) -> pb.LeasedBatch | None:
        st = self.settings
        for _ in range(MAX_SKIPPED_PER_LEASE):
            try:
                lease = leases.lease_next_batch(s, agent_id=agent.agent_id, lease_secs=st.lease_secs)
            except db_exc.RowNotFound:
                self.auth.forget(agent.agent_id)
                raise UnknownAgent(f"{UNKNOWN_AGENT_PREFIX} {agent.agent_id}: register again") from None
            if lease is None:
                return None
            batch = lease.batch
            if batch.attempts > st.max_lease_attempts:
                n = measurements.abandon_batch(s, batch_id=batch.id, reason=given_up_reason(batch.attempts - 1))
                log.warning("batch %d given up after %d leases (%d candidates)", batch.id, batch.attempts - 1, n)
                continue
            candidates = batches.unmeasured_candidates(s, batch_id=batch.id)
            if not candidates:  # measured already; only its finish was lost
                leases.finish_lease(s, lease_id=lease.id, agent_id=agent.agent_id)
                continue
            return self._leased(s, lease, batch, candidates)
        return None

    def _lease_model_run(self, s: Session, agent: AgentInfo) -> pb.LeasedModelRun | None:
        st = self.settings
        run = model_runs.lease_model_run(
            s, agent_id=agent.agent_id, lease_secs=st.lease_secs, max_attempts=st.max_lease_attempts
        )
        if run is None:
            return None
        log.info("model run %d (job %d) leased to agent %s", run.id, run.job_id, agent.name)
        def ref(kind: int, path: str, sha256: str, size: int, signature: str | None = None) -> pb.ArtifactRef:
            return pb.ArtifactRef(
                kind=kind, id=run.id, file_name=Path(path).name, sha256=sha256, size=size,
                signature=_signature(signature),
            )

        return pb.LeasedModelRun(
            model_run_id=run.id,
            library=ref(
                pb.ARTIFACT_KIND_MODEL_LIBRARY, run.library_path, run.library_sha256, run.library_size,
                run.library_signature,
            ),
            inputs=ref(pb.ARTIFACT_KIND_MODEL_INPUTS, run.inputs_path, run.inputs_sha256, run.inputs_size),
            repeat=run.repeat,
            warmup=run.warmup,
            timeout_secs=run.timeout_secs,
            onnx_model=(
                ref(pb.ARTIFACT_KIND_MODEL_ONNX, run.onnx_path, run.onnx_sha256 or "", run.onnx_size or 0,
                    run.onnx_signature)
                if run.onnx_path else None
            ),  # fmt: skip
            input_names=run.input_names or [],
        )

    def _leased(self, s: Session, lease: Lease, batch: Batch, candidates: list[BatchCandidate]) -> pb.LeasedBatch:
        wl = leases.leased_work(s, batch=batch)
        td = wl.task_data
        task_data = (
            pb.ArtifactRef(
                kind=pb.ARTIFACT_KIND_TASK_DATA,
                id=td.id,
                file_name=f"{td.sha256}.npz",
                sha256=td.sha256,
                size=td.size,
            )
            if td is not None
            else pb.ArtifactRef(kind=pb.ARTIFACT_KIND_TASK_DATA, id=0)
        )
        timing = codec.timing_from_json(batch.timing)
        return pb.LeasedBatch(
            lease_id=lease.id,
            batch_id=batch.id,
            attempt=batch.attempts,
            candidates=[
                pb.LeasedCandidate(
                    batch_candidate_id=c.id,
                    candidate_key=c.candidate_key,
                    kernel=pb.ArtifactRef(
                        kind=pb.ARTIFACT_KIND_KERNEL,
                        id=c.id,
                        file_name=Path(c.artifact_path).name if c.artifact_path else "",
                        size=self._artifact_size(c.artifact_path),
                        signature=_signature(c.artifact_signature),
                        signed_as=wl.signed_as or 0,  # a confirmation's kernel: the candidate it confirms
                    ),
                )
                for c in candidates
            ],
            task_data=task_data,
            n_inputs=wl.n_inputs,
            n_outputs=wl.n_outputs,
            verify=bool(td is not None and td.has_expected),
            timing=wire.timing_to_pb(timing),
            run_timeout_secs=batch.run_timeout_secs,
            workload_name=wl.workload_name,
        )

    def _artifact_size(self, rel: str | None) -> int:
        """A stored kernel's size, declared with its lease so that the agent takes no more
        (0: unknown; `Fetch` says why it cannot serve it)."""
        if not rel:
            return 0
        try:
            return artifacts.resolve(self.artifact_root, rel).stat().st_size
        except (artifacts.OutsideArtifactRoot, OSError):
            return 0

    # -- files ----------------------------------------------------------------------------

    @_streaming
    def Fetch(self, request: pb.FetchRequest, context: Any, token_id: int) -> Iterator[pb.FetchChunk]:
        agent = self.auth.agent(request.agent_id, token_id, context)
        paths = self._tx(lambda s: files.fetch_paths(s, request, agent, self.artifact_root))
        yield from files.fetch_chunks(paths, self.settings.fetch_chunk_bytes)

    # -- model runs -----------------------------------------------------------------------

    @_unary
    def ReportModelRun(self, request: pb.ModelRunResult, context: Any, token_id: int) -> pb.ModelRunAck:
        agent = self.auth.agent(request.agent_id, token_id, context)
        run_id = request.model_run_id
        lease_error = (db_exc.LeaseNotHeld, db_exc.RowNotFound)
        try:
            run = self._tx(lambda s: model_runs.held_model_run(s, model_run_id=run_id, agent_id=agent.agent_id))
        except lease_error as exc:
            raise LeaseLost(str(exc)) from None
        outputs: str | None = None
        if not request.error:
            if not request.outputs_npz:
                raise BadRequest(f"model run {run_id}: no outputs and no error")
            outputs = artifacts.model_run_outputs_path(run.inputs_path)
            artifacts.put(self.artifact_root, outputs, request.outputs_npz)
        result = {
            "latency_samples": list(request.latency_samples),
            "round_medians": list(request.round_medians),
            "threads": request.threads,
            "run_secs": request.run_secs,
            "agent": agent.name,
            "emulated": agent.emulated,
            "fingerprint": agent.fingerprint,
        }
        peers = peer_latencies(request) if run.onnx_path and not request.error else None
        try:
            self._tx(
                lambda s: model_runs.finish_model_run(
                    s, model_run_id=run_id, agent_id=agent.agent_id, outputs_path=outputs, result=result,
                    error=request.error, peer_latencies=peers,
                )
            )
        except lease_error as exc:
            raise LeaseLost(str(exc)) from None
        log.info("model run %d %s on agent %s", run_id, f"failed: {request.error}" if request.error else "done", agent.name)
        return pb.ModelRunAck()

    # -- results --------------------------------------------------------------------------

    @_streaming
    def ReportResults(
        self, request_iterator: Iterator[pb.ResultMessage], context: Any, token_id: int
    ) -> Iterator[pb.ResultAck]:
        inbox = results.Inbox(request_iterator)
        first = inbox.get(None)
        if not isinstance(first, pb.ResultMessage):
            return  # the agent closed the stream without a message
        agent = self.auth.agent(first.agent_id, token_id, context)
        ctx = self._tx(lambda s: results.stream_context(s, first.lease_id, agent))
        yield from results.acknowledged(
            inbox,
            first,
            ctx,
            agent,
            lambda items, fin: self._tx(lambda s: results.store(s, ctx, agent, items, fin)),
            context.is_active,
            flush_max=self.settings.results_flush_max,
            flush_secs=self.settings.results_flush_secs,
        )



def peer_latencies(request: pb.ModelRunResult) -> dict[str, Any]:
    """The peers an agent timed beside a model (`ModelRun.peer_latencies`): per peer its
    samples, round medians and threads, or why it was not timed; {} from an agent that
    timed none (one older than peer timing)."""
    out: dict[str, Any] = {}
    for p in request.peers:
        if p.error:
            out[p.peer] = {"error": p.error}
        else:
            out[p.peer] = {"latency_samples": list(p.latency_samples), "round_medians": list(p.round_medians),
                           "threads": p.threads}  # fmt: skip
    return out


def _signature(stored: str | None) -> bytes:
    """A row's signature (hex) as `ArtifactRef.signature` carries it; b"" when unsigned."""
    try:
        return bytes.fromhex(stored) if stored else b""
    except ValueError:
        log.error("a stored signature is not hex; the artifact goes out unsigned")
        return b""



def _check_compatible(class_name: str, target: dict[str, Any], caps: dict[str, Any]) -> None:
    """Refuse an agent whose machine cannot run its class's kernels at all (another
    architecture: an aarch64 class needs an aarch64 agent, and a class without an
    `mtriple`, built for the build workers' own architecture, taken to be this host's,
    needs an agent of that one). A different mcpu is only logged: a newer CPU runs an
    older one's code, and the agent itself refuses a class whose instruction-set
    extensions its CPU lacks (`capabilities.class_missing_extensions`: asking LLVM needs
    TVM, which this service does not import). A CUDA class needs an agent with a GPU of
    its compute capability's family (`gpu_compatible`)."""
    if is_gpu(target):
        problem = gpu_compatible(target, str(caps.get("gpu_compute_capability", "")))
        if problem:
            raise BadRequest(f"device class {class_name!r} builds for {target.get('arch')}; {problem}")
        return
    if target.get("kind") != "llvm":
        return
    arch = arch_name(str(caps.get("arch", "")))
    want = target_arch(target) or arch_name(platform.machine())
    if arch and want != arch:
        raise BadRequest(f"device class {class_name!r} builds for {want}; this agent is {arch}")
    mcpu, own = target.get("mcpu"), caps.get("llvm_cpu")
    if mcpu and own and mcpu != own:
        log.warning("device class %s targets mcpu %s; agent on %s registers for it", class_name, mcpu, own)


def _json_dict(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text) if text else {}
    except json.JSONDecodeError:
        raise BadRequest("capabilities.target_json is not JSON") from None
    if not isinstance(value, dict):
        raise BadRequest("capabilities.target_json is not a JSON object")
    return value
