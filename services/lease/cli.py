"""The `tunefarm lease-service` command (also `python -m services.lease`): flags over the
environment's settings (`LeaseServiceSettings`), then the server until SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from pydantic import ValidationError

from services.common.settings import first_problem
from services.lease.server import serve, server_credentials
from services.lease.settings import LeaseServiceSettings


def main(argv: list[str] | None = None) -> int:
    """`tunefarm lease-service [--bind HOST:PORT] [--artifact-root DIR] [--tls-cert F
    --tls-key F [--tls-client-ca F]]`; the rest comes from the environment
    (LeaseServiceSettings). 2 with one line for settings that do not make sense."""
    parser = argparse.ArgumentParser(prog="tunefarm lease-service", description="the farm's agent service (gRPC)")
    parser.add_argument("--bind", help="host:port to listen on (TUNEFARM_LEASE_BIND)")
    parser.add_argument("--artifact-root", type=Path, help="shared artifact directory (TUNEFARM_ARTIFACT_ROOT)")
    parser.add_argument("--tls-cert", type=Path, help="serve TLS with this PEM certificate chain (TUNEFARM_TLS_CERT_FILE)")
    parser.add_argument("--tls-key", type=Path, help="the certificate's PEM private key (TUNEFARM_TLS_KEY_FILE)")
    parser.add_argument("--tls-client-ca", type=Path,
                        help="mutual TLS: agents must present a certificate this PEM CA signed (TUNEFARM_TLS_CLIENT_CA_FILE)")
    args = parser.parse_args(argv)
    flags = {
        "lease_bind": args.bind,
        "artifact_root": args.artifact_root,
        "tls_cert_file": args.tls_cert,
        "tls_key_file": args.tls_key,
        "tls_client_ca_file": args.tls_client_ca,
    }
    try:
        settings = LeaseServiceSettings(**{k: v for k, v in flags.items() if v is not None})
        if settings.tls:
            server_credentials(settings)  # unreadable files: one line now, not a traceback later
    except (ValidationError, OSError) as exc:
        print(f"tunefarm lease-service: error: {_settings_problem(exc)}", file=sys.stderr, flush=True)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        serve(settings)
    except OSError as exc:  # its port is taken: one line, not a traceback
        print(f"tunefarm lease-service: error: {_settings_problem(exc)}", file=sys.stderr, flush=True)
        return 2
    return 0


def _settings_problem(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        where, message = first_problem(exc)
        return f"{where}: {message}" if where else message
    if isinstance(exc, OSError) and exc.filename:
        return f"cannot read {exc.filename}: {exc.strerror}"
    return str(exc)
