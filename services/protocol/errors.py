"""Errors of the measurement farm's agent service, and their gRPC status codes both ways.

The lease service raises these (it maps its database errors with
`services.lease.servicer.STATUS_OF_DB_ERROR`); `status_of` gives the status code an error
is sent as. The agent turns a failed call back into one of these with `from_rpc_error`,
and acts on the class: retry later (`Transient`), register again (`UnknownAgent`), drop
the batch (`LeaseLost`), or stop (`Unauthenticated`, `PermissionDenied`).

Imports grpc only: the agent, which has no database packages, uses this module too.
"""

from __future__ import annotations

import grpc


class MeasurerError(Exception):
    """Root of the agent service's errors."""


class Unauthenticated(MeasurerError):
    """No bearer token, or one the farm does not know (or revoked)."""


class PermissionDenied(MeasurerError):
    """A valid token that may not do this: a team token on the agent service, or an agent
    id registered under another token."""


class NotFound(MeasurerError):
    """Something the request names does not exist (a lease, a device class)."""


class UnknownAgent(NotFound):
    """The agent id is not (or no longer) registered: register again."""


class NameTaken(MeasurerError):
    """The agent name belongs to an agent of another token."""


class AlreadyMeasured(MeasurerError):
    """A result for a candidate that has its measurement from another lease (the one
    that measured it, or the batch given up): this lease was never handed it."""


class LeaseLost(MeasurerError):
    """The lease is not the sender's active one any more (it expired, was finished, or the
    batch was given up): its results are refused; drop the batch."""


class BadRequest(MeasurerError):
    """A malformed request (an empty name, a candidate of another batch, ...)."""


class Transient(MeasurerError):
    """The server cannot answer now (restarting, database unavailable, overloaded): retry
    with backoff."""


_CODES: tuple[tuple[type[MeasurerError], grpc.StatusCode], ...] = (
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (NameTaken, grpc.StatusCode.ALREADY_EXISTS),
    (AlreadyMeasured, grpc.StatusCode.ALREADY_EXISTS),
    (LeaseLost, grpc.StatusCode.FAILED_PRECONDITION),
    (BadRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (Transient, grpc.StatusCode.UNAVAILABLE),
)

UNKNOWN_AGENT_PREFIX = "unknown agent"
"""Start of the NOT_FOUND details that mean `UnknownAgent` (other NOT_FOUNDs are `NotFound`)."""


def status_of(error: BaseException) -> grpc.StatusCode:
    """The status code `error` is sent as (INTERNAL for anything unexpected)."""
    for cls, code in _CODES:
        if isinstance(error, cls):
            return code
    return grpc.StatusCode.INTERNAL


def from_rpc_error(error: grpc.RpcError) -> MeasurerError:
    """The error a failed call stands for, on the agent's side."""
    code = error.code() if isinstance(error, grpc.Call) else grpc.StatusCode.UNKNOWN
    details = (error.details() if isinstance(error, grpc.Call) else str(error)) or str(code)
    if code is grpc.StatusCode.NOT_FOUND and details.startswith(UNKNOWN_AGENT_PREFIX):
        return UnknownAgent(details)
    for cls, known in _CODES:
        if code is known and cls is not Transient:
            return cls(details)
    # UNAVAILABLE, DEADLINE_EXCEEDED, ABORTED, RESOURCE_EXHAUSTED, CANCELLED, INTERNAL,
    # UNKNOWN: the server (or the path to it) is in trouble, not the request.
    return Transient(f"{code.name}: {details}")
