"""The lease service's gRPC server: `make_server(settings)` builds it (bound, not
started; its servicer, sweeper and revocation listener with it), `serve()` runs it until
SIGTERM/SIGINT. TLS when the settings name a certificate and key; mutual TLS with a
client CA (`server_credentials`).
"""

from __future__ import annotations

import logging
import signal
import threading
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc

from services.db.revocations import RevocationListener
from services.db.session import SessionFactory, make_session_factory
from services.lease.servicer import AgentServicer
from services.lease.settings import LeaseServiceSettings
from services.lease.sweeper import Sweeper
from services.protocol.generated import measurer_pb2_grpc as pb_grpc

log = logging.getLogger("tunefarm.lease_service")

SERVER_OPTIONS = (
    # Agents keep idle connections open; let them ping (they detect a dead server so).
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    # gRPC binds with SO_REUSEPORT by default: a second lease service (or any process of
    # the same user) on the port would silently take a share of the agents' connections.
    # The port is this service's alone; one already taken fails the start.
    ("grpc.so_reuseport", 0),
)


@dataclass
class LeaseServer:
    """A built lease service: `start()`, `stop()`; `port` is the bound port."""

    server: grpc.Server
    port: int
    servicer: AgentServicer
    sweeper: Sweeper
    revocations: RevocationListener
    host: str = "127.0.0.1"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> None:
        self.revocations.start()
        self.server.start()
        self.sweeper.start()

    def stop(self, grace: float = 5.0) -> None:
        self.sweeper.stop()
        self.server.stop(grace).wait()
        self.revocations.stop()


def make_server(
    settings: LeaseServiceSettings | None = None, *, sessions: SessionFactory | None = None
) -> LeaseServer:
    """The lease service for `settings`, bound but not started."""
    settings = settings or LeaseServiceSettings()
    sessions = sessions or make_session_factory(settings)
    revocations = RevocationListener(sessions.kw["bind"])
    servicer = AgentServicer(settings, sessions, revocations)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=settings.grpc_max_workers, thread_name_prefix="lease-rpc"),
        options=(*SERVER_OPTIONS, ("grpc.max_receive_message_length", settings.max_message_bytes)),
    )
    pb_grpc.add_AgentServiceServicer_to_server(servicer, server)
    try:
        if settings.tls:
            port = server.add_secure_port(settings.lease_bind, server_credentials(settings))
        else:
            port = server.add_insecure_port(settings.lease_bind)
    except RuntimeError as exc:  # grpcio: "Failed to bind to address ..."
        raise OSError(f"cannot listen on {settings.lease_bind}: {exc}") from None
    if port == 0:
        raise OSError(f"cannot listen on {settings.lease_bind}")
    host = settings.lease_bind.rsplit(":", 1)[0].strip("[]")
    host = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
    return LeaseServer(server, port, servicer, Sweeper(settings, sessions), revocations, host=host)


def server_credentials(settings: LeaseServiceSettings) -> grpc.ServerCredentials:
    """TLS with the settings' certificate and key; with a client CA, mutual TLS (a client
    without a certificate that CA signed is refused in the handshake). Raises `OSError`
    for a file that cannot be read."""
    assert settings.tls_cert_file is not None and settings.tls_key_file is not None
    pair = (Path(settings.tls_key_file).read_bytes(), Path(settings.tls_cert_file).read_bytes())
    client_ca = Path(settings.tls_client_ca_file).read_bytes() if settings.tls_client_ca_file else None
    return grpc.ssl_server_credentials([pair], root_certificates=client_ca, require_client_auth=client_ca is not None)


def serve(settings: LeaseServiceSettings | None = None) -> None:
    """Run the lease service until SIGTERM or SIGINT (checks the schema first)."""
    from services.db.migrate import check_schema

    settings = settings or LeaseServiceSettings()
    check_schema(settings.database_url)
    lease_server = make_server(settings)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    lease_server.start()
    security = ("mutual TLS" if settings.tls_client_ca_file else "TLS") if settings.tls else "plaintext"
    log.info("lease service listening on %s, %s (artifacts in %s)", settings.lease_bind, security, settings.artifact_root)
    print(f"lease service listening on port {lease_server.port}", flush=True)
    stop.wait()
    lease_server.stop()
