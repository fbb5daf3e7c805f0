"""Small keyword-only database operations that carry the farm's invariants.

Every function works inside the caller's transaction (`session.transaction`) and commits
nothing itself. Map:

- tokens: `new_token`, `hash_token`, `issue_token`, `verify_token`, `revoke_token`;
- batch lifecycle: `transition_batch` (the state machine, `BATCH_TRANSITIONS`),
  `mark_batch_ready`, `unmeasured_candidates`;
- leases: `lease_next_batch` (FIFO, `FOR UPDATE SKIP LOCKED`), `heartbeat` (renews the
  leases the agent names, only those), `expire_leases`, `finish_lease`, `mark_agents_offline`;
- measurements: `record_measurement` (exactly once, only under the sender's active lease),
  `record_measurements` (the same for many candidates of a lease in a few statements),
  `record_build_error` (a candidate that never reached an agent). Every agent's time is
  checked against the class's timing floor first (`timing_floor`: below it, an error of
  kind below_floor); a measurement that becomes its task's best gets a confirmation
  batch, whose results are `Confirmation`s (`confirmations`: the same calls store them);
- agents and lost batches: `register_agent`, `release_agent_leases` (everything an agent
  does not say it holds: a grant lost on its way, an agent restarted), `abandon_batch`
  (error results for what a batch that cannot be measured still lacks),
  `quarantine_agent` / `lift_quarantine` (an operator's verdict on an agent's timings);
- cost models: `add_cost_model_version`, `latest_cost_model_version`, `latest_cost_models_of_classes` (transfer);
- model runs (a tuned model run on an agent of its class): `create_model_run`,
  `lease_model_run`, `finish_model_run`; `heartbeat` extends them like leases.

Time: every `now` argument defaults to the database's clock (`now()`, the transaction's
start), so hosts with skewed clocks agree; tests pass explicit times.

Lease rules. A lease is valid while its state is `active`: a result or heartbeat under an
active lease is accepted even past `expires_at`, until someone else leases the batch or
`expire_leases` runs (either marks it `expired`). After that, the first agent's writes
are refused (`LeaseNotHeld`).

Lock order, kept by every function here so that concurrent callers cannot deadlock:
batches -> leases -> measurements -> confirmations -> job_tasks -> jobs -> model_runs -> agents.
Code elsewhere that locks several of these in one transaction should keep the same order.
(A new best's confirmation is scheduled after its task's row is updated: it updates the
measurement the same transaction has just inserted, which no other transaction can lock.)
"""

from __future__ import annotations

import hashlib
import math
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Integer,
    and_,
    case,
    cast,
    exists,
    func,
    insert,
    literal,
    or_,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value

from services.db import confirmations, timing_floor, trust
from services.db.codec import build_from_json, input_from_json, record_to_json
from services.db.exceptions import Conflict, InvalidTransition, LeaseNotHeld, NotFound, TokenRevoked
from services.db.models import (
    Agent,
    AgentState,
    Batch,
    BatchCandidate,
    BatchState,
    Confirmation,
    CostModelVersion,
    DeviceClass,
    Job,
    JobTask,
    Lease,
    LeaseState,
    Measurement,
    ModelRun,
    ModelRunState,
    Token,
    TokenKind,
    Workload,
)
from services.db.revocations import CHANNEL as REVOCATION_CHANNEL
from tunefarm.records import BuildResult, ErrorKind, MeasureRecord, MeasureResult, RunResult

Now = datetime | ColumnElement[Any]


@dataclass(frozen=True)
class StoredFile:
    """A file in the artifact directory as rows keep it: its path relative to the
    directory, its sha256 and its size in bytes."""

    path: str
    sha256: str
    size: int


def _now(now: datetime | None) -> Now:
    return now if now is not None else func.now()


# -- tokens -----------------------------------------------------------------------------------

TOKEN_PREFIXES: Mapping[TokenKind, str] = {TokenKind.TEAM: "tft_", TokenKind.AGENT: "tfa_"}
"""A token's kind is visible in its text, so a token pasted into the wrong place is obvious."""

TOKEN_BYTES = 32
"""Random bytes in a token (256 bits: an unsalted sha256 of it cannot be brute-forced)."""

TOKEN_DISPLAY_CHARS = 12
"""Leading characters of a token kept in clear (`Token.prefix`), to tell tokens apart."""


@dataclass(frozen=True)
class NewToken:
    plain: str  # shown to its owner once; never stored
    token_hash: str
    prefix: str


def hash_token(plain: str) -> str:
    """The stored form of a token: sha256, hex."""
    return hashlib.sha256(plain.encode()).hexdigest()


def new_token(kind: TokenKind) -> NewToken:
    plain = TOKEN_PREFIXES[kind] + secrets.token_urlsafe(TOKEN_BYTES)
    return NewToken(plain=plain, token_hash=hash_token(plain), prefix=plain[:TOKEN_DISPLAY_CHARS])


def issue_token(
    session: Session, *, kind: TokenKind, team_id: int | None = None, label: str = ""
) -> tuple[Token, str]:
    """Store a new token; returns its row and the plain token (the only time it exists)."""
    token = new_token(kind)
    row = session.scalars(
        insert(Token).returning(Token),
        [
            {
                "kind": kind,
                "team_id": team_id,
                "token_hash": token.token_hash,
                "prefix": token.prefix,
                "label": label,
            }
        ],
    ).one()
    return row, token.plain


