"""Team and agent tokens: `new_token`, `hash_token`, `issue_token`, `verify_token`, `revoke_token`.

Every function works inside the caller's transaction (`session.transaction`) and commits nothing itself.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, insert, select, update
from sqlalchemy.orm import Session

from services.db.agents import release_agent_leases
from services.db.exceptions import NotFound
from services.db.models import Agent, AgentState, Token, TokenKind
from services.db.revocations import CHANNEL as REVOCATION_CHANNEL
from services.db.statements import db_now

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
