"""How an agent talks to the lease service: its channel, and retrying.

It opens every connection itself (a board may sit behind NAT). The server going away is
survived: every call is retried with exponential backoff (`Backoff`) until it answers;
what no retry fixes (`FATAL_ERRORS`: a wrong token, a taken name, a class this machine
cannot serve) stops the agent.

The server is reached with TLS (`--tls`, `--tls-ca`, ...) when the settings ask for it,
and then never in plaintext; in plaintext only on this machine or where
`--insecure-plaintext` allows it (services/agent/settings.py refuses anything else).
"""

from __future__ import annotations

import logging
import random
import threading
from pathlib import Path
from typing import Protocol

import grpc

from services.agent.settings import AgentSettings, is_local
from services.protocol.errors import BadRequest, NameTaken, PermissionDenied, Unauthenticated
from services.protocol.generated import measurer_pb2_grpc as pb_grpc

log = logging.getLogger("tunefarm.agent")

FATAL_ERRORS = (Unauthenticated, PermissionDenied, NameTaken, BadRequest)
"""Errors no retry fixes (a wrong token, a taken name, a class this machine cannot serve)."""

CHANNEL_OPTIONS = (
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 5_000),
)


class AgentLink(Protocol):
    """What an agent's downloads and results streams use of it, read at each use (a
    registration again changes the id and the metadata)."""

    settings: AgentSettings
    stop: threading.Event  # set when the agent stops
    agent_id: int | None  # None until registered
    stub: pb_grpc.AgentServiceStub
    metadata: tuple[tuple[str, str], ...]  # the token, and the registration's secret once registered


def open_channel(settings: AgentSettings) -> grpc.Channel:
    """The agent's channel to the lease service: TLS when the settings ask for it (the
    server's certificate checked against `tls_ca`, or the system's roots; a client
    certificate for mutual TLS), and then never plaintext: a server that does not speak
    TLS, or whose certificate does not check, answers nothing (UNAVAILABLE, retried).
    Plaintext otherwise: to this machine, or where `insecure_plaintext` allows it (the
    settings refuse anything else), with a warning. Raises `BadRequest` for a file that
    cannot be read."""
    if not settings.uses_tls:
        if not is_local(settings.server):
            log.warning("connecting to %s in plaintext (--insecure-plaintext): the token travels in clear", settings.server)
        return grpc.insecure_channel(settings.server, options=CHANNEL_OPTIONS)

    def read(path: Path | None, what: str) -> bytes | None:
        try:
            return Path(path).read_bytes() if path else None
        except OSError as exc:
            raise BadRequest(f"cannot read the {what} {path}: {exc.strerror}") from None

    credentials = grpc.ssl_channel_credentials(
        root_certificates=read(settings.tls_ca, "CA certificate"),
        private_key=read(settings.tls_key, "client key"),
        certificate_chain=read(settings.tls_cert, "client certificate"),
    )
    options = CHANNEL_OPTIONS
    if settings.tls_server_name:
        options = (*options, ("grpc.ssl_target_name_override", settings.tls_server_name))
    return grpc.secure_channel(settings.server, credentials, options=options)


class Backoff:
    """Exponential backoff with full jitter: 0.25 s, 0.5 s, ... up to `cap`."""

    def __init__(self, cap: float, base: float = 0.25):
        self.cap = cap
        self.base = base
        self._n = 0

    def next(self) -> float:
        delay = min(self.cap, self.base * (2**self._n))
        self._n += 1
        return random.uniform(delay / 2, delay)

    def reset(self) -> None:
        self._n = 0
