"""Team and agent tokens: `new_token`, `hash_token`, `issue_token`, `verify_token`, `revoke_token`;
the operator's side (the `tunefarm farm` commands): `issue_team_token`, `issue_agent_token`,
`register_token` (a token the operator chose), `list_tokens`, `find_token` and
`revoke_token_by_ref` (a token named by id, prefix or text), `agent_token_id`, and
`claim_agent_names` (agent names handed to a new agent token). A token's plain text is
returned once and never stored.

Every function works inside the caller's transaction (`session.transaction`) and commits nothing itself.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, insert, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

from services.db.agents import release_agent_leases
from services.db.exceptions import RowNotFound
from services.db.liveness import live_clause
from services.db.models import Agent, Team, Token
from services.db.revocations import CHANNEL as REVOCATION_CHANNEL
from services.db.statements import db_now
from services.db.states import AgentState, TokenKind

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
    offline. Raises `RowNotFound` for an unknown token."""
    token = session.scalars(
        select(Token).where(Token.id == token_id).with_for_update().execution_options(populate_existing=True)
    ).one_or_none()
    if token is None:
        raise RowNotFound(f"token {token_id}")
    if token.revoked_at is None:
        token = session.scalars(
            update(Token).where(Token.id == token_id).values(revoked_at=db_now(now)).returning(Token),
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


# -- the operator's side ----------------------------------------------------------------------


def issue_team_token(session: Session, *, team_id: int, label: str = "") -> str:
    """A new bearer token of the team (plain text; only its hash is stored)."""
    return issue_token(session, kind=TokenKind.TEAM, team_id=team_id, label=label)[1]


def issue_agent_token(session: Session, *, label: str = "") -> str:
    """A new agent token: it registers agents on the lease service and nothing else."""
    return issue_token(session, kind=TokenKind.AGENT, label=label)[1]


def register_token(session: Session, *, kind: TokenKind, plain: str, team_id: int | None = None, label: str = "") -> None:
    """Store a token chosen by the operator (a deployment's secret), if not stored yet.
    It must look like one of ours (`tft_`/`tfa_` and at least 32 characters)."""
    prefix = TOKEN_PREFIXES[kind]
    if not plain.startswith(prefix) or len(plain) < len(prefix) + 32:
        raise ValueError(f"a {kind.value} token starts with {prefix} and has at least 32 characters after it")
    session.execute(
        pg_insert(Token)
        .values(kind=kind, team_id=team_id, token_hash=hash_token(plain),
                prefix=plain[:TOKEN_DISPLAY_CHARS], label=label)
        .on_conflict_do_nothing(index_elements=[Token.token_hash])
    )  # fmt: skip


def list_tokens(session: Session, *, team: str | None = None, kind: TokenKind | None = None) -> list[Token]:
    """Tokens (their team loaded), oldest first; of one team, or of one kind. Raises
    `ValueError` for an unknown team."""
    query = select(Token).order_by(Token.id)
    if team is not None:
        team_id = session.scalar(select(Team.id).where(Team.name == team))
        if team_id is None:
            raise ValueError(f"no team {team!r}")
        query = query.where(Token.team_id == team_id)
    if kind is not None:
        query = query.where(Token.kind == kind)
    tokens = list(session.scalars(query))
    for t in tokens:
        _ = t.team  # loaded for the caller, who reads it after the session
    return tokens


def find_token(session: Session, *, ref: str) -> Token:
    """The token `ref` names: its id, the prefix `tunefarm farm token list` shows (the
    first characters, `tft_...`/`tfa_...`), or the whole token. `ValueError` when none
    or several match."""
    ref = ref.strip()
    if ref.isdigit():
        token = session.get(Token, int(ref))
        if token is None:
            raise ValueError(f"no token with id {ref}")
        return token
    if not ref.startswith(tuple(TOKEN_PREFIXES.values())):
        raise ValueError(f"{ref!r} is not a token id, a token prefix (tft_..., tfa_...) or a token")
    exact = session.scalars(select(Token).where(Token.token_hash == hash_token(ref))).one_or_none()
    if exact is not None:
        return exact
    if len(ref) > TOKEN_DISPLAY_CHARS:
        raise ValueError("no such token")
    matches = list(session.scalars(select(Token).where(Token.prefix.startswith(ref, autoescape=True)).limit(10)))
    if not matches:
        raise ValueError(f"no token starts with {ref!r}")
    if len(matches) > 1:
        raise ValueError(f"{ref!r} names {len(matches)} tokens (ids {', '.join(str(t.id) for t in matches)}): give the id")
    return matches[0]


def revoke_token_by_ref(session: Session, *, ref: str) -> Token:
    """Revoke the token `ref` names (`find_token`): the API and the lease service refuse it
    at once, and an agent token's agents get no more work (`revoke_token`). `ValueError`
    when `ref` names no token."""
    token = find_token(session, ref=ref)
    try:
        return revoke_token(session, token_id=token.id)
    except RowNotFound as exc:  # deleted in between
        raise ValueError(str(exc)) from None


def agent_token_id(session: Session, *, plain: str) -> int | None:
    """The id of the agent token `plain` (None: not a stored agent token)."""
    return session.scalar(select(Token.id).where(Token.token_hash == hash_token(plain), Token.kind == TokenKind.AGENT))


class AgentNamesInUse(ValueError):
    """`claim_agent_names`: a name belongs to a live agent of another token."""


def claim_agent_names(
    session: Session, *, names: list[str], token_id: int, fresh_secs: float, ours: frozenset[int] = frozenset()
) -> list[str]:
    """Hand the agent names `names` to the agent token `token_id`, so that agents with
    that token register under them (`agents.register_agent` refuses a name another
    token's agent holds). An operator's act: `farm up` issues a new agent token at each
    start, and the agents of its previous start, stopped by `farm down`, hold the names.

    A name held by a live agent (`services.db.liveness`) of another token is not taken
    (`AgentNamesInUse`, nothing changed), unless that token is in `ours` (the previous
    start's own token: its processes are known to be stopped). A name handed over is
    offline until its agent registers (a quarantined one stays disabled), and the leases
    its previous agent held end now. Returns the names handed over."""
    rows = session.execute(
        select(Agent, live_clause(fresh_secs))
        .where(Agent.name.in_(names))
        .order_by(Agent.name)
        .with_for_update(of=Agent)
    ).all()
    taken = [a for a, live in rows if a.token_id != token_id and live and a.token_id not in ours]
    if taken:
        raise AgentNamesInUse(
            "agent name(s) " + ", ".join(repr(a.name) for a in taken) + " are in use by live agents of another "
            f"token (heartbeat within {fresh_secs:g} s): another farm on this database? stop it, or start this one "
            "from another --state-dir"
        )
    handed = []
    for agent, _live in rows:
        if agent.token_id == token_id:
            continue
        release_agent_leases(session, agent_id=agent.id)
        agent.token_id = token_id
        if agent.state is not AgentState.DISABLED:
            agent.state = AgentState.OFFLINE
        handed.append(agent.name)
    session.flush()
    return handed
