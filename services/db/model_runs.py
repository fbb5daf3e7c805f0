"""Model runs (a tuned model run on an agent of its class): `create_model_run`, `lease_model_run`,
`finish_model_run`, `give_up_model_run`; `leases.heartbeat` extends them like leases.

Every function works inside the caller's transaction and commits nothing itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, insert, null, or_, select, update
from sqlalchemy.orm import Session

from services.db.exceptions import LeaseNotHeld, RowNotFound
from services.db.leases import MAX_LEASE_PROBES, agent_to_lease_to, mark_busy
from services.db.models import ModelRun
from services.db.statements import db_now, get_row
from services.db.states import ModelRunState


@dataclass(frozen=True)
class StoredFile:
    """A file in the artifact directory as rows keep it: its path relative to the
    directory, its sha256 and its size in bytes."""

    path: str
    sha256: str
    size: int


def create_model_run(
    session: Session,
    *,
    job_id: int,
    device_class_id: int,
    library: StoredFile,
    inputs: StoredFile,
    repeat: int,
    warmup: int,
    timeout_secs: float,
    onnx: StoredFile | None = None,
    input_names: Sequence[str] | None = None,
    now: datetime | None = None,
) -> ModelRun:
    """Queue a tuned model for an agent of the class; with `onnx` (the graph the model was
    imported from) and `input_names` (of the inputs' arrays, in order), the agent times
    the peers on it beside the model. The job's earlier runs still open (a restarted
    scheduler finishing the job again) fail as superseded."""
    at = db_now(now)
    session.execute(
        update(ModelRun)
        .where(ModelRun.job_id == job_id, ModelRun.state.in_([ModelRunState.READY, ModelRunState.LEASED]))
        .values(state=ModelRunState.FAILED, error="superseded by a newer run of the job", finished_at=at),
        execution_options={"synchronize_session": False},
    )
    return session.scalars(
        insert(ModelRun).returning(ModelRun),
        [
            {
                "job_id": job_id,
                "device_class_id": device_class_id,
                "library_path": library.path,
                "library_sha256": library.sha256,
                "library_size": library.size,
                "inputs_path": inputs.path,
                "inputs_sha256": inputs.sha256,
                "inputs_size": inputs.size,
                "onnx_path": onnx.path if onnx else None,
                "onnx_sha256": onnx.sha256 if onnx else None,
                "onnx_size": onnx.size if onnx else None,
                "input_names": list(input_names) if input_names is not None else null(),  # SQL NULL, not JSON null
                "repeat": repeat,
                "warmup": warmup,
                "timeout_secs": timeout_secs,
            }
        ],
    ).one()


def give_up_model_run(session: Session, *, model_run_id: int, reason: str, now: datetime | None = None) -> bool:
    """Fail a model run nobody holds that its job stopped waiting for (so that an agent
    coming later does not run what no one reads); False when it was leased or ended
    meanwhile (a leased run is left to its agent)."""
    done = session.execute(
        update(ModelRun)
        .where(ModelRun.id == model_run_id, ModelRun.state == ModelRunState.READY)
        .values(state=ModelRunState.FAILED, error=reason, finished_at=db_now(now)),
        execution_options={"synchronize_session": False},
    )
    return bool(done.rowcount)


def lease_model_run(
    session: Session, *, agent_id: int, lease_secs: float, max_attempts: int, now: datetime | None = None
) -> ModelRun | None:
    """Lease the oldest model run of the agent's class that is ready, or whose lease
    expired (its agent stopped heartbeating); None when there is none. A run already
    leased `max_attempts` times fails instead (no agent finishes it: it may be what kills
    them). `FOR UPDATE SKIP LOCKED`, like `lease_next_batch`. Raises `RowNotFound` for an
    unknown agent."""
    agent = agent_to_lease_to(session, agent_id)
    if agent is None:
        return None
    at = db_now(now)
    for _ in range(MAX_LEASE_PROBES):
        run = session.scalars(
            select(ModelRun)
            .where(
                ModelRun.device_class_id == agent.device_class_id,
                or_(
                    ModelRun.state == ModelRunState.READY,
                    and_(ModelRun.state == ModelRunState.LEASED, ModelRun.expires_at < at),
                ),
            )
            .order_by(ModelRun.id)
            .limit(1)
            .with_for_update(skip_locked=True)
            .execution_options(populate_existing=True)
        ).one_or_none()
        if run is None:
            return None
        if run.attempts >= max_attempts:
            session.execute(
                update(ModelRun)
                .where(ModelRun.id == run.id)
                .values(
                    state=ModelRunState.FAILED,
                    finished_at=at,
                    error=f"not run: leased {run.attempts} times and no agent finished it",
                ),
                execution_options={"synchronize_session": False},
            )
            continue
        leased = session.scalars(
            update(ModelRun)
            .where(ModelRun.id == run.id)
            .values(
                state=ModelRunState.LEASED,
                agent_id=agent_id,
                expires_at=at + timedelta(seconds=lease_secs),
                attempts=ModelRun.attempts + 1,
            )
            .returning(ModelRun),
            execution_options={"populate_existing": True},
        ).one()
        mark_busy(session, agent_id)
        return leased
    return None


def held_model_run(session: Session, *, model_run_id: int, agent_id: int, lock: bool = False) -> ModelRun:
    """The model run, if the agent holds it (leased to it, even past `expires_at` until
    another agent leases it); else `LeaseNotHeld` (`RowNotFound` if absent)."""
    run = get_row(session, ModelRun, model_run_id, lock=lock)
    if run is None:
        raise RowNotFound(f"model run {model_run_id}")
    if run.agent_id != agent_id or run.state is not ModelRunState.LEASED:
        raise LeaseNotHeld(f"model run {model_run_id} is not held by agent {agent_id} ({run.state})")
    return run


def finish_model_run(
    session: Session,
    *,
    model_run_id: int,
    agent_id: int,
    outputs_path: str | None,
    result: Mapping[str, Any],
    error: str = "",
    peer_latencies: Mapping[str, Any] | None = None,
    now: datetime | None = None,
) -> ModelRun:
    """The agent ran (or could not run) the model: done with its outputs (and the peers'
    timings, when it timed them), or failed with the agent's error. Raises `LeaseNotHeld`
    unless the agent holds the run."""
    held_model_run(session, model_run_id=model_run_id, agent_id=agent_id, lock=True)
    return session.scalars(
        update(ModelRun)
        .where(ModelRun.id == model_run_id)
        .values(
            state=ModelRunState.FAILED if error else ModelRunState.DONE,
            outputs_path=outputs_path,
            result=dict(result),
            peer_latencies=dict(peer_latencies) if peer_latencies is not None else null(),  # SQL NULL, not JSON null
            error=error or None,
            finished_at=db_now(now),
        )
        .returning(ModelRun),
        execution_options={"populate_existing": True},
    ).one()
