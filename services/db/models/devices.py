"""The boards that measure: device classes (one TVM target each) and their agents."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, Index, text
from sqlalchemy.orm import Mapped, mapped_column, relationship

from services.db.models.base import Base, created_time, foreign_key, pg_enum, primary_key, sha256_hex
from services.db.states import AgentState

AGENT_STATE = pg_enum(AgentState, "agent_state")


class DeviceClass(Base):
    """A kind of board: every agent of a class measures for the same TVM target."""

    __tablename__ = "device_classes"

    id: Mapped[int] = primary_key()
    name: Mapped[str] = mapped_column(unique=True)
    target: Mapped[dict[str, Any]]  # TVM's JSON target dict
    description: Mapped[str] = mapped_column(server_default="")
    created_at: Mapped[datetime] = created_time()


class Agent(Base):
    """A board's agent. Counters are kept up to date by `measurements.record_measurement` and,
    for its timings' confirmations, `confirmations.record_confirmations`; whether its
    timings are believed follows from them (`services.db.trust`)."""

    __tablename__ = "agents"
    __table_args__ = (Index("ix_agents_device_class_id", "device_class_id"),)

    id: Mapped[int] = primary_key()
    device_class_id: Mapped[int] = foreign_key("device_classes.id")
    name: Mapped[str] = mapped_column(unique=True)
    token_id: Mapped[int | None] = foreign_key("tokens.id", ondelete="SET NULL", nullable=True)
    capabilities: Mapped[dict[str, Any]] = mapped_column(server_default=text("'{}'::jsonb"))
    state: Mapped[AgentState] = mapped_column(AGENT_STATE, server_default=AgentState.IDLE.value)
    registered_at: Mapped[datetime] = created_time()
    last_heartbeat_at: Mapped[datetime | None]
    measurements_done: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    # {error kind: count} of the agent's measurements that are errors.
    errors_by_kind: Mapped[dict[str, Any]] = mapped_column(server_default=text("'{}'::jsonb"))
    # Its results below the timing floor (`services.db.timing_floor`), measurements and confirmations.
    below_floor: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    # Its timings another measurement confirmed / another agent found slower (or wrong).
    confirmations_agreed: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    confirmations_disputed: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    # Set by an operator (`tunefarm farm agent quarantine`): no leases (state disabled), and its
    # unconfirmed measurements count for nothing (no best, no training).
    quarantined_at: Mapped[datetime | None]
    # sha256 of the secret its last registration was given (`tokens.hash_token`): every
    # call naming the agent must carry that secret; None: none issued yet.
    secret_hash: Mapped[str | None] = sha256_hex(nullable=True)

    device_class: Mapped[DeviceClass] = relationship()
