"""The pretrained base under a job's cost model: `jobs.cost_model_pretrained` says what the
pretrained model the job's class model started from (or descends from) learnt from; NULL
for a model without one (`services.scheduler.shared_model`).

Revision ID: 7710f166f039
Revises: f3a8c6e1d952
Create Date: 2026-12-10 10:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "7710f166f039"
down_revision = "f3a8c6e1d952"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("cost_model_pretrained", postgresql.JSONB(astext_type=sa.Text()), nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "cost_model_pretrained")
