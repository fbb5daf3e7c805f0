"""The farm's tenants and their credentials: teams, bearer tokens, dashboard sessions."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import CheckConstraint, Index, String
from sqlalchemy.orm import Mapped, mapped_column, relationship

from services.db.models.base import SHA256_HEX_LEN, Base, created_time, foreign_key, pg_enum, primary_key
from services.db.states import TokenKind

TOKEN_KIND = pg_enum(TokenKind, "token_kind")


class Team(Base):
    __tablename__ = "teams"

    id: Mapped[int] = primary_key()
    name: Mapped[str] = mapped_column(unique=True)
    created_at: Mapped[datetime] = created_time()


class Token(Base):
    """A bearer token, stored as the sha256 of the plain token (shown once, at creation)."""

    __tablename__ = "tokens"
    __table_args__ = (
        # Team tokens belong to a team; agent tokens to no team (useless on the team API).
        CheckConstraint("(kind = 'team') = (team_id IS NOT NULL)", name="team_iff_team_kind"),
        Index("ix_tokens_team_id", "team_id"),
    )

    id: Mapped[int] = primary_key()
    kind: Mapped[TokenKind] = mapped_column(TOKEN_KIND)
    team_id: Mapped[int | None] = foreign_key("teams.id", ondelete="CASCADE", nullable=True)
    token_hash: Mapped[str] = mapped_column(String(SHA256_HEX_LEN), unique=True)
    prefix: Mapped[str] = mapped_column(String(24))  # the first characters, to tell tokens apart
    label: Mapped[str] = mapped_column(server_default="")
    created_at: Mapped[datetime] = created_time()
    revoked_at: Mapped[datetime | None]

    team: Mapped[Team | None] = relationship()


class DashboardSession(Base):
    """A login to the dashboard: its cookie holds a random session id, stored here as
    its sha256 only. Logging out deletes the row; it ends at `expires_at`, and when the
    token it was opened with is revoked (or its team deleted)."""

    __tablename__ = "dashboard_sessions"
    __table_args__ = (Index("ix_dashboard_sessions_expires_at", "expires_at"),)

    id: Mapped[int] = primary_key()
    session_hash: Mapped[str] = mapped_column(String(SHA256_HEX_LEN), unique=True)
    team_id: Mapped[int] = foreign_key("teams.id", ondelete="CASCADE")
    token_id: Mapped[int] = foreign_key("tokens.id", ondelete="CASCADE")
    created_at: Mapped[datetime] = created_time()
    expires_at: Mapped[datetime]
