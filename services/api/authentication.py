"""Who a request is: the team of its bearer token, known before its body is read.

`TeamAuthentication` (ASGI middleware) authenticates every request under `/v1/` from
its headers alone and answers 401 (no token, an unknown or revoked one) or 403 (an
agent token) before the application reads one byte of the body: FastAPI parses a form
(an upload of hundreds of MiB) before it solves a handler's dependencies, so a check in
a dependency would come after the whole body was read and spooled to disk. A refusal
then closes the connection (`limits.BodySizeLimit` reads at most a lingering close's
worth of the rest). The team goes into the request's state, where `deps.TeamDep` finds
it.

Tokens are verified through the process's cache (`VerifiedTokens`): a token verified in
the last `token_cache_secs` costs no thread hop and no query; a revoked one is dropped
from it at once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from fastapi import Request
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

from services.api.exceptions import ApiError, Forbidden, Unauthorized, error_response
from services.db import tokens
from services.db.exceptions import DatabaseError, Unavailable
from services.db.revocations import VerifiedTokens
from services.db.session import SessionFactory, transaction
from services.db.states import TokenKind

log = logging.getLogger("tunefarm.api")

TEAM_API_PREFIX = "/v1/"
"""Every path under it needs a team token."""


@dataclass(frozen=True)
class Team:
    """The authenticated team of a request."""

    id: int
    token_id: int


def bearer_token(request: Request) -> str | None:
    """The token of an `Authorization: Bearer <token>` header; None without one."""
    scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
    token = credentials.strip()
    return token if scheme.lower() == "bearer" and token else None


async def team_of_token(request: Request, sessions: SessionFactory, plain: str) -> Team:
    """The team of a plain team token (`Unauthorized`, or `Forbidden` for an agent
    token), through the process's token cache. The dashboard's login checks with it too."""
    cache: VerifiedTokens[Team] = request.app.state.token_cache
    token_hash = tokens.hash_token(plain)
    team = cache.get(token_hash)
    if team is None:
        team = await run_in_threadpool(_verify_team_token, sessions, plain)
        cache.put(token_hash, team)
    return team


def _verify_team_token(sessions: SessionFactory, plain: str) -> Team:
    with transaction(sessions) as db:
        token = tokens.verify_token(db, plain=plain, kind=TokenKind.TEAM)
        if token is None:
            if tokens.verify_token(db, plain=plain, kind=TokenKind.AGENT) is not None:
                raise Forbidden("an agent token cannot be used on the team API; use a team token")
            raise Unauthorized("unknown or revoked token")
        assert token.team_id is not None
        return Team(id=token.team_id, token_id=token.id)


async def authenticate(request: Request) -> Team:
    """The request's team from its headers (raises `Unauthorized` or `Forbidden`)."""
    plain = bearer_token(request)
    if plain is None:
        raise Unauthorized("missing bearer token: send 'Authorization: Bearer <team token>'")
    return await team_of_token(request, request.app.state.sessions, plain)


class TeamAuthentication:
    """ASGI middleware: the team of every `/v1/` request, from its headers, before the
    application runs (see the module docstring)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(TEAM_API_PREFIX):
            await self.app(scope, receive, send)
            return
        request = Request(scope)  # no `receive`: nothing here can read the body
        try:
            team = await authenticate(request)
        except ApiError as exc:
            await error_response(exc.status, exc.code, exc.message, headers=exc.headers or None)(scope, receive, send)
            return
        except Unavailable:
            await error_response(503, "unavailable", "the database cannot be reached; try again shortly")(
                scope, receive, send
            )
            return
        except DatabaseError:
            log.exception("database error while authenticating")
            await error_response(500, "internal_error", "the database refused the request")(scope, receive, send)
            return
        scope.setdefault("state", {})["team"] = team
        await self.app(scope, receive, send)
