"""Leases: `lease_next_batch` (fair share, FIFO, `FOR UPDATE SKIP LOCKED`), `heartbeat` (renews the
leases the agent names, only those), `expire_leases`, `finish_lease`, `lease_withheld`, `classes_with_work`;
`find_lease`, and `leased_work` (what an agent is handed with a lease besides its candidates).

Lease rules. A lease is valid while its state is `active`: a result or heartbeat under an
active lease is accepted even past `expires_at`, until someone else leases the batch or
`expire_leases` runs (either marks it `expired`). After that, the first agent's writes
are refused (`LeaseNotHeld`).

Every function works inside the caller's transaction and commits nothing itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, Select, and_, case, exists, func, insert, literal, or_, select, update
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value

from services.db import trust
from services.db.batches import end_active_lease, unmeasured_candidates
from services.db.exceptions import LeaseNotHeld, RowNotFound, TokenRevoked
from services.db.models import (
    Agent,
    Batch,
    Job,
    Lease,
    Measurement,
    ModelRun,
    TaskDataRow,
    Token,
    WorkloadRow,
)
from services.db.statements import Now, db_now, get_row
from services.db.states import AgentState, BatchState, LeaseState, ModelRunState
from services.db.stored_files import task_data_of

MAX_LEASE_PROBES = 8
"""Queue heads `lease_next_batch` tries before giving up (a candidate is passed over when
its expired lease was renewed by a heartbeat between the queue scan and the lock)."""


def lease_next_batch(
    session: Session, *, agent_id: int, lease_secs: float, now: datetime | None = None
) -> Lease | None:
    """Lease the next batch of the agent's device class that is ready, or whose lease
    expired; None when there is none (or the agent may be leased nothing:
    `lease_withheld` says why: quarantined, disabled, flagged, or its token revoked).
    Confirmation batches go to agents of another party (token) than the one whose time
    they check, when one that may confirm is live (`_confirmations_for`).

    Fair share, team first: the next batch is one of the team that holds the fewest
    of the class's agents now (active leases), then of that team's job that holds the
    fewest, then the oldest (FIFO). A team with 25 jobs and a team with one get the
    class's agents in turns, and a team's jobs share its turns.

    Batches are locked with `FOR UPDATE SKIP LOCKED`, so concurrent agents never get the
    same batch and never wait on each other. A re-leased batch's old lease becomes
    `expired`. Returns the new lease, its `batch` loaded. Raises `RowNotFound` for an
    unknown agent.
    """
    agent = agent_to_lease_to(session, agent_id)
    if agent is None:
        return None
    at = db_now(now)
    queue = _lease_queue(session, agent, at)
    passed_over: list[int] = []
    for _ in range(MAX_LEASE_PROBES):
        head = queue.where(Batch.id.not_in(passed_over)) if passed_over else queue
        batch = session.scalars(head).one_or_none()
        if batch is None:
            return None
        if batch.state is BatchState.LEASED and not end_active_lease(
            session, batch_id=batch.id, state=LeaseState.EXPIRED, now=now, only_expired=True
        ):
            passed_over.append(batch.id)  # renewed since the scan
            continue
        return _grant(session, batch, agent_id=agent_id, at=at, lease_secs=lease_secs)
    return None


def _lease_queue(session: Session, agent: Agent, at: Now) -> Select[tuple[Batch]]:
    """The agent's class's queue head as a locking query: a batch ready, or leased under
    an expired lease, that the agent may take, fair share then FIFO, `SKIP LOCKED`."""
    expired = exists().where(
        Lease.batch_id == Batch.id, Lease.state == LeaseState.ACTIVE, Lease.expires_at < at
    )
    team_held, job_held = _agents_held(session, device_class_id=agent.device_class_id, at=at)
    return (
        select(Batch)
        .join(Job, Job.id == Batch.job_id)
        .where(
            Batch.device_class_id == agent.device_class_id,
            Batch.state.in_([BatchState.READY, BatchState.LEASED]),
            or_(Batch.state == BatchState.READY, expired),
            _confirmations_for(session, agent),
        )
        .order_by(*_fewest_held_first(team_held, Job.team_id), *_fewest_held_first(job_held, Batch.job_id),
                  Batch.ready_at, Batch.id)
        .limit(1)
        .with_for_update(of=Batch, skip_locked=True)
        .execution_options(populate_existing=True)
    )


def _grant(session: Session, batch: Batch, *, agent_id: int, at: Now, lease_secs: float) -> Lease:
    """A new active lease of the (locked) batch to the agent; the batch is leased, the agent busy."""
    lease = session.scalars(
        insert(Lease)
        .values(
            batch_id=batch.id,
            agent_id=agent_id,
            state=LeaseState.ACTIVE,
            granted_at=at,
            expires_at=at + timedelta(seconds=lease_secs),
        )
        .returning(Lease)
    ).one()
    session.execute(
        update(Batch)
        .where(Batch.id == batch.id)
        .values(state=BatchState.LEASED, attempts=Batch.attempts + 1),
        execution_options={"synchronize_session": False},
    )
    session.refresh(batch)
    mark_busy(session, agent_id)
    set_committed_value(lease, "batch", batch)  # loaded, not a change to flush
    return lease


def _agents_held(session: Session, *, device_class_id: int, at: Now) -> tuple[dict[int, int], dict[int, int]]:
    """Active, unexpired leases of the class's batches: per team, per job."""
    rows = session.execute(
        select(Job.team_id, Batch.job_id, func.count())
        .select_from(Lease)
        .join(Batch, Batch.id == Lease.batch_id)
        .join(Job, Job.id == Batch.job_id)
        .where(Batch.device_class_id == device_class_id, Lease.state == LeaseState.ACTIVE, Lease.expires_at >= at)
        .group_by(Job.team_id, Batch.job_id)
    ).all()
    teams: dict[int, int] = {}
    jobs: dict[int, int] = {}
    for team_id, job_id, n in rows:
        teams[team_id] = teams.get(team_id, 0) + n
        jobs[job_id] = n
    return teams, jobs


