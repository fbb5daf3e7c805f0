"""Security headers on every response of the API and the dashboard (ASGI middleware).

- `Content-Security-Policy`: the dashboard's pages have no script and load nothing from
  elsewhere: no script may run, styles are the page's own, forms post to this origin
  only, and no other site may frame them (`frame-ancestors 'none'`). JSON answers get
  the same (nothing in them is a document). The schema browsers (`/docs`, `/redoc`)
  load their scripts from a CDN and get a policy that allows exactly that.
- `X-Frame-Options: DENY` (framing, for browsers without `frame-ancestors`);
- `X-Content-Type-Options: nosniff` (a body is what its Content-Type says);
- `Referrer-Policy: same-origin`: nothing of a page's URL leaves the site, and a
  same-origin form post keeps its `Origin` and `Referer`, which the dashboard's
  cross-site check reads (`no-referrer` would send `Origin: null`).

A header the application set itself is left as it is.
"""

from __future__ import annotations

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

PAGE_POLICY = (
    "default-src 'none'; style-src 'unsafe-inline'; img-src 'self' data:; form-action 'self'; "
    "frame-ancestors 'none'; base-uri 'none'"
)
"""The dashboard's pages (inline styles, an inline SVG; no script) and every other answer."""

SCHEMA_BROWSER_POLICY = (
    "default-src 'none'; script-src 'unsafe-inline' https://cdn.jsdelivr.net; "
    "style-src 'unsafe-inline' https://cdn.jsdelivr.net https://fonts.googleapis.com; "
    "font-src https://fonts.gstatic.com; img-src 'self' data: https://fastapi.tiangolo.com https://cdn.redoc.ly; "
    "worker-src blob:; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'"
)
"""FastAPI's /docs (Swagger UI) and /redoc, which load their bundles from a CDN."""

SCHEMA_BROWSERS = ("/docs", "/redoc")


def headers_for(path: str) -> dict[str, str]:
    policy = SCHEMA_BROWSER_POLICY if path in SCHEMA_BROWSERS else PAGE_POLICY
    return {
        "Content-Security-Policy": policy,
        "X-Frame-Options": "DENY",
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "same-origin",
    }


class SecurityHeaders:
    """ASGI middleware adding `headers_for(path)` to every HTTP response."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        extra = headers_for(scope["path"])

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in extra.items():
                    if name not in headers:
                        headers[name] = value
            await send(message)

        await self.app(scope, receive, send_with_headers)
