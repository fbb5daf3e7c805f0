"""Errors of the HTTP API: one root, small named subclasses, each with its status code.

Handlers and the functions they call raise these; `app.py` turns every one into a JSON
body `{"error": {"code": ..., "message": ...}}` with the class's status. Request
validation errors (422) and unknown routes (404) get the same body shape.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse


class ApiError(Exception):
    """Root of the API's errors: `status` is the HTTP status, `code` a stable word."""

    status: int = 500
    code: str = "internal_error"

    def __init__(self, message: str, *, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.headers = headers or {}


class Unauthorized(ApiError):
    """No bearer token, or one the farm does not know (or revoked)."""

    status = 401
    code = "unauthorized"

    def __init__(self, message: str):
        super().__init__(message, headers={"WWW-Authenticate": "Bearer"})


class Forbidden(ApiError):
    """A valid token that may not be used here (an agent token on the team API)."""

    status = 403
    code = "forbidden"


class NotFound(ApiError):
    """No such resource for this team (another team's ids are not found either)."""

    status = 404
    code = "not_found"


class Conflict(ApiError):
    """The resource's state does not allow this now (cancel a finished job, fetch the
    artifact of a job still running)."""

    status = 409
    code = "conflict"


class PayloadTooLarge(ApiError):
    """The upload is larger than the configured limit; nothing was stored."""

    status = 413
    code = "payload_too_large"


class InvalidModel(ApiError):
    """The uploaded model is malformed, or uses something that cannot be tuned (the
    message names the operator)."""

    status = 422
    code = "invalid_model"


class InvalidRequest(ApiError):
    """A well-formed request asking for something impossible (unknown device class,
    absurd budget, bad input shapes)."""

    status = 422
    code = "invalid_request"


class TooManyRequests(ApiError):
    """The team has as many of these requests in progress as it may (uploads being
    imported); `Retry-After` says when to try again."""

    status = 429
    code = "too_many_requests"

    def __init__(self, message: str, *, retry_after_secs: int):
        super().__init__(message, headers={"Retry-After": str(retry_after_secs)})


class QuotaExceeded(ApiError):
    """The team's quota (jobs in progress, trials of those jobs) would be passed; it
    frees up as the team's jobs end (or are cancelled)."""

    status = 429
    code = "quota_exceeded"


class ServiceUnavailable(ApiError):
    """The database cannot be reached, the model importers could not start or stayed
    busy."""

    status = 503
    code = "unavailable"

    def __init__(self, message: str, *, retry_after_secs: int | None = None):
        super().__init__(message, headers={"Retry-After": str(retry_after_secs)} if retry_after_secs else None)


def error_response(
    status: int, code: str, message: str, *, details: Any = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    """The JSON answer of an error: `{"error": {"code", "message"[, "details"]}}`."""
    body: dict[str, Any] = {"code": code, "message": message}
    if details is not None:
        body["details"] = details
    return JSONResponse({"error": body}, status_code=status, headers=headers)
