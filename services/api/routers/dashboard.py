"""The dashboard: server-rendered HTML pages under `/ui` for people, on the same data and
the same team tokens as the JSON API.

- `/ui/login`: the user pastes a team token; it is checked like a bearer token and
  opens a server-side session (`services/db/dashboard_sessions.py`): the cookie holds the session's
  random id, never the token (`HttpOnly`, `SameSite=Strict`, `Secure` over HTTPS, path
  `/ui`). Every page reads it; a request without a live session is sent to the login
  page (303). `Authorization: Bearer` works on the pages too (scripts, tests).
  `/ui/logout` deletes the session.
- the pages: the team's jobs (`dashboard_jobs.py`) and the farm's devices
  (`dashboard_devices.py`), each a router of its own on the helpers here: `page_team`
  (who is asking), `to_login`, `page` (a template), `error_page` (an API error as a
  page), `cross_site` and `refuse_cross_site` (form posts).

Cross-site requests: a POST (login, logout, cancelling a job) must come from a page of
this site: its `Origin` header (else its `Referer`'s origin) must be the request's own
origin or one of `ApiSettings.ui_trusted_origins` (a proxy's public origin); otherwise it
is refused (403) and changes nothing: another site can neither log a visitor in to its
own team (login CSRF) nor out, nor cancel a job (the `SameSite=Strict` cookie is not
sent with another site's post either). Every response carries the security headers of
`security_headers.py` (no script, no framing).

Pages of running jobs and the devices page reload themselves every few seconds (a meta
refresh: the pages have no script). The pages are not in the OpenAPI schema: they are
not part of the API.
"""

from __future__ import annotations

from pathlib import Path as FsPath
from typing import Annotated
from urllib.parse import urlsplit

from fastapi import APIRouter, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates

from services.api.authentication import Team, bearer_token, team_of_token
from services.api.deps import SessionsDep, SettingsDep
from services.api.exceptions import ApiError, Forbidden, Unauthorized
from services.api.settings import ApiSettings
from services.db import dashboard_sessions
from services.db.session import SessionFactory, transaction
from tunefarm.display import PAGE_CSS, PLOT_CSS, format_cost, format_duration
from tunefarm.models.peers import ONNXRUNTIME, OPENVINO

PREFIX = "/ui"
COOKIE = "tunefarm_session"
REFRESH_SECS = 5
"""How often pages that change (running jobs, devices) reload themselves."""
JOBS_PER_PAGE = 50

ACTIVE_STATES = frozenset({"queued", "running", "finishing"})

router = APIRouter(prefix=PREFIX, include_in_schema=False)
templates = Jinja2Templates(directory=FsPath(__file__).resolve().parents[1] / "templates")
templates.env.filters["cost"] = format_cost
templates.env.filters["duration"] = format_duration
templates.env.globals["css"] = PAGE_CSS + PLOT_CSS
templates.env.globals["progress_help"] = (
    "the search's estimated latency at the start over its estimate now: how far the search has come on its own "
    "cost estimate, not a measured speed-up"
)
templates.env.globals["speedup_help"] = (
    "the tuned model measured against onnxruntime and OpenVINO on the same agent, input and threads, in "
    "alternating rounds: the peer's p50 over the tuned model's"
)
templates.env.globals["peers"] = [(ONNXRUNTIME, "onnxruntime"), (OPENVINO, "OpenVINO")]


async def page_team(request: Request, sessions: SessionFactory) -> Team | None:
    """The team of the request's session cookie, else of its bearer header; None without
    a live session or a valid token."""
    session_id = request.cookies.get(COOKIE)
    if session_id:
        with transaction(sessions) as db:
            owner = dashboard_sessions.team_of_session(db, session_id=session_id)
        if owner is not None:
            return Team(id=owner.team_id, token_id=owner.token_id)
    plain = bearer_token(request)
    if plain is None:
        return None
    try:
        return await team_of_token(request, sessions, plain)
    except (Unauthorized, Forbidden):
        return None


