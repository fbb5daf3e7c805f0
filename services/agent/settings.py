"""The agent's settings: the only reader of its environment (`AgentSettings.from_env`,
TUNEFARM_AGENT_*); the command line's flags override them (services/agent/cli.py).

A plain dataclass, not pydantic-settings: the agent needs only TVM's runtime, numpy,
grpcio, protobuf and cryptography (the `agent` extra).

The settings refuse what cannot be safe: plaintext to a server on another host unless
`insecure_plaintext` says so (the token would travel in clear, and anyone on the path
could answer in the server's place), and no signing public key unless
`accept_unsigned_code` says so.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.protocol.errors import BadRequest
from services.protocol.wire import AGENT_NAME_RULE, valid_agent_name

ENV_PREFIX = "TUNEFARM_AGENT_"

LOCAL_TARGETS = ("localhost", "unix:", "unix-abstract:")
"""Servers on this machine besides loopback addresses: the only ones reached in
plaintext without `--insecure-plaintext`."""


DEFAULT_MAX_DOWNLOAD_BYTES = 1 << 30
"""1 GiB: a server (or whoever answers in its place) cannot fill the agent's disk with
one file; a tuned model's library or inputs larger than this needs the setting raised."""


def _default_work_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tunefarm" / "agent"


@dataclass(frozen=True)
class AgentSettings:
    """How an agent reaches the farm and runs kernels. The only reader of the agent's
    environment (`from_env`); a plain dataclass, not pydantic-settings, to keep the
    agent's dependencies to TVM's runtime, numpy, grpcio, protobuf and cryptography."""

    server: str  # TUNEFARM_AGENT_SERVER: the lease service, host:port (not a URL: `check_server`)
    token: str = field(repr=False)  # TUNEFARM_AGENT_TOKEN: an agent token (tfa_...)
    device_class: str | None = None  # TUNEFARM_AGENT_DEVICE_CLASS; default: detected (arch-cpu-cores)
    name: str | None = None  # TUNEFARM_AGENT_NAME; default: the host name
    work_dir: Path = field(default_factory=_default_work_dir)  # TUNEFARM_AGENT_WORK_DIR: downloads, cache
    num_threads: int | None = None  # TUNEFARM_AGENT_THREADS: TVM threads per kernel; default: physical cores
    tls: bool = False  # TUNEFARM_AGENT_TLS: connect with TLS only (the system's roots, or tls_ca)
    tls_ca: Path | None = None  # TUNEFARM_AGENT_TLS_CA: PEM roots to trust instead (implies tls)
    tls_cert: Path | None = None  # TUNEFARM_AGENT_TLS_CERT: client certificate for mutual TLS (implies tls)
    tls_key: Path | None = None  # TUNEFARM_AGENT_TLS_KEY: its private key
    tls_server_name: str | None = None  # TUNEFARM_AGENT_TLS_SERVER_NAME: checked against the server's certificate
    reconnect_max_secs: float = 30.0  # TUNEFARM_AGENT_RECONNECT_MAX_SECS: longest wait between retries
    rpc_timeout_secs: float = 30.0  # TUNEFARM_AGENT_RPC_TIMEOUT_SECS: deadline of a unary call
    lease_wait_secs: float = 10.0  # TUNEFARM_AGENT_LEASE_WAIT_SECS: deadline of a long-polling LeaseBatch
    emulated: bool | None = None  # TUNEFARM_AGENT_EMULATED: runs under an emulator; default: detected
    gpu: bool = False  # TUNEFARM_AGENT_GPU: measure CUDA kernels on this machine's GPU (a CUDA class)
    # TUNEFARM_AGENT_INSECURE_PLAINTEXT: allow plaintext to a server on another host
    insecure_plaintext: bool = False
    # TUNEFARM_AGENT_SIGNING_PUBLIC_KEY: the farm's public key (PEM); code it did not sign is never loaded
    signing_public_key: Path | None = None
    # TUNEFARM_AGENT_ACCEPT_UNSIGNED_CODE: without a public key, load whatever the server sends
    accept_unsigned_code: bool = False
    # TUNEFARM_AGENT_KERNEL_USER: an agent running as root runs kernels as this user
    kernel_user: str = "nobody"
    # TUNEFARM_AGENT_MAX_DOWNLOAD_BYTES: the most one downloaded file (a kernel, a model library,
    # task data, a model's inputs) may have, whatever the server says; a file the lease declared
    # smaller may have no more than declared
    max_download_bytes: int = DEFAULT_MAX_DOWNLOAD_BYTES

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: Any) -> AgentSettings:
        """Settings from TUNEFARM_AGENT_* variables; `overrides` (not None) win."""
        env = os.environ if environ is None else environ
        kinds = {
            "server": str,
            "token": str,
            "device_class": str,
            "name": str,
            "work_dir": Path,
            "num_threads": int,
            "tls": _flag,
            "tls_ca": Path,
            "tls_cert": Path,
            "tls_key": Path,
            "tls_server_name": str,
            "reconnect_max_secs": float,
            "rpc_timeout_secs": float,
            "lease_wait_secs": float,
            "emulated": _flag,
            "gpu": _flag,
            "insecure_plaintext": _flag,
            "signing_public_key": Path,
            "accept_unsigned_code": _flag,
            "kernel_user": str,
            "max_download_bytes": int,
        }
        values: dict[str, Any] = {}
        for key, parse in kinds.items():
            var = env_name(key)
            if env.get(var):
                try:
                    values[key] = parse(env[var])
                except ValueError:
                    raise BadRequest(f"{var}={env[var]!r} is not a valid {key}") from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        for required, flag in (("server", "--server"), ("token", "--token-file")):
            if not values.get(required):
                raise BadRequest(f"no {required}: set {ENV_PREFIX}{required.upper()} or pass {flag}")
        return cls(**values)

    def __post_init__(self) -> None:
        check_server(self.server)
        if self.name is not None and not valid_agent_name(self.name):
            raise BadRequest(f"agent name {self.name[:130]!r} refused: a name is {AGENT_NAME_RULE}")
        if self.max_download_bytes < 1:
            raise BadRequest(f"{env_name('max_download_bytes')} must be a positive number of bytes")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise BadRequest("a client certificate needs its key: give both --tls-cert and --tls-key")
        if not self.uses_tls and not self.insecure_plaintext and not is_local(self.server):
            raise BadRequest(
                f"refusing plaintext to {self.server}: the token would travel in clear and anyone on the way "
                "could answer as the farm; use --tls (with --tls-ca), or --insecure-plaintext on a network you trust"
            )
        if self.signing_public_key is None and not self.accept_unsigned_code:
            raise BadRequest(
                "no signing public key: pass --signing-public-key FILE (the farm's public key, e.g. "
                "farm-signing.pub) so that only kernels the farm signed are loaded, or --accept-unsigned-code "
                "to load whatever the server sends"
            )

    @property
    def uses_tls(self) -> bool:
        """Connect with TLS, and never in plaintext."""
        return bool(self.tls or self.tls_ca or self.tls_cert or self.tls_server_name)


