"""The error answers routers declare, so the OpenAPI schema lists every status a client may get."""

from __future__ import annotations

from typing import Any

from services.api.schemas import ErrorBody


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    descriptions = {
        400: "the body cannot be parsed (JSON that is not JSON or not UTF-8, a broken multipart form)",
        401: "no bearer token, or an unknown or revoked one",
        403: "an agent token: it cannot be used on the team API",
        404: "no such resource for your team",
        409: "the resource's state does not allow this now",
        413: "the request body is larger than the farm accepts; nothing was stored",
        422: "the request is malformed or asks for something impossible",
        429: "your team is at a limit (uploads being imported, jobs or trials in progress); the message says which",
    }
    return {s: {"model": ErrorBody, "description": descriptions[s]} for s in statuses}


AUTH = errors(401, 403, 422)
"""Every team endpoint: authentication, and validation of its parameters."""
