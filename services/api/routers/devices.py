"""`/v1/devices` (the agents) and `/v1/device-classes`: what the farm measures on."""

from __future__ import annotations

from fastapi import APIRouter

from services.api import crud
from services.api.deps import SessionsDep, SettingsDep, TeamDep
from services.api.routers.responses import AUTH
from services.api.schemas import DeviceClassPublic, DevicePublic
from services.db.session import transaction

router = APIRouter(tags=["devices"], responses=AUTH)


@router.get("/v1/devices", summary="The farm's agents")
def list_devices(team: TeamDep, sessions: SessionsDep, settings: SettingsDep) -> list[DevicePublic]:
    """Every agent: its class, state, capabilities, last heartbeat, measurements done,
    errors by kind, and its standing (whether its timings are believed, and why not).
    An agent silent for longer than TUNEFARM_AGENT_FRESH_SECS is offline, whatever its
    row last said."""
    with transaction(sessions) as db:
        return crud.list_devices(db, fresh_secs=settings.agent_fresh_secs)


@router.get("/v1/device-classes", summary="The device classes a job may name")
def list_device_classes(team: TeamDep, sessions: SessionsDep, settings: SettingsDep) -> list[DeviceClassPublic]:
    with transaction(sessions) as db:
        return crud.list_device_classes(db, fresh_secs=settings.agent_fresh_secs)
