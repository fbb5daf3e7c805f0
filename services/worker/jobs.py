"""The build worker's RQ job, `build_batch`, and `tunefarm worker`.

A job carries a batch id and nothing else; everything it needs is in PostgreSQL and what
it makes goes to the artifact root:

    build_batch(batch_id):
        take the batch's build lock (`services.db.build_locks`: held while this worker builds it, lost
        with the worker; a batch another worker holds is left to it)
        claim the batch (proposed -> building) and read its workload, its device class's
        target and its candidates                                     (one transaction)
        build every candidate in the worker's isolated build processes (LocalBuilder:
        TVM imported once per process, a crash or a hang costs one build, not the worker);
        a target for another architecture is cross-compiled (tunefarm.measure.builder:
        a .so through <mtriple>-g++ when installed, else a .tar the board links at load)
        store each kernel's path and build, record failed builds as measurements, and
        mark the batch ready (or done when nothing built)              (one transaction)
        with each kernel, its signature (`TUNEFARM_SIGNING_KEY_FILE`: the farm's key
        signs the kernel's sha256 for its batch candidate, services/protocol/signing.py;
        agents load nothing else)

Both transactions are run again while the database is away (a restart), for up to
`database_retry_secs`: a build is not lost to a moment without PostgreSQL.

`tunefarm worker` runs an RQ `SimpleWorker` on the build queues of the device classes.
It runs build jobs and nothing else: a job is JSON naming `build_batch` and a batch id,
anything else in its queues is refused unrun (`services.worker.build_job`).
SimpleWorker executes jobs in the worker process instead of forking a work horse per job:
the fork would cost ~3.6 ms per job here and, worse, lose the warm build processes
(each holding an imported TVM) with every job. The isolation a fork would give is
already there: the builds themselves run in separate processes with timeouts.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from services.common import artifacts
from services.db import batches, build_locks, codec, measurements
from services.db.exceptions import DatabaseError, Unavailable
from services.db.session import Engine, Session, SessionFactory, make_session_factory, retrying
from services.db.states import BatchState
from services.protocol.signing import ArtifactSigner, SignedKind
from services.worker.exceptions import BatchNotFound
from services.worker.settings import WorkerSettings
from tunefarm.measure.builder import Builder, LocalBuilder
from tunefarm.records import BuildInput, BuildResult, MeasureInput, MeasureRecord, MeasureResult
from tunefarm.target import physical_cores

log = logging.getLogger("tunefarm.worker")


@dataclass
class WorkerContext:
    """What a worker process keeps between jobs."""

    settings: WorkerSettings
    sessions: SessionFactory
    builder: Builder
    signer: ArtifactSigner | None = None  # signs each kernel (None: kernels go unsigned)

    @property
    def artifact_root(self) -> Path:
        return Path(self.settings.artifact_root)

    @property
    def engine(self) -> Engine:
        return self.sessions.kw["bind"]


_context: WorkerContext | None = None
_context_lock = threading.Lock()


def configure(
    settings: WorkerSettings | None = None,
    *,
    builder: Builder | None = None,
    sessions: SessionFactory | None = None,
) -> WorkerContext:
    """Set up this process for build jobs (the previous context's builder is closed).
    Without arguments: settings from the environment and a started `LocalBuilder`.
    Raises `KeyFileError` for a signing key that cannot be read."""
    global _context
    settings = settings or WorkerSettings()
    root = Path(settings.artifact_root)
    signer = ArtifactSigner.from_file(settings.signing_key_file) if settings.signing_key_file else None
    if signer is None:
        log.warning("no signing key (TUNEFARM_SIGNING_KEY_FILE): kernels are unsigned, agents that check refuse them")
    if builder is None:
        n = settings.build_processes or physical_cores()
        builder = LocalBuilder(root / artifacts.KERNELS_DIR, n_workers=n)
        builder.start()
    ctx = WorkerContext(settings, sessions or make_session_factory(settings), builder, signer)
    with _context_lock:
        old, _context = _context, ctx
    if old is not None and old.builder is not builder:
        old.builder.close()
    return ctx


def current() -> WorkerContext:
    """This process's context, configured from the environment on first use."""
    with _context_lock:
        ctx = _context
    return ctx if ctx is not None else configure()


def shutdown() -> None:
    """Close the builder of this process's context (tests, end of `main`)."""
    global _context
    with _context_lock:
        old, _context = _context, None
    if old is not None:
        old.builder.close()


# -- the job --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    batch_id: int
    workload_id: int
    workload_name: str
    module_json: str | None  # None when the workload file already exists
    target: dict[str, Any]
    build_timeout: float
    candidates: list[tuple[int, MeasureInput]]  # (batch candidate id, input)


def build_batch(batch_id: int) -> str:
    """Build every unmeasured candidate of a batch and queue it for the agents; returns
    the batch's state after ("ready", or "done" when no candidate built). A batch that
    is no longer proposed or building (a duplicate or retried job) is left as it is."""
    ctx = current()
    t0 = time.perf_counter()
    patience = ctx.settings.database_retry_secs

    def waiting(error: DatabaseError) -> None:
        log.warning("batch %d: the database is away (%s); trying again", batch_id, error)

    with ExitStack() as held:
        if not _lock(ctx, batch_id, held, patience, waiting):
            log.info("batch %d is being built by another worker", batch_id)
            return str(BatchState.BUILDING)
        plan = retrying(ctx.sessions, lambda s: _claim(ctx, s, batch_id), patience_secs=patience, on_retry=waiting)
        if isinstance(plan, BatchState):
            log.info("batch %d is %s: nothing to build", batch_id, plan)
            return str(plan)
        wl_path = _workload_file(ctx, plan)
        results = ctx.builder.build(
            [BuildInput(inp.key, str(wl_path), inp.trace, plan.target, plan.build_timeout) for _, inp in plan.candidates]
        )
        signatures = _signatures(ctx, plan, results)
        state = retrying(
            ctx.sessions, lambda s: _store(ctx, s, plan, results, signatures), patience_secs=patience, on_retry=waiting
        )
    failed = sum(r.error_kind.is_error for r in results)
    log.info(
        "batch %d: %d built, %d failed in %.2f s -> %s",
        batch_id,
        len(results) - failed,
        failed,
        time.perf_counter() - t0,
        state,
    )
    return str(state)


def _lock(
    ctx: WorkerContext, batch_id: int, stack: ExitStack, patience: float, waiting: Callable[[DatabaseError], None]
) -> bool:
    """Take the batch's build lock for the rest of `stack` (waiting up to `patience`
    seconds for a database that is away); False when another worker holds it."""
    deadline = time.monotonic() + patience
    while True:
        try:
            return stack.enter_context(build_locks.holding(ctx.engine, batch_id))
        except Unavailable as error:
            if time.monotonic() >= deadline:
                raise
            waiting(error)
            time.sleep(0.5)


def _claim(ctx: WorkerContext, s: Session, batch_id: int) -> _Plan | BatchState:
    batch = batches.claim_for_build(s, batch_id=batch_id)
    if batch is None:
        raise BatchNotFound(f"batch {batch_id} does not exist")
    if batch.state not in (BatchState.PROPOSED, BatchState.BUILDING):
        return batch.state
    source = batches.build_source(s, batch=batch, with_module=not _workload_path(ctx, batch.workload_id).is_file())
    cands = batches.unmeasured_candidates(s, batch_id=batch_id)
    return _Plan(
        batch_id=batch_id,
        workload_id=batch.workload_id,
        workload_name=source.workload_name,
        module_json=source.module_json,
        target=source.target,
        build_timeout=batch.build_timeout_secs,
        candidates=[(c.id, codec.input_from_json(c.input)) for c in cands],
    )


def _workload_path(ctx: WorkerContext, workload_id: int) -> Path:
    return ctx.artifact_root / artifacts.workload_path(workload_id)


def _workload_file(ctx: WorkerContext, plan: _Plan) -> Path:
    """The workload's IRModule JSON as the builders load it (written once per workload)."""
    path = _workload_path(ctx, plan.workload_id)
    if plan.module_json is not None and not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(plan.module_json)
        os.replace(tmp, path)
    return path


def _signatures(ctx: WorkerContext, plan: _Plan, results: list[BuildResult]) -> list[str | None]:
    """Each built kernel's signature for its batch candidate (hex; None: unsigned)."""
    if ctx.signer is None:
        return [None] * len(results)
    return [
        ctx.signer.sign_file(SignedKind.KERNEL, bc_id, res.artifact).hex() if res.artifact else None
        for (bc_id, _), res in zip(plan.candidates, results, strict=True)
    ]


def _store(
    ctx: WorkerContext, s: Session, plan: _Plan, results: list[BuildResult], signatures: list[str | None]
) -> BatchState:
    root = ctx.artifact_root
    stamp = time.time()
    fingerprint = {"builder": socket.gethostname()}
    state = batches.lock_batch(s, batch_id=plan.batch_id)
    if state is not BatchState.BUILDING:  # failed or cancelled meanwhile
        return state if state is not None else BatchState.FAILED
    ids, paths, builds = [], [], []
    for (bc_id, _), res in zip(plan.candidates, results, strict=True):
        rel = artifacts.relative_to_root(root, res.artifact) if res.artifact else None
        ids.append(bc_id)
        paths.append(rel)
        builds.append(json.dumps(codec.build_to_json(replace(res, artifact=rel))))
    batches.set_builds(s, ids=ids, paths=paths, builds=builds, signatures=signatures)  # one statement
    for (bc_id, inp), res in zip(plan.candidates, results, strict=True):
        if res.error_kind.is_error:
            record = MeasureRecord.of(
                MeasureResult(inp, res, None), workload=plan.workload_name, target=plan.target, timestamp=stamp
            )
            measurements.record_build_error(s, batch_candidate_id=bc_id, record=record, fingerprint=fingerprint)
    return batches.mark_batch_ready(s, batch_id=plan.batch_id)