def verify_token(session: Session, *, plain: str, kind: TokenKind) -> Token | None:
    """The unrevoked token of `kind` whose text is `plain`, or None. A team token is never
    an agent token, nor the reverse."""
    if not plain.startswith(TOKEN_PREFIXES[kind]):
        return None
    return session.scalars(
        select(Token).where(
            Token.token_hash == hash_token(plain), Token.kind == kind, Token.revoked_at.is_(None)
        )
    ).one_or_none()


def revoke_token(session: Session, *, token_id: int, now: datetime | None = None) -> Token:
    """Revoke a token (again: nothing changes). It is refused from now on: every process
    that caches verified tokens hears of it when this transaction commits
    (`revocations.CHANNEL`). The agents of an agent token hold nothing any more: their
    leases end now (the batches go back to the queue for other agents) and they are
    offline. Raises `NotFound` for an unknown token."""
    token = session.scalars(
        select(Token).where(Token.id == token_id).with_for_update().execution_options(populate_existing=True)
    ).one_or_none()
    if token is None:
        raise NotFound(f"token {token_id}")
    if token.revoked_at is None:
        token = session.scalars(
            update(Token).where(Token.id == token_id).values(revoked_at=_now(now)).returning(Token),
            execution_options={"populate_existing": True},
        ).one()
    if token.kind is TokenKind.AGENT:
        agent_ids = list(session.scalars(select(Agent.id).where(Agent.token_id == token_id).order_by(Agent.id)))
        for agent_id in agent_ids:
            release_agent_leases(session, agent_id=agent_id, now=now)
        session.execute(
            update(Agent)
            .where(Agent.id.in_(agent_ids), Agent.state.in_([AgentState.IDLE, AgentState.BUSY]))
            .values(state=AgentState.OFFLINE),
            execution_options={"synchronize_session": False},
        )
    session.execute(select(func.pg_notify(REVOCATION_CHANNEL, token.token_hash)))
    return token


# -- batches ----------------------------------------------------------------------------------

BATCH_TRANSITIONS: Mapping[BatchState, frozenset[BatchState]] = {
    BatchState.PROPOSED: frozenset({BatchState.BUILDING, BatchState.FAILED}),
    # back to proposed: the build worker died and the build is queued again
    BatchState.BUILDING: frozenset(
        {BatchState.PROPOSED, BatchState.READY, BatchState.DONE, BatchState.FAILED}
    ),
    BatchState.READY: frozenset({BatchState.LEASED, BatchState.FAILED}),
    # back to ready: the lease expired or ended with candidates unmeasured
    BatchState.LEASED: frozenset({BatchState.READY, BatchState.DONE, BatchState.FAILED}),
    BatchState.DONE: frozenset(),
    BatchState.FAILED: frozenset(),
}
"""The batch states each state may move to."""


def transition_batch(
    session: Session,
    *,
    batch_id: int,
    to: BatchState,
    build_error: str | None = None,
    now: datetime | None = None,
) -> Batch:
    """Move a batch to `to` if `BATCH_TRANSITIONS` allows it from its current state.

    Entering ready sets `ready_at` the first time (its place in the queue), entering done
    or failed sets `finished_at`, and leaving leased ends the batch's active lease (a
    failed or cancelled batch takes no more results). Raises `NotFound`, `InvalidTransition`.
    """
    batch = session.scalars(
        select(Batch).where(Batch.id == batch_id).with_for_update().execution_options(populate_existing=True)
    ).one_or_none()
    if batch is None:
        raise NotFound(f"batch {batch_id}")
    if to not in BATCH_TRANSITIONS[batch.state]:
        raise InvalidTransition(f"batch {batch_id}: {batch.state} -> {to}")
    values: dict[str, Any] = {"state": to}
    if to is BatchState.READY and batch.ready_at is None:
        values["ready_at"] = _now(now)
    if to.is_terminal:
        values["finished_at"] = _now(now)
    if build_error is not None:
        values["build_error"] = build_error
    if batch.state is BatchState.LEASED:
        _end_active_lease(session, batch_id=batch_id, state=LeaseState.EXPIRED, now=now)
    return session.scalars(
        update(Batch).where(Batch.id == batch_id).values(**values).returning(Batch),
        execution_options={"populate_existing": True},
    ).one()


def mark_batch_ready(session: Session, *, batch_id: int, now: datetime | None = None) -> BatchState:
    """A built batch joins its class's queue; one with nothing left to measure (every build
    failed and was recorded) is done instead. Returns the state reached."""
    session.execute(select(Batch.id).where(Batch.id == batch_id).with_for_update())
    to = BatchState.READY if unmeasured_candidates(session, batch_id=batch_id) else BatchState.DONE
    return transition_batch(session, batch_id=batch_id, to=to, now=now).state


def unmeasured_candidates(session: Session, *, batch_id: int) -> list[BatchCandidate]:
    """The batch's candidates without a measurement (or, in a confirmation batch, a
    confirmation), in proposal order (what an agent runs)."""
    measured = exists().where(Measurement.batch_candidate_id == BatchCandidate.id)
    confirmed = exists().where(Confirmation.batch_candidate_id == BatchCandidate.id)
    return list(
        session.scalars(
            select(BatchCandidate)
            .where(BatchCandidate.batch_id == batch_id, ~measured, ~confirmed)
            .order_by(BatchCandidate.position, BatchCandidate.id)
        )
    )


