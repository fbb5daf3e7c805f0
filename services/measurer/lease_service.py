"""The lease service: the gRPC server the device agents dial into (`AgentService`).

Map:

- `AgentServicer`: the RPCs of proto/tunefarm/v1/measurer.proto. Thin: each call
  authenticates (`_Auth`), does its database work in one transaction through
  `services.db.queries`, and maps exceptions to status codes (`_status`). All state is in
  PostgreSQL, so the service can restart (or run as several replicas) at any time: an
  agent's calls fail with UNAVAILABLE meanwhile and it retries.
- `LeaseBatch` is a long poll (`lease_wait_secs`); while it waits it tries to lease
  only when its class has something to lease (`_WorkBoard`: one query per
  `lease_recheck_secs` for every waiting agent together), so hundreds of idle agents
  do not keep the database's connections from heartbeats and results; and at most
  `grpc_max_workers - RPC_THREADS_KEPT_FREE` wait at once (more answer empty at once),
  so they do not keep the RPC threads from them either.
- `ReportResults` stores a stream's results in groups (`results_flush_secs`,
  `results_flush_max`): one transaction for the results that arrived together, and the
  lease's finish in the same transaction as the last group. Every stored result is
  acknowledged; the agent resends what was not acknowledged after a reconnect, and the
  unique batch candidate of a measurement makes a resent result a no-op. The results of
  an agent that registered as emulated (`Capabilities.emulated`) are stored as emulated
  records: their outputs were checked, their costs are the emulator's.
- Model runs: an agent that asks for them (`LeaseBatchRequest.model_runs`) gets its
  class's oldest ready `ModelRun` before any batch (it ends a job); `Fetch` serves its
  library and inputs, `ReportModelRun` stores its outputs under the artifact root and
  its latencies (flagged emulated as above) in the row, for the scheduler to check.
- `Sweeper`: a thread that expires leases whose heartbeats stopped (their batches go
  back to the queue), marks silent agents offline, and gives up batches leased
  `max_lease_attempts` times without being finished (`queries.abandon_batch`: their
  unmeasured candidates become run_crash results, so the scheduler still gets exactly
  one result per candidate).
- `make_server(settings)` builds the server (not started); `serve()` runs it until
  SIGTERM/SIGINT; `main(argv)` is the command line entry.

Authentication: `authorization: Bearer <agent token>` on every call. A missing or
unknown token is UNAUTHENTICATED; a team token is PERMISSION_DENIED. `Register` answers
with a secret of its own (`RegisterResponse.agent_secret`; the agent row keeps its hash),
and every later call naming the agent must carry it (`x-tunefarm-agent-secret`) with the
agent's token: agents that share a token cannot act as each other. A call naming an
agent without both is PERMISSION_DENIED, saying nothing of the agent. The same name
registered again (a restarted agent) gets a new secret; the old one is refused from then
on (by another replica of the service within `token_cache_secs`).

Device classes are the operators' (`tunefarm farm device-class`): an agent naming a
class that does not exist is refused (NOT_FOUND) unless `auto_create_device_classes` is
set, which lets any agent token create a class every team sees.

Kernels and model libraries are handed out with the signature their builder made
(`ArtifactRef.signature`, services/protocol/signing.py); agents check it before loading.
An error's message names only what the caller sent (never, e.g., the key a candidate
should have had), and an unexpected error is INTERNAL with no detail (it is logged here).

Results are stored only from the agent holding the lease, and only for what it was
handed; everything else is refused and nothing of the refused stream's pending results
is stored:

| a results stream that ... | status |
|---|---|
| names a lease that is not the sender's active one (expired, re-leased to another agent, finished, another agent's, or none at all) | FAILED_PRECONDITION |
| carries a candidate not in the lease's batch (unknown, or another batch's), a result under another candidate's key, or the same candidate twice | INVALID_ARGUMENT |
| carries a candidate measured before this lease (by an earlier lease of the batch, or given up) | ALREADY_EXISTS |

A result sent again on a new stream of the same lease (the agent reconnected before the
acknowledgement) is acknowledged and stored once.
"""

from __future__ import annotations

import argparse
import functools
import hmac
import json
import logging
import math
import platform
import queue
import secrets
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import grpc
from google.protobuf.json_format import MessageToDict
from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session, sessionmaker

from services.common import artifacts
from services.db import codec, queries
from services.db import exceptions as db_exc
from services.db.models import (
    Agent,
    Batch,
    BatchCandidate,
    BatchState,
    DeviceClass,
    Lease,
    LeaseState,
    Measurement,
    TaskData,
    TokenKind,
    Workload,
)
from services.db.revocations import RevocationListener, VerifiedTokens
from services.db.session import make_session_factory, transaction
from services.measurer.settings import LeaseServiceSettings
from services.protocol import wire
from services.protocol.errors import (
    UNKNOWN_AGENT_PREFIX,
    AlreadyMeasured,
    BadRequest,
    LeaseLost,
    NameTaken,
    NotFound,
    PermissionDenied,
    Unauthenticated,
    UnknownAgent,
    status_of,
)
from services.protocol.generated import measurer_pb2 as pb
from services.protocol.generated import measurer_pb2_grpc as pb_grpc
from tunefarm.export import arch_name, target_arch
from tunefarm.gpu import gpu_compatible, is_gpu
from tunefarm.records import BuildResult, MeasureInput, MeasureRecord, MeasureResult, RunResult