def to_login(request: Request) -> RedirectResponse:
    response = RedirectResponse(f"{PREFIX}/login", status_code=303)
    if COOKIE in request.cookies:  # an ended or unknown session: forget it
        response.delete_cookie(COOKIE, path=PREFIX)
    return response


def page(request: Request, name: str, status: int = 200, **context) -> HTMLResponse:
    return templates.TemplateResponse(request, name, context, status_code=status)


ERROR_TITLES = {404: "Not found", 409: "Not possible now", 422: "Not understood"}


def error_page(request: Request, exc: ApiError, *, here: str = "jobs") -> HTMLResponse:
    """The API's error `exc` as a page, with its status and message."""
    return page(request, "error.html", status=exc.status, here=here, title=ERROR_TITLES.get(exc.status, "Error"),
                message=exc.message)


def _origin_of(url: str) -> str | None:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}".lower() if parts.scheme and parts.netloc else None


def cross_site(request: Request, settings: ApiSettings) -> str | None:
    """Why a POST does not come from a page of this site (None when it does): its
    `Origin`, else its `Referer`'s origin, must be this site's or a trusted one."""
    own = {f"{request.url.scheme}://{request.headers.get('host', '')}".lower()}
    own |= {o.rstrip("/").lower() for o in settings.ui_trusted_origins}
    origin = request.headers.get("origin")
    if origin is None:
        referer = request.headers.get("referer")
        if referer is None:
            return "it names neither its Origin nor a Referer"
        origin = _origin_of(referer) or "an unreadable Referer"
    if origin.lower() not in own:
        return f"it comes from {origin}, not from this site"
    return None


def refuse_cross_site(request: Request, why: str) -> HTMLResponse:
    return page(request, "error.html", status=403, title="Refused",
                message=f"This form post was refused: {why}. Use this site's own pages (log in from its login page).")


@router.get("", response_class=RedirectResponse)
async def home() -> RedirectResponse:
    return RedirectResponse(f"{PREFIX}/jobs", status_code=303)


@router.get("/login", response_class=HTMLResponse)
async def login_page(request: Request) -> HTMLResponse:
    return page(request, "login.html", message=None)


@router.post("/login", response_class=HTMLResponse)
async def login(
    request: Request, sessions: SessionsDep, settings: SettingsDep, token: Annotated[str, Form(max_length=200)] = ""
) -> Response:
    why = cross_site(request, settings)
    if why is not None:
        return refuse_cross_site(request, why)
    token = token.strip()
    message = "paste a team token (tft_...)"
    if token:
        try:
            team = await team_of_token(request, sessions, token)
        except (Unauthorized, Forbidden) as exc:
            message = exc.message
        else:
            with transaction(sessions) as db:
                session_id = dashboard_sessions.open_session(
                    db, team_id=team.id, token_id=team.token_id, lifetime_secs=settings.ui_session_secs
                )
            response = RedirectResponse(f"{PREFIX}/jobs", status_code=303)
            response.set_cookie(COOKIE, session_id, path=PREFIX, max_age=int(settings.ui_session_secs),
                                httponly=True, samesite="strict", secure=request.url.scheme == "https")
            return response
    return page(request, "login.html", status=401, message=message)


@router.post("/logout", response_class=RedirectResponse)
async def logout(request: Request, sessions: SessionsDep, settings: SettingsDep) -> Response:
    why = cross_site(request, settings)
    if why is not None:
        return refuse_cross_site(request, why)
    session_id = request.cookies.get(COOKIE)
    if session_id:
        with transaction(sessions) as db:
            dashboard_sessions.close_session(db, session_id=session_id)
    response = RedirectResponse(f"{PREFIX}/login", status_code=303)
    response.delete_cookie(COOKIE, path=PREFIX)
    return response
