"""Control plane: a model's inputs, outputs and import warnings; a job's result and the
training size of the shared cost model its first batch was ranked with.

Revision ID: dfafefe04f90
Revises: d0c51dc0fe77
Create Date: 2026-11-23 00:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "dfafefe04f90"
down_revision = "d0c51dc0fe77"
branch_labels = None
depends_on = None

EMPTY_LIST = sa.text("'[]'::jsonb")


def upgrade() -> None:
    for column in ("inputs", "outputs", "warnings"):
        op.add_column(
            "models",
            sa.Column(column, postgresql.JSONB(astext_type=sa.Text()), server_default=EMPTY_LIST, nullable=False),
        )
    op.add_column("jobs", sa.Column("start_model_trained_on", sa.Integer(), nullable=True))
    op.add_column("jobs", sa.Column("result", postgresql.JSONB(astext_type=sa.Text()), nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "result")
    op.drop_column("jobs", "start_model_trained_on")
    for column in ("warnings", "outputs", "inputs"):
        op.drop_column("models", column)
