"""Operator actions on the farm's database (the `tunefarm farm` commands; not on the API):
teams and their tokens, agent tokens (issued, listed, revoked), device classes, agent
names handed to a new token (`claim_agent_names`, what `farm up` does for its agents).

Keyword-only functions over the caller's session, like `crud`; a token's plain text is
returned once and never stored.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

from services.db import agents, liveness, tokens
from services.db.exceptions import NotFound
from services.db.models import Agent, AgentState, DeviceClass, Team, Token, TokenKind


class AgentNamesInUse(ValueError):
    """`claim_agent_names`: a name belongs to a live agent of another token."""


def ensure_team(session: Session, *, name: str) -> Team:
    """The team `name`, created if it does not exist."""
    session.execute(pg_insert(Team).values(name=name).on_conflict_do_nothing(index_elements=[Team.name]))
    return session.scalars(select(Team).where(Team.name == name)).one()


def issue_team_token(session: Session, *, team_id: int, label: str = "") -> str:
    """A new bearer token of the team (plain text; only its hash is stored)."""
    return tokens.issue_token(session, kind=TokenKind.TEAM, team_id=team_id, label=label)[1]


def issue_agent_token(session: Session, *, label: str = "") -> str:
    """A new agent token: it registers agents on the lease service and nothing else."""
    return tokens.issue_token(session, kind=TokenKind.AGENT, label=label)[1]


def register_token(session: Session, *, kind: TokenKind, plain: str, team_id: int | None = None, label: str = "") -> None:
    """Store a token chosen by the operator (a deployment's secret), if not stored yet.
    It must look like one of ours (`tft_`/`tfa_` and at least 32 characters)."""
    prefix = tokens.TOKEN_PREFIXES[kind]
    if not plain.startswith(prefix) or len(plain) < len(prefix) + 32:
        raise ValueError(f"a {kind.value} token starts with {prefix} and has at least 32 characters after it")
    session.execute(
        pg_insert(Token)
        .values(kind=kind, team_id=team_id, token_hash=tokens.hash_token(plain),
                prefix=plain[: tokens.TOKEN_DISPLAY_CHARS], label=label)
        .on_conflict_do_nothing(index_elements=[Token.token_hash])
    )


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
    if not ref.startswith(tuple(tokens.TOKEN_PREFIXES.values())):
        raise ValueError(f"{ref!r} is not a token id, a token prefix (tft_..., tfa_...) or a token")
    exact = session.scalars(select(Token).where(Token.token_hash == tokens.hash_token(ref))).one_or_none()
    if exact is not None:
        return exact
    if len(ref) > tokens.TOKEN_DISPLAY_CHARS:
        raise ValueError("no such token")
    matches = list(session.scalars(select(Token).where(Token.prefix.startswith(ref, autoescape=True)).limit(10)))
    if not matches:
        raise ValueError(f"no token starts with {ref!r}")
    if len(matches) > 1:
        raise ValueError(f"{ref!r} names {len(matches)} tokens (ids {', '.join(str(t.id) for t in matches)}): give the id")
    return matches[0]


def revoke_token(session: Session, *, ref: str) -> Token:
    """Revoke the token `ref` names (`find_token`): the API and the lease service refuse it
    at once, and an agent token's agents get no more work (`tokens.revoke_token`)."""
    token = find_token(session, ref=ref)
    try:
        return tokens.revoke_token(session, token_id=token.id)
    except NotFound as exc:  # deleted in between
        raise ValueError(str(exc)) from None


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


def agent_token_id(session: Session, *, plain: str) -> int | None:
    """The id of the agent token `plain` (None: not a stored agent token)."""
    return session.scalar(
        select(Token.id).where(Token.token_hash == tokens.hash_token(plain), Token.kind == TokenKind.AGENT)
    )


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
        select(Agent, liveness.live_clause(fresh_secs))
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
        agents.release_agent_leases(session, agent_id=agent.id)
        agent.token_id = token_id
        if agent.state is not AgentState.DISABLED:
            agent.state = AgentState.OFFLINE
        handed.append(agent.name)
    session.flush()
    return handed

