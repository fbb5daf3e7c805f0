"""Agent secrets and artifact signatures: each registration of an agent gets a secret
(its hash kept with the agent) that every later call naming the agent must carry; built
kernels and model libraries keep the farm's signature, which agents check before loading.

Revision ID: c5e2a9d4f713
Revises: c3f9e27d1a64
Create Date: 2026-11-27 10:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "c5e2a9d4f713"
down_revision = "c3f9e27d1a64"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("agents", sa.Column("secret_hash", sa.String(length=64), nullable=True))
    op.add_column("batch_candidates", sa.Column("artifact_signature", sa.Text(), nullable=True))
    op.add_column("model_runs", sa.Column("library_signature", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("model_runs", "library_signature")
    op.drop_column("batch_candidates", "artifact_signature")
    op.drop_column("agents", "secret_hash")
