"""The dashboard: server-rendered HTML pages under `/ui` for people, on the same data and
the same team tokens as the JSON API.

- `/ui/login`: the user pastes a team token; it is checked like a bearer token and
  opens a server-side session (`services/db/dashboard_sessions.py`): the cookie holds the session's
  random id, never the token (`HttpOnly`, `SameSite=Strict`, `Secure` over HTTPS, path
  `/ui`). Every page reads it; a request without a live session is sent to the login
  page (303). `Authorization: Bearer` works on the pages too (scripts, tests).
  `/ui/logout` deletes the session.
- `/ui/jobs`: the team's jobs: state, trials used of the budget as a bar, the estimated
  latency at the start and now.
- `/ui/jobs/{id}`: one job: the estimated latency over trials (its curve, as the inline
  SVG of `tunefarm.display.latency_curve_svg`, the same plot as `tunefarm report --html`)
  and the per-task table (weight, trials, best latency, GFLOPS, tuned or not, errors).
- `/ui/devices`: the device classes and every agent: state, age of its last heartbeat,
  measurements, errors by kind, and whether its timings are believed (trusted,
  unconfirmed, flagged and why, quarantined: `services.db.trust`) (what `GET /v1/devices`
  shows any team).

Cross-site requests: a POST (login, logout) must come from a page of this site: its
`Origin` header (else its `Referer`'s origin) must be the request's own origin or one of
`ApiSettings.ui_trusted_origins` (a proxy's public origin); otherwise it is refused
(403) and changes nothing: another site can neither log a visitor in to its own team
(login CSRF) nor out. Every response carries the security headers of
`security_headers.py` (no script, no framing).

Pages of running jobs and the devices page reload themselves every few seconds (a meta
refresh: the pages have no script). The pages are not in the OpenAPI schema: they are
not part of the API.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path as FsPath
from typing import Annotated
from urllib.parse import urlsplit

from fastapi import APIRouter, Form, Path, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates

from services.api import crud
from services.api.authentication import Team, bearer_token, team_of_token
from services.api.deps import SessionsDep, SettingsDep
from services.api.exceptions import Forbidden, NotFound, Unauthorized
from services.api.settings import ApiSettings
from services.db import dashboard_sessions, devices
from services.db.session import SessionFactory, transaction
from tunefarm.display import PAGE_CSS, PLOT_CSS, CurveSeries, format_cost, format_duration, latency_curve_svg

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


async def _team(request: Request, sessions: SessionFactory) -> Team | None:
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


def _to_login(request: Request) -> RedirectResponse:
    response = RedirectResponse(f"{PREFIX}/login", status_code=303)
    if COOKIE in request.cookies:  # an ended or unknown session: forget it
        response.delete_cookie(COOKIE, path=PREFIX)
    return response


def _page(request: Request, name: str, status: int = 200, **context) -> HTMLResponse:
    return templates.TemplateResponse(request, name, context, status_code=status)


def _origin_of(url: str) -> str | None:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}".lower() if parts.scheme and parts.netloc else None


def _cross_site(request: Request, settings: ApiSettings) -> str | None:
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


def _refuse_cross_site(request: Request, why: str) -> HTMLResponse:
    return _page(request, "error.html", status=403, title="Refused",
                 message=f"This form post was refused: {why}. Log in from this site's own login page.")


@router.get("", response_class=RedirectResponse)
async def home() -> RedirectResponse:
    return RedirectResponse(f"{PREFIX}/jobs", status_code=303)


@router.get("/login", response_class=HTMLResponse)
async def login_page(request: Request) -> HTMLResponse:
    return _page(request, "login.html", message=None)


@router.post("/login", response_class=HTMLResponse)
async def login(
    request: Request, sessions: SessionsDep, settings: SettingsDep, token: Annotated[str, Form(max_length=200)] = ""
) -> Response:
    why = _cross_site(request, settings)
    if why is not None:
        return _refuse_cross_site(request, why)
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
    return _page(request, "login.html", status=401, message=message)


@router.post("/logout", response_class=RedirectResponse)
async def logout(request: Request, sessions: SessionsDep, settings: SettingsDep) -> Response:
    why = _cross_site(request, settings)
    if why is not None:
        return _refuse_cross_site(request, why)
    session_id = request.cookies.get(COOKIE)
    if session_id:
        with transaction(sessions) as db:
            dashboard_sessions.close_session(db, session_id=session_id)
    response = RedirectResponse(f"{PREFIX}/login", status_code=303)
    response.delete_cookie(COOKIE, path=PREFIX)
    return response


@router.get("/jobs", response_class=HTMLResponse)
async def jobs_page(request: Request, sessions: SessionsDep, cursor: int | None = None) -> Response:
    team = await _team(request, sessions)
    if team is None:
        return _to_login(request)
    with transaction(sessions) as db:
        items, next_cursor = crud.list_jobs(db, team_id=team.id, limit=JOBS_PER_PAGE, cursor=cursor)
    active = any(j.state in ACTIVE_STATES for j in items)
    return _page(request, "jobs.html", here="jobs", jobs=items, next_cursor=next_cursor,
                 refresh=REFRESH_SECS if active else None)


@router.get("/jobs/{job_id}", response_class=HTMLResponse)
async def job_page(
    request: Request, sessions: SessionsDep, settings: SettingsDep, job_id: Annotated[int, Path(ge=1)]
) -> Response:
    team = await _team(request, sessions)
    if team is None:
        return _to_login(request)
    try:
        with transaction(sessions) as db:
            job = crud.job_public(db, team_id=team.id, job_id=job_id, fresh_secs=settings.agent_fresh_secs)
            details = crud.job_task_details(db, team_id=team.id, job_id=job_id)
    except NotFound as exc:
        return _page(request, "error.html", status=404, here="jobs", message=exc.message)
    rows = []
    for t in job.tasks:
        d = details.get(t.position)
        errors = d.errors_by_kind if d else {}
        rows.append({
            "task": t,
            "gflops": d.flops / t.best_secs / 1e9 if d and t.best_secs else None,
            "errors": sum(errors.values()),
            "errors_text": ", ".join(f"{k} {n}" for k, n in sorted(errors.items())),
        })
    curve = CurveSeries(f"job {job.id}", [(p.trials, p.est_latency_secs) for p in job.curve])
    plot = latency_curve_svg([curve], target_secs=job.latency_target_secs, title="estimated latency over trials")
    return _page(request, "job.html", here="jobs", job=job, rows=rows, plot=plot,
                 refresh=REFRESH_SECS if job.state in ACTIVE_STATES else None)


@router.get("/devices", response_class=HTMLResponse)
async def devices_page(request: Request, sessions: SessionsDep, settings: SettingsDep) -> Response:
    team = await _team(request, sessions)
    if team is None:
        return _to_login(request)
    with transaction(sessions) as db:
        classes = crud.list_device_classes(db, fresh_secs=settings.agent_fresh_secs)
        agents = crud.list_devices(db, fresh_secs=settings.agent_fresh_secs)
        now = devices.database_now(db)
    return _page(request, "devices.html", here="devices", classes=classes, agents=agents,
                 heartbeat_age=lambda at: _age(now, at), refresh=REFRESH_SECS)


def _age(now: datetime, at: datetime | None) -> str:
    return "never" if at is None else f"{format_duration(max(0.0, (now - at).total_seconds()))} ago"