def _fewest_held_first(counts: dict[int, int], key: ColumnElement[Any]) -> list[ColumnElement[Any]]:
    """Ordering terms: `counts[key]` in SQL (0 for a key not in it), none without counts."""
    return [case(counts, value=key, else_=0)] if counts else []


def _confirmations_for(session: Session, agent: Agent) -> ColumnElement[bool]:
    """The batches of the class the agent (one that may be leased: not flagged) may take,
    as far as confirmations go: plain batches always; another party's confirmation
    always; its own party's (its own, or those of agents of its token: one token is one
    party, `trust.same_party`) only when no agent of another party that may confirm is
    live, so a token's second agent never confirms its first while anyone else could."""
    plain = Batch.avoid_agent_id.is_(None)
    party = trust.same_party_clause(agent.id, agent.token_id)
    others = session.scalar(
        select(
            exists().where(
                Agent.device_class_id == agent.device_class_id,
                ~party,
                Agent.state.in_([AgentState.IDLE, AgentState.BUSY]),
                trust.may_confirm_clause(),
            )
        )
    )
    if not others:
        return literal(True)
    own = Batch.avoid_agent_id.in_(select(Agent.id).where(party).scalar_subquery())
    return or_(plain, ~own)


def lease_withheld(session: Session, *, agent_id: int) -> str | None:
    """Why the agent is leased nothing now, batches or model runs (None: it may be), in
    words the agent logs. Raises `RowNotFound` for an unknown agent, `TokenRevoked` when
    its token was revoked (as `heartbeat`: its calls are refused, not answered)."""
    agent = session.get(Agent, agent_id)
    if agent is None:
        raise RowNotFound(f"agent {agent_id}")
    if agent.token_id is not None and token_revoked(session, agent.token_id):
        raise TokenRevoked(f"agent {agent_id}: its token was revoked")
    return _withheld(session, agent)


def _withheld(session: Session, agent: Agent) -> str | None:
    """Quarantined or disabled by an operator, its token revoked, or flagged: a flagged
    agent's timings are not believed, so every trial it would run is one another team's
    job spends for nothing (and a batch it holds is one an honest agent waits for). It
    keeps heartbeating; an operator looks at it (`tunefarm devices`) and quarantines it."""
    if agent.quarantined_at is not None:
        return "quarantined by an operator: leased nothing until `tunefarm farm agent unquarantine`"
    if agent.state is AgentState.DISABLED:
        return "disabled by an operator: leased nothing"
    if agent.token_id is not None and token_revoked(session, agent.token_id):
        return "its agent token is revoked"
    reasons = trust.flag_reasons(trust.AgentCounts.of(agent))
    if reasons:
        return (f"flagged ({'; '.join(reasons)}): leased nothing while its timings are not believed "
                "(an operator's `tunefarm farm agent unflag` lets it back)")
    return None