# -- leases -----------------------------------------------------------------------------------

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
    `expired`. Returns the new lease, its `batch` loaded. Raises `NotFound` for an
    unknown agent.
    """
    agent = session.get(Agent, agent_id)
    if agent is None:
        raise NotFound(f"agent {agent_id}")
    if not _may_lease(session, agent):
        return None
    at = _now(now)
    expired = exists().where(
        Lease.batch_id == Batch.id, Lease.state == LeaseState.ACTIVE, Lease.expires_at < at
    )
    team_held, job_held = _agents_held(session, device_class_id=agent.device_class_id, at=at)
    confirmable = _confirmations_for(session, agent)
    passed_over: list[int] = []
    for _ in range(MAX_LEASE_PROBES):
        query = (
            select(Batch)
            .join(Job, Job.id == Batch.job_id)
            .where(
                Batch.device_class_id == agent.device_class_id,
                Batch.state.in_([BatchState.READY, BatchState.LEASED]),
                or_(Batch.state == BatchState.READY, expired),
                confirmable,
            )
        )
        if passed_over:
            query = query.where(Batch.id.not_in(passed_over))
        batch = session.scalars(
            query.order_by(*_fewest_held_first(team_held, Job.team_id), *_fewest_held_first(job_held, Batch.job_id),
                           Batch.ready_at, Batch.id)
            .limit(1)
            .with_for_update(of=Batch, skip_locked=True)
            .execution_options(populate_existing=True)
        ).one_or_none()
        if batch is None:
            return None
        if batch.state is BatchState.LEASED and not _end_active_lease(
            session, batch_id=batch.id, state=LeaseState.EXPIRED, now=now, only_expired=True
        ):
            passed_over.append(batch.id)  # renewed since the scan
            continue
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
        _mark_busy(session, agent_id)
        set_committed_value(lease, "batch", batch)  # loaded, not a change to flush
        return lease
    return None


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
    words the agent logs. Raises `NotFound` for an unknown agent."""
    agent = session.get(Agent, agent_id)
    if agent is None:
        raise NotFound(f"agent {agent_id}")
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
    if agent.token_id is not None and _token_revoked(session, agent.token_id):
        return "its agent token is revoked"
    reasons = trust.flag_reasons(trust.AgentCounts.of(agent))
    if reasons:
        return (f"flagged ({'; '.join(reasons)}): leased nothing while its timings are not believed "
                "(an operator's `tunefarm farm agent unflag` lets it back)")
    return None


def _may_lease(session: Session, agent: Agent) -> bool:
    """The agent may be handed work (`_withheld` says why not)."""
    return _withheld(session, agent) is None


def _token_revoked(session: Session, token_id: int) -> bool:
    return session.scalar(select(Token.revoked_at.is_not(None)).where(Token.id == token_id)) is not False


def classes_with_work(session: Session, *, now: datetime | None = None) -> set[int]:
    """The device classes with something to lease: a batch ready, or leased under an
    expired lease, or a model run likewise (what `lease_next_batch` and `lease_model_run`
    would find). One query for every class: a lease service with many waiting agents
    asks this instead of each agent trying to lease."""
    at = _now(now)
    expired = exists().where(Lease.batch_id == Batch.id, Lease.state == LeaseState.ACTIVE, Lease.expires_at < at)
    batches = select(Batch.device_class_id).where(
        Batch.state.in_([BatchState.READY, BatchState.LEASED]), or_(Batch.state == BatchState.READY, expired)
    )
    runs = select(ModelRun.device_class_id).where(
        or_(ModelRun.state == ModelRunState.READY, and_(ModelRun.state == ModelRunState.LEASED, ModelRun.expires_at < at))
    )
    return {int(c) for c in session.scalars(batches.distinct().union(runs.distinct()))}


def _mark_busy(session: Session, agent_id: int) -> None:
    """The agent holds something now (unless an operator disabled it)."""
    session.execute(
        update(Agent)
        .where(Agent.id == agent_id, Agent.state != AgentState.DISABLED)
        .values(state=AgentState.BUSY),
        execution_options={"synchronize_session": False},
    )


def _end_active_lease(
    session: Session, *, batch_id: int, state: LeaseState, now: datetime | None, only_expired: bool = False
) -> int | None:
    """End the batch's active lease (the caller holds the batch's lock); its id, or None."""
    at = _now(now)
    where = [Lease.batch_id == batch_id, Lease.state == LeaseState.ACTIVE]
    if only_expired:
        where.append(Lease.expires_at < at)
    return session.scalars(
        update(Lease).where(*where).values(state=state, finished_at=at).returning(Lease.id)
    ).one_or_none()


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
    `NotFound` for an unknown agent, `TokenRevoked` (nothing changed: the revocation
    left it offline, holding nothing) when its token was revoked."""
    at = _now(now)
    token_id = session.scalar(select(Agent.token_id).where(Agent.id == agent_id))
    if token_id is not None and _token_revoked(session, token_id):
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
        raise NotFound(f"agent {agent_id}")
    return sorted(extended)


def expire_leases(session: Session, *, now: datetime | None = None) -> list[int]:
    """Mark every active lease past its deadline expired and put its batch back in the
    queue (keeping its place). Batches another transaction holds are skipped (the next
    sweep, or the leaser itself, takes care of them). Returns the requeued batch ids."""
    at = _now(now)
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
    session.execute(
        update(Lease)
        .where(Lease.batch_id.in_(batch_ids), Lease.state == LeaseState.ACTIVE, Lease.expires_at < at)
        .values(state=LeaseState.EXPIRED, finished_at=at),
        execution_options={"synchronize_session": False},
    )
    session.execute(
        update(Batch)
        .where(Batch.id.in_(batch_ids), Batch.state == BatchState.LEASED)
        .values(state=BatchState.READY),
        execution_options={"synchronize_session": False},
    )
    return batch_ids


def finish_lease(
    session: Session, *, lease_id: int, agent_id: int, now: datetime | None = None
) -> BatchState:
    """The agent is done with its lease: the batch is done when every candidate has its
    measurement, otherwise back in the queue for what is missing. Returns the batch's
    new state. Raises `LeaseNotHeld` unless the lease is the agent's and active."""
    batch_id = session.scalar(select(Lease.batch_id).where(Lease.id == lease_id))
    if batch_id is None:
        raise NotFound(f"lease {lease_id}")
    session.execute(select(Batch.id).where(Batch.id == batch_id).with_for_update())  # lock order
    lease = _held_lease(session, lease_id=lease_id, agent_id=agent_id, lock=True)
    at = _now(now)
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


