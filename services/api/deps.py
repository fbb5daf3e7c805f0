"""The API's dependencies, as `Annotated` aliases handlers declare by type:

    def get_job(job_id: int, team: TeamDep, sessions: SessionsDep) -> JobPublic:
        with transaction(sessions) as db:
            return crud.job_public(db, team_id=team.id, job_id=job_id)

- `SettingsDep`: the process's `ApiSettings`;
- `SessionsDep`: the session factory; a handler opens its one transaction with
  `services.db.session.transaction` (committed before the response is sent, rolled back
  on error). Not a `yield` dependency: FastAPI runs one of those in two extra thread
  hops per request (~1 ms of CPU here, as much as the whole progress endpoint's work);
- `TeamDep`: the team of the request's bearer token (401 without a valid team token,
  403 for an agent token);
- `PageDep`: `limit` and `cursor` query parameters of list endpoints;
- `IntakeDep`: the pool of child processes that import uploaded models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Query, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from services.api.exceptions import Forbidden, Unauthorized
from services.api.intake_pool import IntakePool
from services.api.settings import ApiSettings
from services.db import queries
from services.db.models import TokenKind
from services.db.revocations import VerifiedTokens
from services.db.session import transaction


async def get_settings(request: Request) -> ApiSettings:
    return request.app.state.settings


async def get_sessions(request: Request) -> sessionmaker[Session]:
    return request.app.state.sessions


async def get_intake(request: Request) -> IntakePool:
    return request.app.state.intake


SettingsDep = Annotated[ApiSettings, Depends(get_settings)]
SessionsDep = Annotated[sessionmaker[Session], Depends(get_sessions)]
IntakeDep = Annotated[IntakePool, Depends(get_intake)]


# -- authentication ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Team:
    """The authenticated team of a request."""

    id: int
    token_id: int


bearer = HTTPBearer(auto_error=False, description="a team token (tft_...) issued by the farm's operator")


async def get_team(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
    sessions: SessionsDep,
) -> Team:
    """The request's team. Async: a token verified in the last `token_cache_secs` costs no
    thread hop and no query (pollers of the progress endpoint)."""
    if credentials is None or credentials.scheme.lower() != "bearer" or not credentials.credentials:
        raise Unauthorized("missing bearer token: send 'Authorization: Bearer <team token>'")
    return await team_of_token(request, sessions, credentials.credentials)


async def team_of_token(request: Request, sessions: sessionmaker[Session], plain: str) -> Team:
    """The team of a plain team token (`Unauthorized`, or `Forbidden` for an agent
    token), through the process's token cache. The dashboard's pages authenticate with
    it too (the token from their cookie)."""
    cache: VerifiedTokens[Team] = request.app.state.token_cache
    token_hash = queries.hash_token(plain)
    team = cache.get(token_hash)
    if team is None:
        team = await run_in_threadpool(_verify_team_token, sessions, plain)
        cache.put(token_hash, team)
    return team


def _verify_team_token(sessions: sessionmaker[Session], plain: str) -> Team:
    with transaction(sessions) as db:
        token = queries.verify_token(db, plain=plain, kind=TokenKind.TEAM)
        if token is None:
            if queries.verify_token(db, plain=plain, kind=TokenKind.AGENT) is not None:
                raise Forbidden("an agent token cannot be used on the team API; use a team token")
            raise Unauthorized("unknown or revoked token")
        assert token.team_id is not None
        return Team(id=token.team_id, token_id=token.id)


TeamDep = Annotated[Team, Depends(get_team)]


# -- pagination -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Page:
    limit: int
    cursor: int | None  # items with an id below this one (newest first)


async def get_page(
    settings: SettingsDep,
    limit: Annotated[int | None, Query(ge=1, description="items per page (at most the server's maximum)")] = None,
    cursor: Annotated[int | None, Query(ge=1, description="the `next_cursor` of the previous page")] = None,
) -> Page:
    size = settings.page_size_default if limit is None else min(limit, settings.page_size_max)
    return Page(limit=size, cursor=cursor)


PageDep = Annotated[Page, Depends(get_page)]
