"""The request body limit, enforced while the body streams in.

A request whose declared Content-Length is over the limit is refused before anything is
read; one that sends more than it declared (or streams without a length) is cut off as
soon as the limit is passed. Either way the answer is a 413 with the API's JSON error
body, and nothing has been stored: the upload handler only runs on a complete body.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send


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

        async def limited_receive() -> Message:
            nonlocal received
            if declared is not None and declared > limit:
                raise BodyTooLarge(limit)
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if started or self.on_refuse is None:
                raise
            await self.on_refuse(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for key, value in scope.get("headers", ()):
        if key == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
