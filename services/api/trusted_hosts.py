"""Which host names the API answers to (ASGI middleware): the `Host` header of every
request must name one of `ApiSettings.allowed_hosts()`, or it is a 400 with the API's JSON
error body, before anything else runs.

Why: DNS rebinding. A page on `evil.example` whose name the attacker then points at
127.0.0.1 makes the visitor's browser send requests to a farm on loopback (or on the
visitor's network) as same-origin requests of `evil.example`: it could read `/healthz`,
`/metrics` or the OpenAPI schema, and post to the dashboard's login with a token it
guesses. Such a request still names `evil.example` in its `Host`, which the farm never
answers to.

Starlette's `TrustedHostMiddleware` does the matching (exact names, `*.example.com`,
`*` for any; its constructor checks the patterns); its refusal is plain text, so this
subclass answers it as every API error is, JSON. An IPv6 address is matched without
its brackets (`::1` allows `Host: [::1]:8000`).
"""

from __future__ import annotations

from collections.abc import Sequence

from starlette.datastructures import Headers
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from services.api.exceptions import error_response


class TrustedHosts(TrustedHostMiddleware):
    """`TrustedHostMiddleware` for `allowed_hosts`, answering a refusal with a JSON 400."""

    def __init__(self, app: ASGIApp, allowed_hosts: Sequence[str]):
        super().__init__(app, allowed_hosts=[h.strip("[]") for h in allowed_hosts], www_redirect=False)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.allow_any or scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        host = host_of(Headers(scope=scope).get("host", ""))
        if host is not None and any(_matches(host, pattern) for pattern in self.allowed_hosts):
            await self.app(scope, receive, send)
            return
        response = error_response(
            400, "invalid_host", "this farm does not answer to the host name the request names (its Host header); "
            "an operator lists the names it answers to in TUNEFARM_API_ALLOWED_HOSTS",
        )
        await response(scope, receive, send)


def host_of(header: str) -> str | None:
    """The host a `Host` header names, lowercased, without its port or an IPv6 address's
    brackets; None when it names none."""
    header = header.strip().lower()
    if header.startswith("["):
        end = header.find("]")
        port = header[end + 1 :]
        if end < 2 or (port and not (port.startswith(":") and port[1:].isdigit())):
            return None
        return header[1:end]
    name, _, port = header.partition(":")
    if not name or (port and not port.isdigit()):
        return None
    return name


def _matches(host: str, pattern: str) -> bool:
    return host == pattern or (pattern.startswith("*.") and host.endswith(pattern[1:]))


__all__ = ["TrustedHosts", "host_of"]
