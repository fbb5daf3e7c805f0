"""The dashboard's pages of the farm's devices (`routers/dashboard.py` has the session
and the helpers every page shares). Any team sees them, as `GET /v1/devices` shows any
team every agent; they name no team's jobs.

- `/ui/devices`: the device classes and every agent: state, age of its last heartbeat,
  measurements, errors by kind, and whether its timings are believed (trusted,
  unconfirmed, flagged and why, quarantined: `services.db.trust`). Each agent and class
  links to its page.
- `/ui/devices/{agent id}`: one agent: its facts and standing (with the counts it follows
  from), capabilities, errors by kind, and its measurements hour by hour over the last
  `HISTORY_HOURS` (`devices.agent_history`).
- `/ui/classes/{name}`: one device class: its target, and its agents as on the devices
  page. A job's page links its class.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Path, Request
from fastapi.responses import HTMLResponse, Response

from services.api import crud
from services.api.deps import SessionsDep, SettingsDep
from services.api.exceptions import NotFound
from services.api.routers.dashboard import PREFIX, REFRESH_SECS, error_page, page, page_team, to_login
from services.db import devices
from services.db.session import transaction
from tunefarm.display import format_duration

router = APIRouter(prefix=PREFIX, include_in_schema=False)

HISTORY_HOURS = 48
"""How far back an agent's page shows its measurements, hour by hour."""


@router.get("/devices", response_class=HTMLResponse)
async def devices_page(request: Request, sessions: SessionsDep, settings: SettingsDep) -> Response:
    team = await page_team(request, sessions)
    if team is None:
        return to_login(request)
    with transaction(sessions) as db:
        classes = crud.list_device_classes(db, fresh_secs=settings.agent_fresh_secs)
        agents = crud.list_devices(db, fresh_secs=settings.agent_fresh_secs)
        now = devices.database_now(db)
    return page(request, "devices.html", here="devices", classes=classes, agents=agents,
                heartbeat_age=lambda at: _age(now, at), refresh=REFRESH_SECS)


@router.get("/devices/{agent_id}", response_class=HTMLResponse)
async def agent_page(
    request: Request, sessions: SessionsDep, settings: SettingsDep, agent_id: Annotated[int, Path(ge=1)]
) -> Response:
    team = await page_team(request, sessions)
    if team is None:
        return to_login(request)
    try:
        with transaction(sessions) as db:
            agent = crud.device(db, agent_id=agent_id, fresh_secs=settings.agent_fresh_secs)
            history = crud.device_history(db, agent_id=agent_id, hours=HISTORY_HOURS)
            now = devices.database_now(db)
    except NotFound as exc:
        return error_page(request, exc, here="devices")
    busiest = max((h.measurements for h in history), default=0)
    return page(request, "device.html", here="devices", agent=agent, history=history, busiest=busiest,
                history_hours=HISTORY_HOURS, heartbeat_age=_age(now, agent.last_heartbeat_at), refresh=REFRESH_SECS)


@router.get("/classes/{class_name:path}", response_class=HTMLResponse)
async def class_page(request: Request, sessions: SessionsDep, settings: SettingsDep, class_name: str) -> Response:
    team = await page_team(request, sessions)
    if team is None:
        return to_login(request)
    try:
        with transaction(sessions) as db:
            device_class = crud.device_class(db, name=class_name, fresh_secs=settings.agent_fresh_secs)
            agents = [a for a in crud.list_devices(db, fresh_secs=settings.agent_fresh_secs)
                      if a.device_class == class_name]
            now = devices.database_now(db)
    except NotFound as exc:
        return error_page(request, exc, here="devices")
    return page(request, "device_class.html", here="devices", device_class=device_class, agents=agents,
                heartbeat_age=lambda at: _age(now, at), refresh=REFRESH_SECS)


def _age(now: datetime, at: datetime | None) -> str:
    return "never" if at is None else f"{format_duration(max(0.0, (now - at).total_seconds()))} ago"
