"""The dashboard's server-side sessions: what its cookie holds instead of the team token.

Logging in with a team token opens a session: a random id (256 bits) goes into the
cookie, and only its sha256 is stored (`DashboardSession`), with the team, the token it
was opened with and its expiry. A page's cookie is looked up by that hash; the session
counts while it has not expired and its token is not revoked. Logging out deletes it,
so a copied cookie is worthless afterwards, and the team token never travels in a
cookie (nor sits in the browser).

Every function works inside the caller's transaction and commits nothing itself.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import delete, func, insert, select
from sqlalchemy.orm import Session

from services.db.models import DashboardSession, Token

SESSION_ID_BYTES = 32
"""Random bytes of a session id (256 bits: its unsalted sha256 cannot be brute-forced)."""


def _hash(session_id: str) -> str:
    return hashlib.sha256(session_id.encode()).hexdigest()


@dataclass(frozen=True)
class SessionTeam:
    """Whose a dashboard session is: the team, and the token it was opened with."""

    team_id: int
    token_id: int


def open_session(session: Session, *, team_id: int, token_id: int, lifetime_secs: float) -> str:
    """A new session of the team `team_id`, opened with its token `token_id`, for
    `lifetime_secs`; its id (for the cookie), never stored. Expired sessions are deleted
    on the way."""
    session.execute(delete(DashboardSession).where(DashboardSession.expires_at < func.now()))
    session_id = secrets.token_urlsafe(SESSION_ID_BYTES)
    session.execute(
        insert(DashboardSession).values(
            session_hash=_hash(session_id),
            team_id=team_id,
            token_id=token_id,
            expires_at=func.now() + timedelta(seconds=lifetime_secs),
        )
    )
    return session_id


def team_of_session(session: Session, *, session_id: str) -> SessionTeam | None:
    """The team of a live session (not expired, its token not revoked); None otherwise."""
    row = session.execute(
        select(DashboardSession.team_id, DashboardSession.token_id)
        .join(Token, Token.id == DashboardSession.token_id)
        .where(
            DashboardSession.session_hash == _hash(session_id),
            DashboardSession.expires_at > func.now(),
            Token.revoked_at.is_(None),
        )
    ).one_or_none()
    return None if row is None else SessionTeam(team_id=row.team_id, token_id=row.token_id)


def close_session(session: Session, *, session_id: str) -> bool:
    """Delete the session; whether there was one."""
    result = session.execute(delete(DashboardSession).where(DashboardSession.session_hash == _hash(session_id)))
    return bool(result.rowcount)
