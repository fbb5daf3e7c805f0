"""Operator actions on the farm's database (the `tunefarm farm` commands; not on the API):
teams and their tokens, agent tokens, device classes.

Keyword-only functions over the caller's session, like `crud`; a token's plain text is
returned once and never stored.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

from services.db import queries
from services.db.models import DeviceClass, Team, Token, TokenKind


def ensure_team(session: Session, *, name: str) -> Team:
    """The team `name`, created if it does not exist."""
    session.execute(pg_insert(Team).values(name=name).on_conflict_do_nothing(index_elements=[Team.name]))
    return session.scalars(select(Team).where(Team.name == name)).one()


def issue_team_token(session: Session, *, team_id: int, label: str = "") -> str:
    """A new bearer token of the team (plain text; only its hash is stored)."""
    return queries.issue_token(session, kind=TokenKind.TEAM, team_id=team_id, label=label)[1]


def issue_agent_token(session: Session, *, label: str = "") -> str:
    """A new agent token: it registers agents on the lease service and nothing else."""
    return queries.issue_token(session, kind=TokenKind.AGENT, label=label)[1]


def register_token(session: Session, *, kind: TokenKind, plain: str, team_id: int | None = None, label: str = "") -> None:
    """Store a token chosen by the operator (a deployment's secret), if not stored yet.
    It must look like one of ours (`tft_`/`tfa_` and at least 32 characters)."""
    prefix = queries.TOKEN_PREFIXES[kind]
    if not plain.startswith(prefix) or len(plain) < len(prefix) + 32:
        raise ValueError(f"a {kind.value} token starts with {prefix} and has at least 32 characters after it")
    session.execute(
        pg_insert(Token)
        .values(kind=kind, team_id=team_id, token_hash=queries.hash_token(plain),
                prefix=plain[: queries.TOKEN_DISPLAY_CHARS], label=label)
        .on_conflict_do_nothing(index_elements=[Token.token_hash])
    )


def ensure_device_class(
    session: Session, *, name: str, target: dict[str, Any], description: str = ""
) -> DeviceClass:
    """The device class `name`, created with `target` if it does not exist (an existing
    class keeps its target: its measurements were made for it)."""
    session.execute(
        pg_insert(DeviceClass)
        .values(name=name, target=target, description=description)
        .on_conflict_do_nothing(index_elements=[DeviceClass.name])
    )
    return session.scalars(select(DeviceClass).where(DeviceClass.name == name)).one()