def _held_lease(session: Session, *, lease_id: int, agent_id: int, lock: bool) -> Lease:
    """The lease, if it is active and the agent's; else `LeaseNotHeld` (`NotFound` if absent).
    `lock`: FOR UPDATE (the caller changes it), else FOR SHARE (it must not change under us)."""
    lease = _row(session, Lease, lease_id, lock=lock)
    if lease is None:
        raise NotFound(f"lease {lease_id}")
    if lease.agent_id != agent_id:
        raise LeaseNotHeld(f"lease {lease_id} is not held by agent {agent_id}")
    if lease.state is not LeaseState.ACTIVE:
        raise LeaseNotHeld(f"lease {lease_id} is {lease.state}")
    return lease


def _row(session: Session, entity: Any, row_id: int, *, lock: bool) -> Any:
    """A row read fresh, locked FOR UPDATE (`lock`: the caller changes it) or FOR SHARE."""
    return session.scalars(
        select(entity)
        .where(entity.id == row_id)
        .with_for_update(read=not lock)
        .execution_options(populate_existing=True)
    ).one_or_none()


def mark_agents_offline(session: Session, *, stale_secs: float, now: datetime | None = None) -> list[int]:
    """Agents whose last heartbeat is older than `stale_secs` become offline; their ids."""
    at = _now(now)
    return sorted(
        session.scalars(
            update(Agent)
            .where(
                Agent.state.in_([AgentState.IDLE, AgentState.BUSY]),
                or_(
                    Agent.last_heartbeat_at < at - timedelta(seconds=stale_secs),
                    and_(
                        Agent.last_heartbeat_at.is_(None),
                        Agent.registered_at < at - timedelta(seconds=stale_secs),
                    ),
                ),
            )
            .values(state=AgentState.OFFLINE)
            .returning(Agent.id)
        )
    )


# -- measurements -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Recorded:
    measurement_id: int  # in a confirmation batch: the `Confirmation`'s id
    created: bool  # False: the candidate already had its measurement; nothing was written


def record_measurement(
    session: Session,
    *,
    batch_candidate_id: int,
    lease_id: int,
    agent_id: int,
    record: MeasureRecord,
    fingerprint: Mapping[str, Any],
) -> Recorded:
    """Store an agent's measurement of a candidate, exactly once.

    Refused (`LeaseNotHeld`) unless `lease_id` is active, the agent's, and on the
    candidate's batch. A second write of the same candidate (a retry, a duplicate stream)
    changes nothing and returns the first one's id with `created=False`; the unique
    batch candidate guarantees it under any concurrency. A new measurement advances the
    job's and the task's trial counts and best, and the agent's counters, in the same
    transaction. A time below the class's timing floor is stored as a below_floor error;
    a new best gets a confirmation batch; in a confirmation batch, the result is the
    measurement's `Confirmation` (its id is returned).
    """
    lease = _held_lease(session, lease_id=lease_id, agent_id=agent_id, lock=False)
    _candidate_of(session, batch_candidate_id=batch_candidate_id, record=record, lease=lease)
    return _store_results(
        session, batch_id=lease.batch_id, lease=lease, items=[(batch_candidate_id, record)], fingerprint=fingerprint
    )[0]


def record_build_error(
    session: Session, *, batch_candidate_id: int, record: MeasureRecord, fingerprint: Mapping[str, Any]
) -> Recorded:
    """Store the measurement of a candidate whose build failed (written by the build
    worker; no agent, no lease). Exactly once, like `record_measurement`."""
    if not record.error_kind.is_error:
        raise ValueError("record_build_error takes a failed record")
    batch_id = _candidate_of(session, batch_candidate_id=batch_candidate_id, record=record, lease=None)
    return _store_results(
        session, batch_id=batch_id, lease=None, items=[(batch_candidate_id, record)], fingerprint=fingerprint
    )[0]


def _candidate_of(session: Session, *, batch_candidate_id: int, record: MeasureRecord, lease: Lease | None) -> int:
    """The batch of a candidate a record is given for, checked: the candidate exists
    (`NotFound`), is on the lease's batch (`LeaseNotHeld`), and is the record's (`ValueError`)."""
    row = session.execute(
        select(BatchCandidate.batch_id, BatchCandidate.candidate_key).where(BatchCandidate.id == batch_candidate_id)
    ).one_or_none()
    if row is None:
        raise NotFound(f"batch candidate {batch_candidate_id}")
    if lease is not None and lease.batch_id != row.batch_id:
        raise LeaseNotHeld(f"lease {lease.id} is on batch {lease.batch_id}, not on batch {row.batch_id}")
    if record.candidate.key != row.candidate_key:
        raise ValueError(f"record of {record.candidate.key!r} given for candidate {row.candidate_key!r}")
    return int(row.batch_id)


