"""`/healthz`: the API is up and reaches its database (no token needed)."""

from __future__ import annotations

from fastapi import APIRouter

from services.api.deps import SessionsDep
from services.api.schemas import ErrorBody, Health
from services.db.migrate import schema_revision
from services.db.session import transaction

router = APIRouter(tags=["health"])


@router.get("/healthz", responses={503: {"model": ErrorBody, "description": "the database cannot be reached"}})
def health(sessions: SessionsDep) -> Health:
    with transaction(sessions) as db:
        return Health(status="ok", schema_revision=schema_revision(db))
