"""The farm's HTTP API: `create_app(settings)` builds the FastAPI application, `main(argv)`
serves it with uvicorn (`tunefarm api`).

Routers: `/v1/models`, `/v1/jobs`, `/v1/devices` + `/v1/device-classes`, `/healthz`,
`/metrics` (Prometheus), and the dashboard's HTML pages under `/ui` (not in the schema).
Every error is a JSON body `{"error": {"code", "message"}}` (`schemas.ErrorBody`):
the API's own errors (`exceptions.py`), validation errors (422), unknown routes (404),
an oversized body (413, `limits.BodySizeLimit`), the database unreachable (503).
Requests under `/v1/` are authenticated from their headers before their body is read
(`authentication.TeamAuthentication`); every response carries the security headers of
`security_headers.py`. A request naming a host the farm does not answer to is a 400
before any of that (`trusted_hosts.py`, `TUNEFARM_API_ALLOWED_HOSTS`); the schema
browsers `/docs` and `/redoc` are served only with `TUNEFARM_API_DOCS=true`.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from services.api.authentication import Team, TeamAuthentication
from services.api.exceptions import ApiError, error_response
from services.api.intake_pool import IntakePool
from services.api.limits import BodySizeLimit
from services.api.routers import (
    dashboard,
    dashboard_devices,
    dashboard_jobs,
    devices,
    health,
    jobs,
    metrics,
    models,
)
from services.api.security_headers import SecurityHeaders
from services.api.settings import ApiSettings
from services.api.trusted_hosts import TrustedHosts
from services.db.exceptions import DatabaseError, Unavailable
from services.db.revocations import RevocationListener, VerifiedTokens
from services.db.session import make_session_factory

log = logging.getLogger("tunefarm.api")

API_VERSION = "1"

_HTTP_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "payload_too_large",
    415: "unsupported_media_type",
    422: "invalid_request",
    429: "too_many_requests",
}


def create_app(settings: ApiSettings | None = None) -> FastAPI:
    """The application for `settings` (default: read from the environment)."""
    settings = settings or ApiSettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        settings.artifact_root.mkdir(parents=True, exist_ok=True)
        app.state.settings = settings
        app.state.sessions = make_session_factory(settings)
        revocations = RevocationListener(app.state.sessions.kw["bind"])
        revocations.start()
        app.state.token_cache = VerifiedTokens[Team](settings.token_cache_secs, revocations)
        app.state.intake = IntakePool(
            size=settings.intake_workers,
            per_team=settings.intake_per_team,
            wait_secs=settings.intake_queue_secs,
            memory_limit_bytes=settings.intake_memory_limit_bytes,
            preload=["services.api.intake"],
        )
        try:
            yield
        finally:
            app.state.intake.close()
            revocations.stop()
            app.state.sessions.kw["bind"].dispose()

    app = FastAPI(
        title="tunefarm",
        version=API_VERSION,
        summary="Tune whole models on a farm of devices",
        description=(
            "Upload an ONNX model, start a tuning job on a device class, follow its progress, "
            "fetch the tuned model. Every endpoint but /healthz needs a team token: "
            "`Authorization: Bearer tft_...`."
        ),
        lifespan=lifespan,
        generate_unique_id_function=lambda route: route.name,  # operation ids: upload_model, get_job, ...
        # The schema browsers load their scripts from a CDN: served only when asked for.
        docs_url="/docs" if settings.api_docs else None,
        redoc_url="/redoc" if settings.api_docs else None,
    )
    routers = (models.router, jobs.router, devices.router, health.router, metrics.router, dashboard.router,
               dashboard_jobs.router, dashboard_devices.router)
    for router in routers:
        app.include_router(router)
    _add_error_handlers(app)
    # The JSON 413 for a request refused before the application saw it.
    refuse = JSONResponse(
        {"error": {"code": "payload_too_large", "message": f"the request body is larger than this farm accepts "
                   f"({settings.max_upload_bytes} bytes)"}},
        status_code=413,
    )
    _add_middleware(app, settings, refuse)
    return app


def _add_middleware(app: FastAPI, settings: ApiSettings, refuse: JSONResponse) -> None:
    """Innermost first: the team's token, the body's size, the Host, the security headers."""
    app.add_middleware(TeamAuthentication)  # inside the body limit: a refusal closes the connection
    app.add_middleware(
        BodySizeLimit,
        max_body_bytes=settings.max_upload_bytes + settings.multipart_overhead_bytes,
        on_refuse=refuse,
    )
    # Before anything reads the request: a Host the farm does not answer to (DNS rebinding).
    app.add_middleware(TrustedHosts, allowed_hosts=settings.allowed_hosts())
    app.add_middleware(SecurityHeaders)  # outermost: on every answer, a refused body's or host's too


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.code, exc.message, headers=exc.headers or None)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = jsonable_encoder(exc.errors(), custom_encoder={bytes: lambda b: b.decode(errors="replace")})
        for p in problems:
            p.pop("url", None)
        first = problems[0] if problems else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        message = f"{where}: {first.get('msg', 'invalid')}" if where else str(first.get("msg", "invalid request"))
        return error_response(422, "invalid_request", message, details=problems)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _HTTP_CODES.get(exc.status_code, "error")
        headers = getattr(exc, "headers", None)
        if exc.status_code == 405:  # Starlette names the methods of the first route of the path only
            headers = {**(headers or {}), "Allow": ", ".join(_allowed_methods(app, request))}
        return error_response(exc.status_code, code, str(exc.detail), headers=headers)

    @app.exception_handler(DatabaseError)
    async def database_error(request: Request, exc: DatabaseError) -> JSONResponse:
        if isinstance(exc, Unavailable):
            return error_response(503, "unavailable", "the database cannot be reached; try again shortly")
        log.exception("database error", exc_info=exc)
        return error_response(500, "internal_error", "the database refused the request")


def _allowed_methods(app: FastAPI, request: Request) -> list[str]:
    """Every method some route of the request's path answers."""
    methods: set[str] = set()
    for route in app.routes:
        match, _ = route.matches(request.scope)
        if match is not Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    return sorted(methods)


def main(argv: list[str] | None = None) -> int:
    """`tunefarm api [--bind HOST:PORT]`: serve the API with uvicorn until interrupted."""
    import uvicorn

    parser = argparse.ArgumentParser(prog="tunefarm api", description="the farm's HTTP API")
    parser.add_argument("--bind", help="host:port to listen on (default: TUNEFARM_API_BIND)")
    args = parser.parse_args(argv)
    settings = ApiSettings()
    from services.db.migrate import check_schema

    check_schema(settings.database_url)  # refuse to serve a database at another schema revision
    bind = args.bind or settings.api_bind
    host, _, port = bind.rpartition(":")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.info("tunefarm api on http://%s:%s (artifacts in %s)", host, port, settings.artifact_root)
    uvicorn.run(
        "services.api.app:create_app",
        factory=True,
        host=host,
        port=int(port),
        workers=settings.api_workers,
        log_level="warning",
        access_log=False,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