@dataclass(frozen=True)
class _BatchFacts:
    """What storing a batch's results needs to know of it."""

    job_id: int
    job_task_id: int
    workload_id: int
    device_class_id: int
    confirms_measurement_id: int | None  # a confirmation batch: the measurement it re-measures
    floor: float  # the timing floor of its task on its class (seconds; 0: none)


def _batch_facts(session: Session, batch_id: int) -> _BatchFacts:
    row = session.execute(
        select(
            Batch.job_id,
            Batch.job_task_id,
            Batch.workload_id,
            Batch.device_class_id,
            Batch.confirms_measurement_id,
            Workload.flops,
            Workload.io_bytes,
            DeviceClass.target,
        )
        .join(Workload, Workload.id == Batch.workload_id)
        .join(DeviceClass, DeviceClass.id == Batch.device_class_id)
        .where(Batch.id == batch_id)
    ).one()
    floor = timing_floor.floor_secs(row.target or {}, flops=row.flops, io_bytes=row.io_bytes)
    return _BatchFacts(
        row.job_id, row.job_task_id, row.workload_id, row.device_class_id, row.confirms_measurement_id, floor
    )


def _store_results(
    session: Session,
    *,
    batch_id: int,
    lease: Lease | None,
    items: Sequence[tuple[int, MeasureRecord]],
    fingerprint: Mapping[str, Any],
) -> list[Recorded]:
    """Store checked results (candidate id, record) of one batch, exactly once each, in
    a handful of statements whatever their number; one `Recorded` per item, in order.
    An agent's times below the floor become below_floor errors first."""
    facts = _batch_facts(session, batch_id)
    agent_id = lease.agent_id if lease is not None else None
    if agent_id is not None:
        items = [(bc_id, timing_floor.checked(rec, facts.floor)) for bc_id, rec in items]
    if facts.confirms_measurement_id is not None:
        stored = confirmations.record_confirmations(
            session,
            measurement_id=facts.confirms_measurement_id,
            agent_id=agent_id,
            lease_id=lease.id if lease is not None else None,
            items=items,
            fingerprint=fingerprint,
        )
        return [Recorded(measurement_id=c.confirmation_id, created=c.created) for c in stored]
    rows = [
        {
            "batch_candidate_id": bc_id,
            "job_id": facts.job_id,
            "job_task_id": facts.job_task_id,
            "workload_id": facts.workload_id,
            "device_class_id": facts.device_class_id,
            "agent_id": agent_id,
            "lease_id": lease.id if lease is not None else None,
            "candidate_key": rec.candidate.key,  # the candidate's: checked by every caller
            "cost": rec.cost if math.isfinite(rec.cost) else None,
            "error_kind": rec.error_kind,
            "record": record_to_json(rec),
            "fingerprint": dict(fingerprint),
        }
        for bc_id, rec in items
    ]
    # One statement whatever the number of rows (SQLAlchemy's "insertmanyvalues"), and
    # the same statement every time, so it is compiled once per process.
    created = dict(
        session.execute(
            pg_insert(Measurement)
            .on_conflict_do_nothing(index_elements=[Measurement.batch_candidate_id])
            .returning(Measurement.batch_candidate_id, Measurement.id),
            rows,
        ).all()
    )
    ids = [bc_id for bc_id, _ in items]
    missing = [i for i in ids if i not in created]
    existing = (
        dict(
            session.execute(
                select(Measurement.batch_candidate_id, Measurement.id).where(
                    Measurement.batch_candidate_id.in_(missing)
                )
            ).all()
        )
        if missing
        else {}
    )
    new = [(created[bc_id], rec) for bc_id, rec in items if bc_id in created]
    if new:
        _count_measurements(session, facts=facts, agent_id=agent_id, new=new)
    return [
        Recorded(measurement_id=created[i], created=True)
        if i in created
        else Recorded(measurement_id=existing[i], created=False)
        for i in ids
    ]


def _new_best(cost: float, measurement_id: int, emulated: bool) -> dict[str, Any]:
    """A task's best columns after a valid measurement: it, when it is faster (and
    unconfirmed, until its confirmation comes back)."""
    better = or_(JobTask.best_cost.is_(None), JobTask.best_cost > cost)
    return {
        "best_cost": case((better, cost), else_=JobTask.best_cost),
        "best_measurement_id": case((better, measurement_id), else_=JobTask.best_measurement_id),
        "best_emulated": case((better, emulated), else_=JobTask.best_emulated),
        "best_confirmed": case((better, False), else_=JobTask.best_confirmed),
    }


