"""The request body limit, enforced while the body streams in.

A request whose declared Content-Length is over the limit is refused before anything is
read; one that sends more than it declared (or streams without a length, chunked) is cut
off as soon as the limit is passed. Either way the answer is a 413 with the API's JSON
error body, and nothing has been stored: the upload handler only runs on a complete body.

The body is read by the application as it needs it, one message of the server at a time
(the server reads the socket no faster than that), so a refused body was read up to the
limit and no further. A response sent before the body was read to its end (a refusal,
or an answer that did not need the body) closes the connection (`Connection: close`):
the server would otherwise read, and throw away, the rest of the body to reuse the
connection, however long the client kept sending. Before closing, at most
`LINGER_BYTES` more of the body are read and dropped, for at most `LINGER_SECS` (a
lingering close): a connection closed with unread data is reset, and a client still
sending could lose the answer it had not read yet; a body only somewhat over the limit
is so read to its end and the client sees the 413.
"""

from __future__ import annotations

import asyncio
import time

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

LINGER_BYTES = 1 << 20
"""Most bytes of a refused body read (and dropped) after the answer, before closing."""

LINGER_SECS = 2.0
"""Longest time spent on them."""


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int):
        super().__init__(status_code=413, detail=f"the request body is larger than this farm accepts ({limit} bytes)")


class BodySizeLimit:
    """ASGI middleware: at most `max_body_bytes` per request body."""

    def __init__(self, app: ASGIApp, *, max_body_bytes: int, on_refuse: ASGIApp | None = None):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.on_refuse = on_refuse  # answers a refused request (the API's JSON 413)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        declared = _content_length(scope)
        received = 0
        started = False
        body_done = not _has_body(scope, declared)

        async def limited_receive() -> Message:
            nonlocal received, body_done
            if declared is not None and declared > limit:
                raise BodyTooLarge(limit)
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
                body_done = not message.get("more_body", False)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if not body_done:  # answered before the body's end: read no more of it
                    message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
            elif message["type"] == "http.response.body" and not message.get("more_body", False) and not body_done:
                await send({**message, "more_body": True})  # the whole answer, then the linger
                await _linger(receive)
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if started or self.on_refuse is None:
                raise
            await self.on_refuse(scope, receive, tracking_send)


def _content_length(scope: Scope) -> int | None:
    for key, value in scope.get("headers", ()):
        if key == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _has_body(scope: Scope, declared: int | None) -> bool:
    """The request has a body to read: a positive Content-Length, or a chunked one."""
    if declared is not None:
        return declared > 0
    return any(key == b"transfer-encoding" for key, _ in scope.get("headers", ()))


async def _linger(receive: Receive) -> None:
    """Read and drop what the client still sends, up to `LINGER_BYTES` and `LINGER_SECS`."""
    deadline = time.monotonic() + LINGER_SECS
    drained = 0
    while drained < LINGER_BYTES:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        try:
            message = await asyncio.wait_for(receive(), left)
        except TimeoutError:
            return
        if message["type"] != "http.request":
            return
        drained += len(message.get("body", b""))
        if not message.get("more_body", False):
            return