log = logging.getLogger("tunefarm.lease_service")

T = TypeVar("T")

STATUS_OF_DB_ERROR: tuple[tuple[type[db_exc.DatabaseError], grpc.StatusCode], ...] = (
    (db_exc.TokenRevoked, grpc.StatusCode.UNAUTHENTICATED),
    (db_exc.LeaseNotHeld, grpc.StatusCode.FAILED_PRECONDITION),
    (db_exc.InvalidTransition, grpc.StatusCode.FAILED_PRECONDITION),
    (db_exc.NotFound, grpc.StatusCode.NOT_FOUND),
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

SERVER_OPTIONS = (
    # Agents keep idle connections open; let them ping (they detect a dead server so).
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
)

FINGERPRINT_KEYS = (
    "hostname",
    "arch",
    "cpu_model",
    "physical_cores",
    "llvm_cpu",
    "isa_features",
    "gpu_name",
    "gpu_compute_capability",
    "tvm_version",
    "agent_version",
    "emulated",
)
"""Capabilities of the measuring agent copied into each measurement's fingerprint."""


def _status(error: BaseException) -> grpc.StatusCode:
    if isinstance(error, db_exc.DatabaseError):
        for cls, code in STATUS_OF_DB_ERROR:
            if isinstance(error, cls):
                return code
    return status_of(error)


# -- authentication -----------------------------------------------------------------------


@dataclass(frozen=True)
class _AgentInfo:
    agent_id: int
    token_id: int | None
    device_class_id: int
    name: str
    fingerprint: dict[str, Any]
    secret_hash: str | None = None  # of the secret its latest registration was given
    emulated: bool = False  # registered as running under an emulator: its costs are not the device's


class _Auth:
    """Verifies bearer tokens and agent ownership, with a short-lived cache so that the
    hot calls (heartbeats, leases, results) do not ask the database every time."""

    def __init__(self, sessions: sessionmaker[Session], ttl: float, revocations: RevocationListener | None = None):
        self.sessions = sessions
        self.ttl = ttl
        self._lock = threading.Lock()
        self._tokens = VerifiedTokens[int](ttl, revocations)  # token hash -> token id
        self._agents: dict[int, tuple[_AgentInfo, float]] = {}

    def token_id(self, context: grpc.ServicerContext) -> int:
        plain = wire.bearer_token(context.invocation_metadata() or ())
        if plain is None:
            raise Unauthenticated("no bearer token (metadata 'authorization: Bearer <agent token>')")
        key = queries.hash_token(plain)
        hit = self._tokens.get(key)
        if hit is not None:
            return hit
        with transaction(self.sessions) as s:
            token = queries.verify_token(s, plain=plain, kind=TokenKind.AGENT)
            if token is None:
                if queries.verify_token(s, plain=plain, kind=TokenKind.TEAM) is not None:
                    raise PermissionDenied("a team token cannot act as a device agent; use an agent token")
                raise Unauthenticated("unknown or revoked token")
            token_id = token.id
        self._tokens.put(key, token_id)
        return token_id

    def agent(self, agent_id: int, token_id: int, context: grpc.ServicerContext) -> _AgentInfo:
        """The agent a call names, if the call is that agent's: its token, and the
        secret of its latest registration. Raises `UnknownAgent`, or `PermissionDenied`
        that says nothing of the agent."""
        secret = wire.agent_secret(context.invocation_metadata() or ())
        now = time.monotonic()
        with self._lock:
            hit = self._agents.get(agent_id)
        info = hit[0] if hit is not None and hit[1] > now else None
        if info is not None and _is_agents(info, token_id, secret):
            return info
        # Not cached, or refused by what is: a registration elsewhere (another replica)
        # may have changed the secret since; the database decides.
        with transaction(self.sessions) as s:
            row = s.get(Agent, agent_id)
            if row is None:
                raise UnknownAgent(f"{UNKNOWN_AGENT_PREFIX} {agent_id}: register again")
            info = _agent_info(row)
        self.remember(info)
        if not _is_agents(info, token_id, secret):
            raise PermissionDenied(
                f"this call may not act as agent {agent_id}: it needs the agent's token and the secret "
                f"its latest registration returned (metadata {wire.AGENT_SECRET_HEADER})"
            )
        return info

    def remember(self, info: _AgentInfo) -> None:
        with self._lock:
            self._agents[info.agent_id] = (info, time.monotonic() + self.ttl)

    def forget(self, agent_id: int) -> None:
        with self._lock:
            self._agents.pop(agent_id, None)


def _agent_info(row: Agent) -> _AgentInfo:
    caps = dict(row.capabilities or {})
    return _AgentInfo(
        agent_id=row.id,
        token_id=row.token_id,
        device_class_id=row.device_class_id,
        name=row.name,
        fingerprint={"agent": row.name, **{k: caps[k] for k in FINGERPRINT_KEYS if k in caps}},
        secret_hash=row.secret_hash,
        emulated=bool(caps.get("emulated", False)),
    )


def _is_agents(info: _AgentInfo, token_id: int, secret: str | None) -> bool:
    """Whether a call with this token and secret is the agent's own."""
    if info.token_id != token_id or info.secret_hash is None or not secret:
        return False
    return hmac.compare_digest(queries.hash_token(secret), info.secret_hash)


def new_agent_secret() -> str:
    """A registration's secret: 256 random bits (its unsalted sha256 is what is stored)."""
    return wire.AGENT_SECRET_PREFIX + secrets.token_urlsafe(queries.TOKEN_BYTES)


# -- the servicer -------------------------------------------------------------------------


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


class _WorkBoard:
    """Which device classes have something to lease (`queries.classes_with_work`), read
    at most once per `interval` for every waiting LeaseBatch together: a long poll asks
    the database to lease only when its class may have work, so many idle agents cost
    one query per interval, not one each (which starved heartbeats of connections)."""

    def __init__(self, sessions: sessionmaker[Session], interval: float):
        self.sessions = sessions
        self.interval = interval
        self._lock = threading.Lock()
        self._classes: set[int] = set()
        self._read_at = -math.inf

    def has_work(self, device_class_id: int) -> bool:
        with self._lock:  # one reader; the other waiting calls take its answer
            if time.monotonic() - self._read_at >= self.interval:
                with transaction(self.sessions) as s:
                    self._classes = queries.classes_with_work(s)
                self._read_at = time.monotonic()
            return device_class_id in self._classes


class AgentServicer(pb_grpc.AgentServiceServicer):
    def __init__(
        self,
        settings: LeaseServiceSettings,
        sessions: sessionmaker[Session],
        revocations: RevocationListener | None = None,
    ):
        self.settings = settings
        self.sessions = sessions
        self.auth = _Auth(sessions, settings.token_cache_secs, revocations)
        self.artifact_root = Path(settings.artifact_root)
        self.work = _WorkBoard(sessions, settings.lease_recheck_secs)
        # Long polls waiting at once: the other RPC threads stay free for heartbeats and results.
        self._waiting = threading.BoundedSemaphore(max(1, settings.grpc_max_workers - RPC_THREADS_KEPT_FREE))

    # -- plumbing -------------------------------------------------------------------------

    def _abort(self, context: grpc.ServicerContext, exc: Exception, rpc: str) -> None:
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
        caps = MessageToDict(request.capabilities, preserving_proto_field_name=True)
        detected = _json_dict(caps.get("target_json", ""))

        def work(s: Session) -> tuple[Agent, dict[str, Any]]:
            dc = s.scalars(select(DeviceClass).where(DeviceClass.name == class_name)).one_or_none()
            if dc is None:
                if not self.settings.auto_create_device_classes:
                    raise NotFound(
                        f"device class {class_name!r} does not exist: an operator creates it "
                        f"(tunefarm farm device-class {class_name})"
                    )
                if not detected.get("kind"):
                    raise BadRequest(f"device class {class_name!r} does not exist and the agent sent no target")
                s.execute(
                    pg_insert(DeviceClass)
                    .values(name=class_name, target=detected, description=f"created by agent {name}")
                    .on_conflict_do_nothing(index_elements=[DeviceClass.name])
                )
                dc = s.scalars(select(DeviceClass).where(DeviceClass.name == class_name)).one()
            _check_compatible(class_name, dc.target, caps)
            try:
                agent = queries.register_agent(
                    s, name=name, device_class_id=dc.id, token_id=token_id, capabilities=caps,
                    secret_hash=queries.hash_token(secret),
                )
            except db_exc.Conflict as exc:
                raise NameTaken(str(exc)) from None
            return agent, dict(dc.target)

        secret = new_agent_secret()
        agent, target = self._tx(work)
        self.auth.remember(_agent_info(agent))
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

    @_unary
    def Heartbeat(self, request: pb.HeartbeatRequest, context: Any, token_id: int) -> pb.HeartbeatResponse:
        agent = self.auth.agent(request.agent_id, token_id, context)
        try:
            held = self._tx(
                lambda s: queries.heartbeat(
                    s,
                    agent_id=agent.agent_id,
                    lease_secs=self.settings.lease_secs,
                    lease_ids=request.held_lease_ids,
                    model_run_ids=request.held_model_run_ids,
                )
            )
        except db_exc.NotFound:
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
            row = s.get(Agent, agent.agent_id, with_for_update=True)
            if row is None:
                raise UnknownAgent(f"{UNKNOWN_AGENT_PREFIX} {agent.agent_id}: register again")
            # Kept with the capabilities (no column of its own yet): operators read it there.
            row.capabilities = {**(row.capabilities or {}), "health": health}

        self._tx(work)
        if request.status in (pb.HEALTH_STATUS_DEGRADED, pb.HEALTH_STATUS_FAILING):
            log.warning("agent %s: %s: %s", agent.name, pb.HealthStatus.Name(request.status), request.message)
        return pb.HealthResponse()

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
        leased = self._try_lease(request, agent)
        if leased is not None or wait <= 0:
            return leased or pb.LeaseBatchResponse()
        if not self._waiting.acquire(blocking=False):
            return pb.LeaseBatchResponse()  # every waiting place is taken: the agent asks again shortly
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not context.is_active():
                    return pb.LeaseBatchResponse()
                time.sleep(min(self.settings.lease_recheck_secs, left))
                leased = self._try_lease(request, agent)
                if leased is not None:
                    return leased
        finally:
            self._waiting.release()

    def _reconcile(self, request: pb.LeaseBatchRequest, agent: _AgentInfo) -> None:
        """End every active lease and leased model run of the agent that it does not say
        it holds: granted by an earlier LeaseBatch whose answer never reached it (a server
        killed, a connection cut), so its batch waits for no one."""
        released = self._tx(
            lambda s: queries.release_agent_leases(
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

    def _try_lease(self, request: pb.LeaseBatchRequest, agent: _AgentInfo) -> pb.LeaseBatchResponse | None:
        """A model run (when the agent takes them) or a batch, if its class has any."""
        if not self.work.has_work(agent.device_class_id):
            return None
        if request.model_runs:
            run = self._tx(lambda s: self._lease_model_run(s, agent))
            if run is not None:
                return pb.LeaseBatchResponse(model_run=run)
        batch = self._tx(lambda s: self._lease_one(s, agent))
        return pb.LeaseBatchResponse(batch=batch) if batch is not None else None

    def _lease_one(self, s: Session, agent: _AgentInfo) -> pb.LeasedBatch | None:
        st = self.settings
        for _ in range(MAX_SKIPPED_PER_LEASE):
            try:
                lease = queries.lease_next_batch(s, agent_id=agent.agent_id, lease_secs=st.lease_secs)
            except db_exc.NotFound:
                self.auth.forget(agent.agent_id)
                raise UnknownAgent(f"{UNKNOWN_AGENT_PREFIX} {agent.agent_id}: register again") from None
            if lease is None:
                return None
            batch = lease.batch
            if batch.attempts > st.max_lease_attempts:
                n = queries.abandon_batch(s, batch_id=batch.id, reason=given_up_reason(batch.attempts - 1))
                log.warning("batch %d given up after %d leases (%d candidates)", batch.id, batch.attempts - 1, n)
                continue
            candidates = queries.unmeasured_candidates(s, batch_id=batch.id)
            if not candidates:  # measured already; only its finish was lost
                queries.finish_lease(s, lease_id=lease.id, agent_id=agent.agent_id)
                continue
            return self._leased(s, lease, batch, candidates)
        return None

    def _lease_model_run(self, s: Session, agent: _AgentInfo) -> pb.LeasedModelRun | None:
        st = self.settings
        run = queries.lease_model_run(
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
        )

    def _leased(self, s: Session, lease: Lease, batch: Batch, candidates: list[BatchCandidate]) -> pb.LeasedBatch:
        wl = s.execute(
            select(Workload.name, Workload.n_inputs, Workload.n_outputs).where(Workload.id == batch.workload_id)
        ).one()
        td = s.scalars(select(TaskData).where(TaskData.workload_id == batch.workload_id)).one_or_none()
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
        # A confirmation's kernel was built and signed as the candidate it confirms.
        signed_as = (
            s.scalar(select(Measurement.batch_candidate_id).where(Measurement.id == batch.confirms_measurement_id))
            if batch.confirms_measurement_id is not None
            else None
        )
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
                        signature=_signature(c.artifact_signature),
                        signed_as=signed_as or 0,
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
            workload_name=wl.name,
        )

    # -- files ----------------------------------------------------------------------------

    @_streaming
    def Fetch(self, request: pb.FetchRequest, context: Any, token_id: int) -> Iterator[pb.FetchChunk]:
        agent = self.auth.agent(request.agent_id, token_id, context)
        paths = self._tx(lambda s: self._fetch_paths(s, request, agent))
        limit = self.settings.fetch_chunk_bytes
        parts: list[pb.FilePart] = []
        size = 0
        for part in _file_parts(paths, limit):
            parts.append(part)
            size += len(part.data)
            if size >= limit:
                yield pb.FetchChunk(parts=parts)
                parts, size = [], 0
        if parts:
            yield pb.FetchChunk(parts=parts)

    def _fetch_paths(self, s: Session, request: pb.FetchRequest, agent: _AgentInfo) -> list[Path | str]:
        if request.model_run_id:
            return self._model_run_paths(s, request, agent)
        lease = _held(s, request.lease_id, agent.agent_id)
        batch = s.get(Batch, lease.batch_id)
        assert batch is not None
        kernel_ids = [r.id for r in request.refs if r.kind == pb.ARTIFACT_KIND_KERNEL]
        kernels = dict(
            s.execute(
                select(BatchCandidate.id, BatchCandidate.artifact_path).where(
                    BatchCandidate.batch_id == batch.id, BatchCandidate.id.in_(kernel_ids)
                )
            ).all()
        )
        td = s.scalars(select(TaskData).where(TaskData.workload_id == batch.workload_id)).one_or_none()
        out: list[Path | str] = []
        for ref in request.refs:
            rel: str | None
            if ref.kind == pb.ARTIFACT_KIND_KERNEL:
                if ref.id not in kernels:
                    raise BadRequest(f"candidate {ref.id} is not in the leased batch {batch.id}")
                rel = kernels[ref.id]
            elif ref.kind == pb.ARTIFACT_KIND_TASK_DATA:
                if td is None or ref.id != td.id:
                    out.append("the batch's workload has no task data")
                    continue
                rel = td.path
            else:
                raise BadRequest(f"unknown artifact kind {ref.kind}")
            out.append(self._stored(rel) if rel else "no built kernel")
        return out

    def _model_run_paths(self, s: Session, request: pb.FetchRequest, agent: _AgentInfo) -> list[Path | str]:
        try:
            run = queries.held_model_run(s, model_run_id=request.model_run_id, agent_id=agent.agent_id)
        except (db_exc.LeaseNotHeld, db_exc.NotFound) as exc:
            raise LeaseLost(str(exc)) from None
        files = {pb.ARTIFACT_KIND_MODEL_LIBRARY: run.library_path, pb.ARTIFACT_KIND_MODEL_INPUTS: run.inputs_path}
        out: list[Path | str] = []
        for ref in request.refs:
            if ref.kind not in files or ref.id != run.id:
                raise BadRequest(f"model run {run.id} has no file of kind {ref.kind} and id {ref.id}")
            out.append(self._stored(files[ref.kind]))
        return out

    def _stored(self, rel: str) -> Path | str:
        """The file a row's relative path names, or why it cannot be served."""
        try:
            path = artifacts.resolve(self.artifact_root, rel)
        except artifacts.OutsideArtifactRoot as exc:
            return str(exc)
        return path if path.is_file() else f"{rel} is missing from the artifact store"

    # -- model runs -----------------------------------------------------------------------

    @_unary
    def ReportModelRun(self, request: pb.ModelRunResult, context: Any, token_id: int) -> pb.ModelRunAck:
        agent = self.auth.agent(request.agent_id, token_id, context)
        run_id = request.model_run_id
        lease_error = (db_exc.LeaseNotHeld, db_exc.NotFound)
        try:
            run = self._tx(lambda s: queries.held_model_run(s, model_run_id=run_id, agent_id=agent.agent_id))
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
            "run_secs": request.run_secs,
            "agent": agent.name,
            "emulated": agent.emulated,
            "fingerprint": agent.fingerprint,
        }
        try:
            self._tx(
                lambda s: queries.finish_model_run(
                    s, model_run_id=run_id, agent_id=agent.agent_id, outputs_path=outputs, result=result,
                    error=request.error,
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
        inbox = _Inbox(request_iterator)
        first = inbox.get(None)
        if not isinstance(first, pb.ResultMessage):
            return  # the agent closed the stream without a message
        agent = self.auth.agent(first.agent_id, token_id, context)
        lease_id = first.lease_id
        ctx = self._tx(lambda s: self._stream_context(s, lease_id, agent))
        st = self.settings
        pending: dict[int, RunResult] = {}
        opened = 0.0
        finish = False
        msg: object = first
        while True:
            if isinstance(msg, pb.ResultMessage):
                if msg.lease_id != lease_id or msg.agent_id != agent.agent_id:
                    raise BadRequest("one results stream carries one lease")
                body = msg.WhichOneof("body")
                if body == "result":
                    bc_id = msg.result.batch_candidate_id
                    run = ctx.admit(bc_id, wire.run_result_from_pb(msg.result))
                    if not pending:
                        opened = time.monotonic()
                    # An emulated agent's costs are the emulator's: its results say so.
                    pending[bc_id] = replace(run, emulated=agent.emulated)
                elif body == "finish":
                    finish = True
            elif isinstance(msg, BaseException):  # the agent went away: keep what it sent
                log.info("results stream of lease %d broke: %s", lease_id, msg)
            end = finish or msg is _END or isinstance(msg, BaseException)
            due = pending and (len(pending) >= st.results_flush_max or time.monotonic() - opened >= st.results_flush_secs)
            if end or due:
                if pending or finish:
                    items = list(pending.items())
                    pending.clear()
                    state = self._tx(lambda s, items=items, fin=finish: self._store(s, ctx, agent, items, fin))
                    if context.is_active():
                        yield pb.ResultAck(
                            batch_candidate_ids=[i for i, _ in items],
                            finished=finish,
                            batch_state=str(state) if state is not None else "",
                        )
                if end:
                    return
            timeout = None if not pending else max(0.0, opened + st.results_flush_secs - time.monotonic())
            msg = inbox.get(timeout)

    def _stream_context(self, s: Session, lease_id: int, agent: _AgentInfo) -> _StreamContext:
        lease = _held(s, lease_id, agent.agent_id)
        name, target = s.execute(
            select(Workload.name, DeviceClass.target)
            .join(Batch, Batch.workload_id == Workload.id)
            .join(DeviceClass, DeviceClass.id == Batch.device_class_id)
            .where(Batch.id == lease.batch_id)
        ).one()
        rows = s.execute(
            select(
                BatchCandidate.id,
                BatchCandidate.input,
                BatchCandidate.build,
                Measurement.id.label("measurement_id"),
                Measurement.lease_id,
            )
            .outerjoin(Measurement, Measurement.batch_candidate_id == BatchCandidate.id)
            .where(BatchCandidate.batch_id == lease.batch_id)
        ).all()
        return _StreamContext(
            lease_id=lease.id,
            batch_id=lease.batch_id,
            workload_name=name,
            target=dict(target),
            inputs={r.id: codec.input_from_json(r.input) for r in rows},
            builds={r.id: r.build for r in rows},
            measured_elsewhere={
                r.id: r.lease_id for r in rows if r.measurement_id is not None and r.lease_id != lease.id
            },
        )

    def _store(
        self,
        s: Session,
        ctx: _StreamContext,
        agent: _AgentInfo,
        items: list[tuple[int, RunResult]],
        finish: bool,
    ) -> BatchState | None:
        if finish:  # lock order: the batch before its lease (finish_lease locks both)
            s.execute(select(Batch.id).where(Batch.id == ctx.batch_id).with_for_update())
        stamp = time.time()
        records = [(bc_id, ctx.record(bc_id, run, stamp)) for bc_id, run in items]
        queries.record_measurements(
            s, lease_id=ctx.lease_id, agent_id=agent.agent_id, items=records, fingerprint=agent.fingerprint
        )
        if finish:
            return queries.finish_lease(s, lease_id=ctx.lease_id, agent_id=agent.agent_id)
        return None


@dataclass
class _StreamContext:
    """What a results stream needs to turn run results into records, loaded once."""

    lease_id: int
    batch_id: int
    workload_name: str
    target: dict[str, Any]
    inputs: dict[int, MeasureInput]
    builds: dict[int, dict[str, Any] | None]
    # Candidates of the batch measured before this lease (by an earlier lease, or given
    # up): this lease was not handed them, so no result of its may be stored for them.
    measured_elsewhere: dict[int, int | None] = field(default_factory=dict)
    _seen: set[int] = field(default_factory=set)
    _build_cache: dict[int, BuildResult] = field(default_factory=dict)

    def admit(self, bc_id: int, run: RunResult) -> RunResult:
        """`run` if this stream may carry it: a candidate of the lease's batch, not
        measured under another lease, of the candidate's own key, and sent once per stream
        (a stream reopened after a break sends unacknowledged results again: that is a new
        stream, and storing them again is a no-op). Raises `BadRequest` or `AlreadyMeasured`."""
        inp = self.inputs.get(bc_id)
        if inp is None:
            raise BadRequest(f"candidate {bc_id} is not in batch {self.batch_id} of lease {self.lease_id}")
        if bc_id in self.measured_elsewhere:
            by = self.measured_elsewhere[bc_id]
            raise AlreadyMeasured(
                f"candidate {bc_id} was measured before lease {self.lease_id}"
                + (f" (under lease {by})" if by is not None else " (given up)")
                + "; its result is not this lease's to report"
            )
        if bc_id in self._seen:
            raise BadRequest(f"candidate {bc_id} sent twice on one results stream")
        if run.candidate_key != inp.key:  # the message names only what the sender sent
            raise BadRequest(f"result of {run.candidate_key!r} sent for candidate {bc_id}, whose key is another")
        self._seen.add(bc_id)
        return run

    def record(self, bc_id: int, run: RunResult, stamp: float) -> MeasureRecord:
        inp = self.inputs[bc_id]
        build = self._build_cache.get(bc_id)
        if build is None:
            raw = self.builds.get(bc_id)
            build = codec.build_from_json(raw) if raw else BuildResult(inp.key, None, 0.0)
            self._build_cache[bc_id] = build
        return MeasureRecord.of(
            MeasureResult(inp, build, run), workload=self.workload_name, target=self.target, timestamp=stamp
        )


_END = object()
"""The agent closed its side of a results stream."""


class _Inbox:
    """A stream's incoming messages, readable with a timeout: a thread drains the request
    iterator (which only blocks) into a queue; a broken stream arrives as its exception."""

    def __init__(self, requests: Iterator[pb.ResultMessage]):
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        threading.Thread(target=self._pump, args=(requests,), daemon=True, name="results-inbox").start()

    def _pump(self, requests: Iterator[pb.ResultMessage]) -> None:
        try:
            for msg in requests:
                self._queue.put(msg)
            self._queue.put(_END)
        except Exception as exc:  # cancelled, connection lost
            self._queue.put(exc)

    def get(self, timeout: float | None) -> object:
        """The next message, `_END`, an exception, or None when `timeout` passed first."""
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None


def _file_parts(paths: list[Path | str], limit: int) -> Iterator[pb.FilePart]:
    """The files (or why each cannot be served) as parts of at most `limit` bytes."""
    for index, found in enumerate(paths):
        if isinstance(found, str):
            yield pb.FilePart(index=index, last=True, error=found)
            continue
        try:
            for offset, data, sha in artifacts.read_chunks(found, limit):
                last = sha is not None
                yield pb.FilePart(
                    index=index,
                    offset=offset,
                    data=data,
                    last=last,
                    total_size=offset + len(data) if last else 0,
                    sha256=sha or "",
                )
        except OSError as exc:
            yield pb.FilePart(index=index, last=True, error=f"cannot read {found.name}: {exc.strerror}")


def _signature(stored: str | None) -> bytes:
    """A row's signature (hex) as `ArtifactRef.signature` carries it; b"" when unsigned."""
    try:
        return bytes.fromhex(stored) if stored else b""
    except ValueError:
        log.error("a stored signature is not hex; the artifact goes out unsigned")
        return b""


def _held(s: Session, lease_id: int, agent_id: int) -> Lease:
    lease = s.get(Lease, lease_id)
    if lease is None or lease.agent_id != agent_id:
        raise LeaseLost(f"lease {lease_id} is not held by agent {agent_id}")
    if lease.state is not LeaseState.ACTIVE:
        raise LeaseLost(f"lease {lease_id} is {lease.state}")
    return lease


def given_up_reason(leases: int) -> str:
    return (
        f"not measured: the batch was leased {leases} times and no agent finished it "
        "(its agents died or stopped heartbeating while measuring it)"
    )


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


# -- the sweeper ----------------------------------------------------------------------------


@dataclass(frozen=True)
class SweepReport:
    requeued: list[int]  # batches whose lease expired
    offline: list[int]  # agents marked offline
    given_up: list[int]  # batches abandoned after max_lease_attempts


class Sweeper:
    """Every `sweep_interval_secs`: expire leases whose heartbeats stopped, mark silent
    agents offline, give up batches that were leased too often. Safe to run in several
    replicas at once (expire_leases skips batches another transaction holds)."""

    def __init__(self, settings: LeaseServiceSettings, sessions: sessionmaker[Session]):
        self.settings = settings
        self.sessions = sessions
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, daemon=True, name="lease-sweeper")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.wait(self.settings.sweep_interval_secs):
            try:
                report = self.sweep()
            except db_exc.DatabaseError as exc:
                log.warning("sweep failed: %s", exc)
                continue
            if report.requeued or report.offline or report.given_up:
                log.info(
                    "sweep: %d leases expired, %d agents offline, %d batches given up",
                    len(report.requeued),
                    len(report.offline),
                    len(report.given_up),
                )

    def sweep(self) -> SweepReport:
        st = self.settings
        with transaction(self.sessions) as s:
            requeued = queries.expire_leases(s)
            offline = queries.mark_agents_offline(s, stale_secs=st.agent_stale_secs)
        given_up = []
        with transaction(self.sessions) as s:
            rows = s.execute(
                select(Batch.id, Batch.attempts)
                .where(Batch.state == BatchState.READY, Batch.attempts >= st.max_lease_attempts)
                .order_by(Batch.id)
                .limit(100)
            ).all()
            for batch_id, attempts in rows:
                queries.abandon_batch(s, batch_id=batch_id, reason=given_up_reason(attempts))
                given_up.append(batch_id)
        return SweepReport(requeued, offline, given_up)


# -- the server -----------------------------------------------------------------------------


@dataclass
class LeaseServer:
    """A built lease service: `start()`, `stop()`; `port` is the bound port."""

    server: grpc.Server
    port: int
    servicer: AgentServicer
    sweeper: Sweeper
    revocations: RevocationListener
    host: str = "127.0.0.1"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> None:
        self.revocations.start()
        self.server.start()
        self.sweeper.start()

    def stop(self, grace: float = 5.0) -> None:
        self.sweeper.stop()
        self.server.stop(grace).wait()
        self.revocations.stop()


def make_server(
    settings: LeaseServiceSettings | None = None, *, sessions: sessionmaker[Session] | None = None
) -> LeaseServer:
    """The lease service for `settings`, bound but not started."""
    settings = settings or LeaseServiceSettings()
    sessions = sessions or make_session_factory(settings)
    revocations = RevocationListener(sessions.kw["bind"])
    servicer = AgentServicer(settings, sessions, revocations)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=settings.grpc_max_workers, thread_name_prefix="lease-rpc"),
        options=(*SERVER_OPTIONS, ("grpc.max_receive_message_length", settings.max_message_bytes)),
    )
    pb_grpc.add_AgentServiceServicer_to_server(servicer, server)
    if settings.tls:
        port = server.add_secure_port(settings.lease_bind, server_credentials(settings))
    else:
        port = server.add_insecure_port(settings.lease_bind)
    if port == 0:
        raise OSError(f"cannot listen on {settings.lease_bind}")
    host = settings.lease_bind.rsplit(":", 1)[0].strip("[]")
    host = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
    return LeaseServer(server, port, servicer, Sweeper(settings, sessions), revocations, host=host)