def _count_measurements(
    session: Session, *, facts: _BatchFacts, agent_id: int | None, new: Sequence[tuple[int, MeasureRecord]]
) -> None:
    """The precomputed progress new measurements (id, record) of one task advance (task,
    job, agent); a new best of the task is scheduled for confirmation."""
    valid = [(r.cost, mid, r.emulated) for mid, r in new if math.isfinite(r.cost)]
    task_values: dict[str, Any] = {"trials": JobTask.trials + len(new)}
    fastest = min(valid) if valid else None
    if fastest is not None:
        task_values.update(_new_best(*fastest))
    opts = {"synchronize_session": False}
    best_id = session.scalar(
        update(JobTask).where(JobTask.id == facts.job_task_id).values(**task_values).returning(JobTask.best_measurement_id),
        execution_options=opts,
    )
    session.execute(
        update(Job).where(Job.id == facts.job_id).values(trials_used=Job.trials_used + len(new)), execution_options=opts
    )
    if agent_id is None:
        return
    _count_agent(session, agent_id=agent_id, new=new)
    if fastest is not None and best_id == fastest[1]:
        confirmations.schedule(session, measurement_id=best_id)


def _count_agent(session: Session, *, agent_id: int, new: Sequence[tuple[int, MeasureRecord]]) -> None:
    agent_values: dict[str, Any] = {"measurements_done": Agent.measurements_done + len(new)}
    errors: dict[str, int] = {}
    for _, rec in new:
        if rec.error_kind.is_error:
            errors[str(rec.error_kind)] = errors.get(str(rec.error_kind), 0) + 1
    if errors:
        pairs: list[Any] = []
        for kind, n in sorted(errors.items()):
            pairs += [kind, func.coalesce(cast(Agent.errors_by_kind[kind].astext, Integer), 0) + n]
        agent_values["errors_by_kind"] = Agent.errors_by_kind.op("||")(func.jsonb_build_object(*pairs))
    below = errors.get(str(ErrorKind.BELOW_FLOOR), 0)
    if below:
        agent_values["below_floor"] = Agent.below_floor + below
    session.execute(
        update(Agent).where(Agent.id == agent_id).values(**agent_values), execution_options={"synchronize_session": False}
    )


# -- the data plane: agents, batched results, lost batches ------------------------------------


def register_agent(
    session: Session,
    *,
    name: str,
    device_class_id: int,
    token_id: int | None,
    capabilities: Mapping[str, Any],
    secret_hash: str | None = None,
    now: datetime | None = None,
) -> Agent:
    """Create the agent `name`, or take it over again after a restart (same name).
    `secret_hash` is the hash of the secret this registration hands the agent; it
    replaces the previous registration's (whose secret is refused from now on).

    An agent registering again holds none of its earlier leases (its process restarted):
    they end now and their batches go back to the queue, instead of waiting for the
    leases to expire. Raises `Conflict` when the name belongs to an agent of another
    token (unless that token was revoked: a board whose token was replaced keeps its
    name)."""
    at = _now(now)
    agent = session.scalars(
        select(Agent).where(Agent.name == name).with_for_update().execution_options(populate_existing=True)
    ).one_or_none()
    if agent is None:
        return session.scalars(
            pg_insert(Agent)
            .values(
                name=name,
                device_class_id=device_class_id,
                token_id=token_id,
                capabilities=dict(capabilities),
                state=AgentState.IDLE,
                last_heartbeat_at=at,
                secret_hash=secret_hash,
            )
            .returning(Agent)
        ).one()
    if agent.token_id is not None and agent.token_id != token_id and not _token_revoked(session, agent.token_id):
        raise Conflict(f"agent name {name!r} is taken by an agent of another token", constraint="uq_agents_name")
    release_agent_leases(session, agent_id=agent.id, now=now)
    state = case((Agent.state == AgentState.DISABLED, Agent.state), else_=AgentState.IDLE)
    return session.scalars(
        update(Agent)
        .where(Agent.id == agent.id)
        .values(
            device_class_id=device_class_id,
            token_id=token_id,
            capabilities=dict(capabilities),
            state=state,
            last_heartbeat_at=at,
            secret_hash=secret_hash,
        )
        .returning(Agent),
        execution_options={"populate_existing": True},
    ).one()


def quarantine_agent(session: Session, *, name: str, now: datetime | None = None) -> Agent:
    """An operator's verdict on an agent's timings: it is leased nothing more (disabled,
    its leases and model runs end now and go back to the queue), and its unconfirmed
    measurements count for nothing: no best of an unfinished job (those are recomputed,
    their confirmations scheduled on other agents) and no cost model. Confirmations it
    gave are undone. Again on a quarantined agent: nothing changes. Raises `NotFound`."""
    agent_id = _agent_id(session, name)
    release_agent_leases(session, agent_id=agent_id, now=now)
    session.execute(
        update(Agent)
        .where(Agent.id == agent_id)
        .values(state=AgentState.DISABLED, quarantined_at=func.coalesce(Agent.quarantined_at, _now(now))),
        execution_options={"synchronize_session": False},
    )
    confirmations.forget_agent(session, agent_id=agent_id, now=now)
    return _fresh_agent(session, agent_id)


def lift_quarantine(session: Session, *, name: str, now: datetime | None = None) -> Agent:
    """Take an agent out of quarantine: it leases again once it heartbeats (offline until
    then), and its measurements count again (the bests of unfinished jobs' tasks it
    measured are recomputed). Raises `NotFound`."""
    agent_id = _agent_id(session, name)
    session.execute(
        update(Agent)
        .where(Agent.id == agent_id, Agent.quarantined_at.is_not(None))
        .values(state=AgentState.OFFLINE, quarantined_at=None),
        execution_options={"synchronize_session": False},
    )
    confirmations.refresh_agent_tasks(session, agent_id=agent_id, now=now)
    return _fresh_agent(session, agent_id)


