"""TLS between a local farm's agents and its lease service (`farm up --tls-cert F
--tls-key F`, mutual TLS with `--tls-client-ca`): the files, checked before anything
starts, and the settings they become for the lease service and the agent."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tunefarm.errors import UsageError


@dataclass(frozen=True)
class FarmTls:
    """TLS between the agents and the lease service (`farm up --tls-cert F --tls-key F`)."""

    cert: Path  # the lease service's certificate chain (PEM)
    key: Path  # its private key
    ca: Path | None = None  # what the local agent trusts (the CA that signed `cert`); default: the system's roots
    client_ca: Path | None = None  # mutual TLS: agents must present a certificate this CA signed
    agent_cert: Path | None = None  # the local agent's certificate and key (mutual TLS)
    agent_key: Path | None = None
    server_name: str | None = None  # the name in `cert` the local agent checks (default: the address's host)

    def check(self) -> None:
        """`UsageError` for files that are not there or a set that cannot work."""
        for flag, path in (("--tls-cert", self.cert), ("--tls-key", self.key), ("--tls-ca", self.ca),
                           ("--tls-client-ca", self.client_ca), ("--agent-tls-cert", self.agent_cert),
                           ("--agent-tls-key", self.agent_key)):
            if path is not None and not Path(path).is_file():
                raise UsageError(f"{flag} {path}: no such file")
        if bool(self.agent_cert) != bool(self.agent_key):
            raise UsageError("--agent-tls-cert and --agent-tls-key go together")
        if self.client_ca and not self.agent_cert:
            raise UsageError("with --tls-client-ca (mutual TLS) the local agent needs --agent-tls-cert and --agent-tls-key")

    def env(self) -> dict[str, str]:
        """The lease service's and the agent's TUNEFARM_* settings."""
        files = {
            "TUNEFARM_TLS_CERT_FILE": self.cert,
            "TUNEFARM_TLS_KEY_FILE": self.key,
            "TUNEFARM_TLS_CLIENT_CA_FILE": self.client_ca,
            "TUNEFARM_AGENT_TLS_CA": self.ca,
            "TUNEFARM_AGENT_TLS_CERT": self.agent_cert,
            "TUNEFARM_AGENT_TLS_KEY": self.agent_key,
        }
        env = {k: str(Path(v).resolve()) for k, v in files.items() if v is not None}
        env["TUNEFARM_AGENT_TLS"] = "1"
        if self.server_name:
            env["TUNEFARM_AGENT_TLS_SERVER_NAME"] = self.server_name
        return env