def server_credentials(settings: LeaseServiceSettings) -> grpc.ServerCredentials:
    """TLS with the settings' certificate and key; with a client CA, mutual TLS (a client
    without a certificate that CA signed is refused in the handshake). Raises `OSError`
    for a file that cannot be read."""
    assert settings.tls_cert_file is not None and settings.tls_key_file is not None
    pair = (Path(settings.tls_key_file).read_bytes(), Path(settings.tls_cert_file).read_bytes())
    client_ca = Path(settings.tls_client_ca_file).read_bytes() if settings.tls_client_ca_file else None
    return grpc.ssl_server_credentials([pair], root_certificates=client_ca, require_client_auth=client_ca is not None)


def serve(settings: LeaseServiceSettings | None = None) -> None:
    """Run the lease service until SIGTERM or SIGINT (checks the schema first)."""
    from services.db.migrate import check_schema

    settings = settings or LeaseServiceSettings()
    check_schema(settings.database_url)
    lease_server = make_server(settings)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    lease_server.start()
    security = ("mutual TLS" if settings.tls_client_ca_file else "TLS") if settings.tls else "plaintext"
    log.info("lease service listening on %s, %s (artifacts in %s)", settings.lease_bind, security, settings.artifact_root)
    print(f"lease service listening on port {lease_server.port}", flush=True)
    stop.wait()
    lease_server.stop()