def clear_flags(session: Session, *, name: str) -> Agent:
    """An operator's pardon of a flagged agent (`tunefarm farm agent unflag`): its results
    below the floor and its disputed timings no longer count against it, so it is leased
    work again (a flagged agent is leased nothing, so nothing else could clear them). Its
    measurements keep their verdicts: a disputed one stays disputed, one below the floor
    an error. Raises `NotFound`."""
    agent_id = _agent_id(session, name)
    session.execute(
        update(Agent).where(Agent.id == agent_id).values(below_floor=0, confirmations_disputed=0),
        execution_options={"synchronize_session": False},
    )
    return _fresh_agent(session, agent_id)


def _agent_id(session: Session, name: str) -> int:
    agent_id = session.scalar(select(Agent.id).where(Agent.name == name))
    if agent_id is None:
        raise NotFound(f"agent {name!r}")
    return int(agent_id)


def _fresh_agent(session: Session, agent_id: int) -> Agent:
    return session.scalars(
        select(Agent).where(Agent.id == agent_id).execution_options(populate_existing=True)
    ).one()


def release_agent_leases(
    session: Session,
    *,
    agent_id: int,
    keep_lease_ids: Sequence[int] = (),
    keep_model_run_ids: Sequence[int] = (),
    now: datetime | None = None,
) -> list[int]:
    """End the agent's active leases (expired) and leased model runs, but for those it
    still holds (`keep_*`), and put their batches and runs back in the queue at once;
    returns the batch ids."""
    batch_ids = list(
        session.scalars(
            select(Lease.batch_id).where(
                Lease.agent_id == agent_id, Lease.state == LeaseState.ACTIVE, Lease.id.not_in(sorted(set(keep_lease_ids)))
            )
        )
    )
    for batch_id in sorted(batch_ids):  # lock order: the batch, then (in transition_batch) its lease
        batch = session.scalars(select(Batch).where(Batch.id == batch_id).with_for_update()).one()
        if batch.state is BatchState.LEASED:
            transition_batch(session, batch_id=batch_id, to=BatchState.READY, now=now)
    session.execute(
        update(ModelRun)
        .where(
            ModelRun.agent_id == agent_id,
            ModelRun.state == ModelRunState.LEASED,
            ModelRun.id.not_in(sorted(set(keep_model_run_ids))),
        )
        .values(state=ModelRunState.READY, expires_at=None),
        execution_options={"synchronize_session": False},
    )
    return sorted(batch_ids)


def record_measurements(
    session: Session,
    *,
    lease_id: int,
    agent_id: int,
    items: Sequence[tuple[int, MeasureRecord]],
    fingerprint: Mapping[str, Any],
) -> list[Recorded]:
    """`record_measurement` for many candidates of one lease in a handful of statements
    (one lease check, one insert, one update each of the task, the job and the agent),
    whatever their number. Same rules: refused (`LeaseNotHeld`) unless the lease is
    active, the agent's, and on every candidate's batch; exactly once per candidate.
    Returns one `Recorded` per item, in order."""
    if not items:
        return []
    lease = _held_lease(session, lease_id=lease_id, agent_id=agent_id, lock=False)
    ids = [bc_id for bc_id, _ in items]
    if len(set(ids)) != len(ids):
        raise ValueError("the same batch candidate twice in one call")
    keys = dict(
        session.execute(
            select(BatchCandidate.id, BatchCandidate.candidate_key).where(
                BatchCandidate.id.in_(ids), BatchCandidate.batch_id == lease.batch_id
            )
        ).all()
    )
    foreign = [i for i in ids if i not in keys]
    if foreign:
        raise LeaseNotHeld(f"lease {lease_id} is on batch {lease.batch_id}, not on candidates {foreign[:5]}")
    for bc_id, rec in items:
        if rec.candidate.key != keys[bc_id]:
            raise ValueError(f"record of {rec.candidate.key!r} given for candidate {keys[bc_id]!r}")
    return _store_results(session, batch_id=lease.batch_id, lease=lease, items=items, fingerprint=fingerprint)


def abandon_batch(
    session: Session,
    *,
    batch_id: int,
    reason: str,
    error_kind: ErrorKind = ErrorKind.RUN_CRASH,
    fingerprint: Mapping[str, Any] | None = None,
    now: datetime | None = None,
) -> int:
    """Give a batch up: each unmeasured candidate gets an error measurement (`error_kind`,
    `reason`; no agent, no lease; in a confirmation batch, an error confirmation: the
    measurement it checks is not confirmed), and the batch fails (ending its active lease). For a
    batch that can never be measured (it was leased again and again and no agent ever
    finished it), so that every candidate still has exactly one result. Returns the
    number of candidates given up; 0 for a batch already done or failed."""
    batch = session.scalars(
        select(Batch).where(Batch.id == batch_id).with_for_update().execution_options(populate_existing=True)
    ).one_or_none()
    if batch is None:
        raise NotFound(f"batch {batch_id}")
    if batch.state.is_terminal:
        return 0
    workload_name, target = session.execute(
        select(Workload.name, DeviceClass.target)
        .join(Batch, Batch.workload_id == Workload.id)
        .join(DeviceClass, DeviceClass.id == Batch.device_class_id)
        .where(Batch.id == batch_id)
    ).one()
    lost = unmeasured_candidates(session, batch_id=batch_id)
    stamp = time.time()
    items = []
    for cand in lost:
        inp = input_from_json(cand.input)
        run: RunResult | None
        if error_kind in (ErrorKind.BUILD_ERROR, ErrorKind.BUILD_TIMEOUT):
            build, run = BuildResult(cand.candidate_key, None, 0.0, error_kind, reason), None
        else:
            build = build_from_json(cand.build) if cand.build else BuildResult(cand.candidate_key, None, 0.0)
            run = RunResult(cand.candidate_key, (), 0.0, error_kind, reason)
        items.append((cand.id, MeasureRecord.of(MeasureResult(inp, build, run), workload=workload_name, target=target, timestamp=stamp)))
    if items:
        _store_results(session, batch_id=batch_id, lease=None, items=items, fingerprint=dict(fingerprint or {}))
    transition_batch(session, batch_id=batch_id, to=BatchState.FAILED, build_error=reason, now=now)
    return len(lost)


