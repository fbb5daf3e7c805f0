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
  403 for an agent token), checked before the body was read (`authentication.py`);
- `PageDep`: `limit` and `cursor` query parameters of list endpoints;
- `IntakeDep`: the pool of child processes that import uploaded models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Query, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from services.api.authentication import Team, authenticate
from services.api.intake_pool import IntakePool
from services.api.settings import ApiSettings
from services.db.session import SessionFactory


async def get_settings(request: Request) -> ApiSettings:
    return request.app.state.settings


async def get_sessions(request: Request) -> SessionFactory:
    return request.app.state.sessions


async def get_intake(request: Request) -> IntakePool:
    return request.app.state.intake


SettingsDep = Annotated[ApiSettings, Depends(get_settings)]
SessionsDep = Annotated[SessionFactory, Depends(get_sessions)]
IntakeDep = Annotated[IntakePool, Depends(get_intake)]


# -- authentication ---------------------------------------------------------------------------


bearer = HTTPBearer(auto_error=False, description="a team token (tft_...) issued by the farm's operator")


async def get_team(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> Team:
    """The request's team: authenticated from its headers before the body was read
    (`authentication.TeamAuthentication`); `credentials` puts the bearer scheme in the
    OpenAPI schema."""
    team = getattr(request.state, "team", None)
    return team if team is not None else await authenticate(request)


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
