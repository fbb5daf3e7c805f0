"""The `tunefarm agent` command (also `python -m services.agent`): flags over the
environment's settings (`AgentSettings.from_env`), then the agent until SIGTERM/SIGINT
(logged; it gives its leases back, goes offline and exits 0).
The token comes from TUNEFARM_AGENT_TOKEN or `--token-file`, never the command line
(`ps` shows it).
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from pathlib import Path

from services.agent.agent import run_agent
from services.agent.channel import FATAL_ERRORS
from services.agent.settings import AgentSettings
from services.protocol.errors import BadRequest, NotFound
from tunefarm.errors import UsageError
from tunefarm.secret_flags import read_secret_file, refuse_on_command_line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tunefarm agent", description="measure kernels for a tunefarm farm")
    p.add_argument("--server", help="the lease service, HOST:PORT (TUNEFARM_AGENT_SERVER)")
    p.add_argument("--token-file", type=Path, help="a file holding the agent token (default: TUNEFARM_AGENT_TOKEN)")
    refuse_on_command_line(p, "--token", instead="TUNEFARM_AGENT_TOKEN or --token-file PATH")
    p.add_argument("--device-class", help="device class to measure for (default: detected, e.g. x86_64-znver5-2c)")
    p.add_argument("--name", help="this agent's unique name (default: the host name)")
    p.add_argument("--work-dir", type=Path, help="downloads and the task data cache")
    p.add_argument("--threads", type=int, dest="num_threads", help="TVM threads per kernel (default: physical cores)")
    p.add_argument("--tls", action="store_true", default=None,
                   help="connect with TLS only, never plaintext (TUNEFARM_AGENT_TLS; implied by the flags below)")
    p.add_argument("--tls-ca", type=Path, help="PEM CA certificate(s) the server's certificate must chain to "
                   "(default: the system's roots; TUNEFARM_AGENT_TLS_CA)")
    p.add_argument("--tls-cert", type=Path, help="client certificate (PEM) for a farm that wants mutual TLS "
                   "(TUNEFARM_AGENT_TLS_CERT)")
    p.add_argument("--tls-key", type=Path, help="the client certificate's private key (PEM; TUNEFARM_AGENT_TLS_KEY)")
    p.add_argument("--tls-server-name", help="the name the server's certificate is checked against "
                   "(default: the host of --server; TUNEFARM_AGENT_TLS_SERVER_NAME)")
    p.add_argument(
        "--emulated",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="this agent runs under an emulator: its timings are not the device's (default: detected)",
    )
    p.add_argument(
        "--gpu",
        action="store_true",
        default=None,
        help="measure CUDA kernels on this machine's NVIDIA GPU (its class: a CUDA target; default class: named after the GPU)",
    )
    p.add_argument("--insecure-plaintext", action="store_true", default=None,
                   help="allow plaintext to a server on another host (the token travels in clear; "
                   "TUNEFARM_AGENT_INSECURE_PLAINTEXT)")
    p.add_argument("--signing-public-key", type=Path,
                   help="the farm's public key (PEM): only kernels and models it signed are loaded "
                   "(TUNEFARM_AGENT_SIGNING_PUBLIC_KEY)")
    p.add_argument("--accept-unsigned-code", action="store_true", default=None,
                   help="without a public key, load whatever the server sends (TUNEFARM_AGENT_ACCEPT_UNSIGNED_CODE)")
    p.add_argument("--max-download-bytes", type=int,
                   help="the most bytes one downloaded file may have (default 1 GiB; TUNEFARM_AGENT_MAX_DOWNLOAD_BYTES)")
    p.add_argument("--kernel-user",
                   help="an agent running as root runs kernels as this user (default nobody; TUNEFARM_AGENT_KERNEL_USER)")
    return p


def main(argv: list[str] | None = None) -> int:
    """The `tunefarm agent` command: 0 after SIGTERM/SIGINT, 2 for a fatal error."""
    args = vars(build_parser().parse_args(argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    token_file = args.pop("token_file")
    args.pop("refused_token")
    try:
        if token_file is not None:
            args["token"] = read_secret_file(token_file, "agent token")
        settings = AgentSettings.from_env(**args)
    except (BadRequest, UsageError) as exc:
        print(f"tunefarm agent: error: {exc}", flush=True)
        return 2
    stop = threading.Event()

    def stopping(signum: int, frame: object) -> None:
        if not stop.is_set():
            logging.getLogger("tunefarm.agent").info(
                "stopping (%s): giving back the leases it holds and going offline", signal.Signals(signum).name
            )
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stopping)
    try:
        run_agent(settings, stop=stop)
    except (*FATAL_ERRORS, NotFound) as exc:
        print(f"tunefarm agent: error: {type(exc).__name__}: {exc}", flush=True)
        return 2
    return 0