def may_lease(session: Session, agent: Agent) -> bool:
    """The agent may be handed work (`_withheld` says why not)."""
    return _withheld(session, agent) is None


def agent_to_lease_to(session: Session, agent_id: int) -> Agent | None:
    """The agent asking for work, or None when it may not be handed any (`may_lease`).
    Raises `RowNotFound` for an unknown agent."""
    agent = session.get(Agent, agent_id)
    if agent is None:
        raise RowNotFound(f"agent {agent_id}")
    return agent if may_lease(session, agent) else None


def token_revoked(session: Session, token_id: int) -> bool:
    return session.scalar(select(Token.revoked_at.is_not(None)).where(Token.id == token_id)) is not False


def classes_with_work(session: Session, *, now: datetime | None = None) -> set[int]:
    """The device classes with something to lease: a batch ready, or leased under an
    expired lease, or a model run likewise (what `lease_next_batch` and `lease_model_run`
    would find). One query for every class: a lease service with many waiting agents
    asks this instead of each agent trying to lease."""
    at = db_now(now)
    expired = exists().where(Lease.batch_id == Batch.id, Lease.state == LeaseState.ACTIVE, Lease.expires_at < at)
    batches = select(Batch.device_class_id).where(
        Batch.state.in_([BatchState.READY, BatchState.LEASED]), or_(Batch.state == BatchState.READY, expired)
    )
    runs = select(ModelRun.device_class_id).where(
        or_(ModelRun.state == ModelRunState.READY, and_(ModelRun.state == ModelRunState.LEASED, ModelRun.expires_at < at))
    )
    return {int(c) for c in session.scalars(batches.distinct().union(runs.distinct()))}


def mark_busy(session: Session, agent_id: int) -> None:
    """The agent holds something now (unless an operator disabled it)."""
    session.execute(
        update(Agent)
        .where(Agent.id == agent_id, Agent.state != AgentState.DISABLED)
        .values(state=AgentState.BUSY),
        execution_options={"synchronize_session": False},
    )


def heartbeat(
    session: Session,
    *,
    agent_id: int,
    lease_secs: float,
    lease_ids: Sequence[int] = (),
    model_run_ids: Sequence[int] = (),
    now: datetime | None = None,
) -> list[int]:
    """An agent is alive: record it, and extend to now + `lease_secs` those of its active
    leases and leased model runs that it names (`lease_ids`, `model_run_ids`: what it is
    working on). A lease it does not name is not renewed: its grant never reached the
    agent, and it expires at its deadline. Returns the ids of the leases extended. Raises
    `RowNotFound` for an unknown agent, `TokenRevoked` (nothing changed: the revocation
    left it offline, holding nothing) when its token was revoked."""
    at = db_now(now)
    token_id = session.scalar(select(Agent.token_id).where(Agent.id == agent_id))
    if token_id is not None and token_revoked(session, token_id):
        raise TokenRevoked(f"agent {agent_id}: its token was revoked")

    def extend(entity: Any, held: Any, ids: Sequence[int]) -> list[int]:
        if not ids:
            return []
        return list(
            session.scalars(
                update(entity)
                .where(entity.agent_id == agent_id, entity.state == held, entity.id.in_(sorted(set(ids))))
                .values(expires_at=at + timedelta(seconds=lease_secs))
                .returning(entity.id)
            )
        )

    extended = extend(Lease, LeaseState.ACTIVE, lease_ids)
    runs = extend(ModelRun, ModelRunState.LEASED, model_run_ids)
    state = case(
        (Agent.state == AgentState.DISABLED, Agent.state),
        else_=AgentState.BUSY if extended or runs else AgentState.IDLE,
    )
    found = session.execute(
        update(Agent)
        .where(Agent.id == agent_id)
        .values(last_heartbeat_at=at, state=state)
        .returning(Agent.id),
        execution_options={"synchronize_session": False},
    ).first()
    if found is None:
        raise RowNotFound(f"agent {agent_id}")
    return sorted(extended)