# -- cost models ------------------------------------------------------------------------------


def add_cost_model_version(
    session: Session,
    *,
    device_class_id: int,
    feature_version: int,
    path: str,
    sha256: str,
    size: int,
    trained_on: int,
    last_measurement_id: int | None,
    transferred_from_id: int | None = None,
) -> CostModelVersion:
    """Store the class's next cost model version (1 + the latest). Two concurrent writers
    get a `Conflict` for one of them (unique class + version) at flush or commit."""
    latest = select(func.coalesce(func.max(CostModelVersion.version), 0) + 1).where(
        CostModelVersion.device_class_id == device_class_id
    )
    return session.scalars(
        insert(CostModelVersion).returning(CostModelVersion),
        [
            {
                "device_class_id": device_class_id,
                "version": session.scalar(latest),
                "feature_version": feature_version,
                "path": path,
                "sha256": sha256,
                "size": size,
                "trained_on": trained_on,
                "last_measurement_id": last_measurement_id,
                "transferred_from_id": transferred_from_id,
            }
        ],
    ).one()


def latest_cost_model_version(
    session: Session, *, device_class_id: int, feature_version: int | None = None
) -> CostModelVersion | None:
    """The class's newest cost model (of `feature_version`, when given), or None."""
    query = select(CostModelVersion).where(CostModelVersion.device_class_id == device_class_id)
    if feature_version is not None:
        query = query.where(CostModelVersion.feature_version == feature_version)
    return session.scalars(query.order_by(CostModelVersion.version.desc()).limit(1)).one_or_none()


def latest_cost_models_of_classes(session: Session, *, feature_version: int) -> list[tuple[DeviceClass, CostModelVersion]]:
    """Every class that has a cost model of `feature_version`, with its newest one."""
    newest = (
        select(CostModelVersion.device_class_id, func.max(CostModelVersion.version).label("version"))
        .where(CostModelVersion.feature_version == feature_version)
        .group_by(CostModelVersion.device_class_id)
        .subquery()
    )
    rows = session.execute(
        select(DeviceClass, CostModelVersion)
        .join(CostModelVersion, CostModelVersion.device_class_id == DeviceClass.id)
        .join(
            newest,
            (newest.c.device_class_id == CostModelVersion.device_class_id) & (newest.c.version == CostModelVersion.version),
        )
        .order_by(DeviceClass.name)
    ).all()
    return [(dc, version) for dc, version in rows]


# -- model runs -------------------------------------------------------------------------------


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
    now: datetime | None = None,
) -> ModelRun:
    """Queue a tuned model for an agent of the class. The job's earlier runs still open
    (a restarted scheduler finishing the job again) fail as superseded."""
    at = _now(now)
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
        .values(state=ModelRunState.FAILED, error=reason, finished_at=_now(now)),
        execution_options={"synchronize_session": False},
    )
    return bool(done.rowcount)


def lease_model_run(
    session: Session, *, agent_id: int, lease_secs: float, max_attempts: int, now: datetime | None = None
) -> ModelRun | None:
    """Lease the oldest model run of the agent's class that is ready, or whose lease
    expired (its agent stopped heartbeating); None when there is none. A run already
    leased `max_attempts` times fails instead (no agent finishes it: it may be what kills
    them). `FOR UPDATE SKIP LOCKED`, like `lease_next_batch`. Raises `NotFound` for an
    unknown agent."""
    agent = session.get(Agent, agent_id)
    if agent is None:
        raise NotFound(f"agent {agent_id}")
    if not _may_lease(session, agent):
        return None
    at = _now(now)
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
        _mark_busy(session, agent_id)
        return leased
    return None


def held_model_run(session: Session, *, model_run_id: int, agent_id: int, lock: bool = False) -> ModelRun:
    """The model run, if the agent holds it (leased to it, even past `expires_at` until
    another agent leases it); else `LeaseNotHeld` (`NotFound` if absent)."""
    run = _row(session, ModelRun, model_run_id, lock=lock)
    if run is None:
        raise NotFound(f"model run {model_run_id}")
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
    now: datetime | None = None,
) -> ModelRun:
    """The agent ran (or could not run) the model: done with its outputs, or failed with
    the agent's error. Raises `LeaseNotHeld` unless the agent holds the run."""
    held_model_run(session, model_run_id=model_run_id, agent_id=agent_id, lock=True)
    return session.scalars(
        update(ModelRun)
        .where(ModelRun.id == model_run_id)
        .values(
            state=ModelRunState.FAILED if error else ModelRunState.DONE,
            outputs_path=outputs_path,
            result=dict(result),
            error=error or None,
            finished_at=_now(now),
        )
        .returning(ModelRun),
        execution_options={"populate_existing": True},
    ).one()