def main(argv: list[str] | None = None) -> int:
    """`tunefarm lease-service [--bind HOST:PORT] [--artifact-root DIR] [--tls-cert F
    --tls-key F [--tls-client-ca F]]`; the rest comes from the environment
    (LeaseServiceSettings). 2 with one line for settings that do not make sense."""
    parser = argparse.ArgumentParser(prog="tunefarm lease-service", description="the farm's agent service (gRPC)")
    parser.add_argument("--bind", help="host:port to listen on (TUNEFARM_LEASE_BIND)")
    parser.add_argument("--artifact-root", type=Path, help="shared artifact directory (TUNEFARM_ARTIFACT_ROOT)")
    parser.add_argument("--tls-cert", type=Path, help="serve TLS with this PEM certificate chain (TUNEFARM_TLS_CERT_FILE)")
    parser.add_argument("--tls-key", type=Path, help="the certificate's PEM private key (TUNEFARM_TLS_KEY_FILE)")
    parser.add_argument("--tls-client-ca", type=Path,
                        help="mutual TLS: agents must present a certificate this PEM CA signed (TUNEFARM_TLS_CLIENT_CA_FILE)")
    args = parser.parse_args(argv)
    flags = {
        "lease_bind": args.bind,
        "artifact_root": args.artifact_root,
        "tls_cert_file": args.tls_cert,
        "tls_key_file": args.tls_key,
        "tls_client_ca_file": args.tls_client_ca,
    }
    try:
        settings = LeaseServiceSettings(**{k: v for k, v in flags.items() if v is not None})
        if settings.tls:
            server_credentials(settings)  # unreadable files: one line now, not a traceback later
    except (ValidationError, OSError) as exc:
        print(f"tunefarm lease-service: error: {_settings_problem(exc)}", file=sys.stderr, flush=True)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    serve(settings)
    return 0


def _settings_problem(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ()))
        message = str(first.get("msg", exc)).removeprefix("Value error, ")
        return f"{where}: {message}" if where else message
    if isinstance(exc, OSError):
        return f"cannot read {exc.filename}: {exc.strerror}"
    return str(exc)


if __name__ == "__main__":
    raise SystemExit(main())

