"""The dashboard's pages of the farm's devices (`routers/dashboard.py` has the session
and the helpers every page shares).

- `/ui/devices`: the device classes and every agent: state, age of its last heartbeat,
  measurements, errors by kind, and whether its timings are believed (trusted,
  unconfirmed, flagged and why, quarantined: `services.db.trust`) (what `GET /v1/devices`
  shows any team).
"""

from __future__ import annotations

from datetime import datetime

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response

from services.api import crud
from services.api.deps import SessionsDep, SettingsDep
from services.api.routers.dashboard import PREFIX, REFRESH_SECS, page, page_team, to_login
from services.db import devices
from services.db.session import transaction
from tunefarm.display import format_duration

router = APIRouter(prefix=PREFIX, include_in_schema=False)


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


def _age(now: datetime, at: datetime | None) -> str:
    return "never" if at is None else f"{format_duration(max(0.0, (now - at).total_seconds()))} ago"