def expire_leases(session: Session, *, now: datetime | None = None) -> list[int]:
    """Mark every active lease past its deadline expired and put its batch back in the
    queue (keeping its place). Batches another transaction holds are skipped (the next
    sweep, or the leaser itself, takes care of them). Returns the requeued batch ids."""
    at = db_now(now)
    batch_ids = list(
        session.scalars(
            select(Batch.id)
            .join(Lease, and_(Lease.batch_id == Batch.id, Lease.state == LeaseState.ACTIVE))
            .where(Lease.expires_at < at)
            .order_by(Batch.id)
            .with_for_update(of=Batch, skip_locked=True)
        )
    )
    if not batch_ids:
        return []
    # A heartbeat (which locks no batch) may renew a lease after the scan: its batch stays leased.
    expired = sorted(
        session.scalars(
            update(Lease)
            .where(Lease.batch_id.in_(batch_ids), Lease.state == LeaseState.ACTIVE, Lease.expires_at < at)
            .values(state=LeaseState.EXPIRED, finished_at=at)
            .returning(Lease.batch_id),
            execution_options={"synchronize_session": False},
        )
    )
    if expired:
        session.execute(
            update(Batch)
            .where(Batch.id.in_(expired), Batch.state == BatchState.LEASED)
            .values(state=BatchState.READY),
            execution_options={"synchronize_session": False},
        )
    return expired


def finish_lease(
    session: Session, *, lease_id: int, agent_id: int, now: datetime | None = None
) -> BatchState:
    """The agent is done with its lease: the batch is done when every candidate has its
    measurement, otherwise back in the queue for what is missing. Returns the batch's
    new state. Raises `LeaseNotHeld` unless the lease is the agent's and active."""
    batch_id = session.scalar(select(Lease.batch_id).where(Lease.id == lease_id))
    if batch_id is None:
        raise RowNotFound(f"lease {lease_id}")
    session.execute(select(Batch.id).where(Batch.id == batch_id).with_for_update())  # lock order
    lease = held_lease(session, lease_id=lease_id, agent_id=agent_id, lock=True)
    at = db_now(now)
    session.execute(
        update(Lease).where(Lease.id == lease.id).values(state=LeaseState.FINISHED, finished_at=at),
        execution_options={"synchronize_session": False},
    )
    done = not unmeasured_candidates(session, batch_id=batch_id)
    state = BatchState.DONE if done else BatchState.READY
    session.execute(
        update(Batch)
        .where(Batch.id == batch_id)
        .values(state=state, **({"finished_at": at} if done else {})),
        execution_options={"synchronize_session": False},
    )
    return state


def held_lease(session: Session, *, lease_id: int, agent_id: int, lock: bool) -> Lease:
    """The lease, if it is active and the agent's; else `LeaseNotHeld` (`RowNotFound` if absent).
    `lock`: FOR UPDATE (the caller changes it), else FOR SHARE (it must not change under us)."""
    lease = get_row(session, Lease, lease_id, lock=lock)
    if lease is None:
        raise RowNotFound(f"lease {lease_id}")
    if lease.agent_id != agent_id:
        raise LeaseNotHeld(f"lease {lease_id} is not held by agent {agent_id}")
    if lease.state is not LeaseState.ACTIVE:
        raise LeaseNotHeld(f"lease {lease_id} is {lease.state}")
    return lease


def find_lease(session: Session, *, lease_id: int) -> Lease | None:
    """The lease, in whatever state (None: there is no such lease)."""
    return session.get(Lease, lease_id)


@dataclass(frozen=True)
class LeasedWork:
    """What an agent is handed with a lease of a batch, besides its candidates."""

    workload_name: str
    n_inputs: int
    n_outputs: int
    task_data: TaskDataRow | None  # of the workload (None: it has none)
    signed_as: int | None  # a confirmation's: the candidate its kernel was built and signed as


def leased_work(session: Session, *, batch: Batch) -> LeasedWork:
    """The batch's workload (name, inputs, outputs), its task data, and for a confirmation
    batch the candidate whose measurement it confirms."""
    wl = session.execute(
        select(WorkloadRow.name, WorkloadRow.n_inputs, WorkloadRow.n_outputs).where(WorkloadRow.id == batch.workload_id)
    ).one()
    td = task_data_of(session, workload_id=batch.workload_id)
    signed_as = (
        session.scalar(
            select(Measurement.batch_candidate_id).where(Measurement.id == batch.confirms_measurement_id)
        )
        if batch.confirms_measurement_id is not None
        else None
    )
    return LeasedWork(wl.name, wl.n_inputs, wl.n_outputs, td, signed_as)
