"""Who may call the lease service, and as which agent.

Authentication: `authorization: Bearer <agent token>` on every call. A missing or
unknown token is UNAUTHENTICATED; a team token is PERMISSION_DENIED. `Register` answers
with a secret of its own (`RegisterResponse.agent_secret`; the agent row keeps its hash),
and every later call naming the agent must carry it (`x-tunefarm-agent-secret`) with the
agent's token: agents that share a token cannot act as each other. A call naming an
agent without both is PERMISSION_DENIED, saying nothing of the agent. The same name
registered again (a restarted agent) gets a new secret; the old one is refused from then
on (by another replica of the service within `token_cache_secs`).

A lease is the agent's only while it is active (`held_lease`): results and files of any
other are refused (FAILED_PRECONDITION).
"""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

import grpc

from services.db import agents, leases, tokens
from services.db.models import Agent, Lease
from services.db.revocations import RevocationListener, VerifiedTokens
from services.db.session import Session, SessionFactory, transaction
from services.db.states import LeaseState, TokenKind
from services.protocol import wire
from services.protocol.errors import (
    UNKNOWN_AGENT_PREFIX,
    LeaseLost,
    PermissionDenied,
    Unauthenticated,
    UnknownAgent,
)

FINGERPRINT_KEYS = (
    "hostname",
    "arch",
    "cpu_model",
    "physical_cores",
    "llvm_cpu",
    "isa_features",
    "gpu_name",
    "gpu_compute_capability",
    "tvm_version",
    "agent_version",
    "emulated",
)
"""Capabilities of the measuring agent copied into each measurement's fingerprint."""


@dataclass(frozen=True)
class AgentInfo:
    """What the calls of a registered agent need of its row (cached by `Auth`)."""

    agent_id: int
    token_id: int | None
    device_class_id: int
    name: str
    fingerprint: dict[str, Any]
    secret_hash: str | None = None  # of the secret its latest registration was given
    emulated: bool = False  # registered as running under an emulator: its costs are not the device's


class Auth:
    """Verifies bearer tokens and agent ownership, with a short-lived cache so that the
    hot calls (heartbeats, leases, results) do not ask the database every time."""

    def __init__(self, sessions: SessionFactory, ttl: float, revocations: RevocationListener | None = None):
        self.sessions = sessions
        self.ttl = ttl
        self._lock = threading.Lock()
        self._tokens = VerifiedTokens[int](ttl, revocations)  # token hash -> token id
        self._agents: dict[int, tuple[AgentInfo, float]] = {}

    def token_id(self, context: grpc.ServicerContext) -> int:
        plain = wire.bearer_token(context.invocation_metadata() or ())
        if plain is None:
            raise Unauthenticated("no bearer token (metadata 'authorization: Bearer <agent token>')")
        key = tokens.hash_token(plain)
        hit = self._tokens.get(key)
        if hit is not None:
            return hit
        with transaction(self.sessions) as s:
            token = tokens.verify_token(s, plain=plain, kind=TokenKind.AGENT)
            if token is None:
                if tokens.verify_token(s, plain=plain, kind=TokenKind.TEAM) is not None:
                    raise PermissionDenied("a team token cannot act as a device agent; use an agent token")
                raise Unauthenticated("unknown or revoked token")
            token_id = token.id
        self._tokens.put(key, token_id)
        return token_id

    def token_revoked(self, context: grpc.ServicerContext) -> None:
        """The database refused the call's token as revoked (`TokenRevoked`): drop it from
        the cache now, whether or not the revocation's notification has arrived yet, so
        that every later call with it is refused too."""
        plain = wire.bearer_token(context.invocation_metadata() or ())
        if plain is not None:
            self._tokens.revoke(tokens.hash_token(plain))

    def agent(self, agent_id: int, token_id: int, context: grpc.ServicerContext) -> AgentInfo:
        """The agent a call names, if the call is that agent's: its token, and the
        secret of its latest registration. Raises `UnknownAgent`, or `PermissionDenied`
        that says nothing of the agent."""
        secret = wire.agent_secret(context.invocation_metadata() or ())
        now = time.monotonic()
        with self._lock:
            hit = self._agents.get(agent_id)
        info = hit[0] if hit is not None and hit[1] > now else None
        if info is not None and _is_agents(info, token_id, secret):
            return info
        # Not cached, or refused by what is: a registration elsewhere (another replica)
        # may have changed the secret since; the database decides.
        with transaction(self.sessions) as s:
            row = agents.find_agent(s, agent_id=agent_id)
            if row is None:
                raise UnknownAgent(f"{UNKNOWN_AGENT_PREFIX} {agent_id}: register again")
            info = agent_info(row)
        self.remember(info)
        if not _is_agents(info, token_id, secret):
            raise PermissionDenied(
                f"this call may not act as agent {agent_id}: it needs the agent's token and the secret "
                f"its latest registration returned (metadata {wire.AGENT_SECRET_HEADER})"
            )
        return info

    def remember(self, info: AgentInfo) -> None:
        with self._lock:
            self._agents[info.agent_id] = (info, time.monotonic() + self.ttl)

    def forget(self, agent_id: int) -> None:
        with self._lock:
            self._agents.pop(agent_id, None)


def agent_info(row: Agent) -> AgentInfo:
    caps = dict(row.capabilities or {})
    return AgentInfo(
        agent_id=row.id,
        token_id=row.token_id,
        device_class_id=row.device_class_id,
        name=row.name,
        fingerprint={"agent": row.name, **{k: caps[k] for k in FINGERPRINT_KEYS if k in caps}},
        secret_hash=row.secret_hash,
        emulated=bool(caps.get("emulated", False)),
    )


def _is_agents(info: AgentInfo, token_id: int, secret: str | None) -> bool:
    """Whether a call with this token and secret is the agent's own."""
    if info.token_id != token_id or info.secret_hash is None or not secret:
        return False
    return hmac.compare_digest(tokens.hash_token(secret), info.secret_hash)


def new_agent_secret() -> str:
    """A registration's secret: 256 random bits (its unsalted sha256 is what is stored)."""
    return wire.AGENT_SECRET_PREFIX + secrets.token_urlsafe(tokens.TOKEN_BYTES)


def held_lease(s: Session, lease_id: int, agent_id: int) -> Lease:
    """The lease, if it is the agent's active one; otherwise `LeaseLost`."""
    lease = leases.find_lease(s, lease_id=lease_id)
    if lease is None or lease.agent_id != agent_id:
        raise LeaseLost(f"lease {lease_id} is not held by agent {agent_id}")
    if lease.state is not LeaseState.ACTIVE:
        raise LeaseLost(f"lease {lease_id} is {lease.state}")
    return lease