URL_SCHEMES = {"http": False, "grpc": False, "https": True, "grpcs": True}
"""Schemes people put before the lease service's address, and whether they mean TLS."""


def check_server(server: str) -> None:
    """`BadRequest` for a server given as a URL (`http://host:port`): gRPC reads it as a
    host named `http` and the agent retried for ever ("Misformatted domain name"). The
    address is refused, not fixed: `https://` may mean TLS, which the flags say, not
    the address. gRPC's own target forms (`dns:///host:port`, `unix:path`) pass."""
    scheme, sep, rest = server.partition("://")
    if sep and scheme.lower() in URL_SCHEMES:
        address = rest.split("/", 1)[0] or "HOST:PORT"
        tls = " with --tls (and --tls-ca)" if URL_SCHEMES[scheme.lower()] else ""
        raise BadRequest(
            f"--server {server!r} is a URL: give the lease service's gRPC address as HOST:PORT, e.g. "
            f"--server {address}{tls}"
        )
    if not server.strip():
        raise BadRequest("--server is empty: give the lease service's gRPC address as HOST:PORT")


def is_local(server: str) -> bool:
    """Whether a gRPC target is on this machine (a loopback address, localhost, a unix socket)."""
    if server.startswith(LOCAL_TARGETS[1:]):
        return True
    target = server.split("///", 1)[1] if "///" in server else server
    host = target.rsplit(":", 1)[0] if target.count(":") == 1 or target.startswith("[") else target
    host = host.strip("[]")
    if host == LOCAL_TARGETS[0]:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def env_name(field_name: str) -> str:
    """The environment variable of an `AgentSettings` field."""
    return ENV_PREFIX + ("THREADS" if field_name == "num_threads" else field_name.upper())


def _flag(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(text)
