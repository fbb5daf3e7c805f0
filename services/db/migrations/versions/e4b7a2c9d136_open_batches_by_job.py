"""Open batches by job: a partial index on the batches not yet built or leased, so a
job's progress (polled by every `--follow` and dashboard) finds its longest-waiting open
batch among a handful of rows, however many batches the job has finished.

Revision ID: e4b7a2c9d136
Revises: c5e2a9d4f713
Create Date: 2026-11-27 10:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "e4b7a2c9d136"
down_revision = "c5e2a9d4f713"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        "ix_batches_open_by_job",
        "batches",
        ["job_id"],
        unique=False,
        postgresql_where=sa.text("state IN ('proposed', 'building', 'ready')"),
    )


def downgrade() -> None:
    op.drop_index("ix_batches_open_by_job", table_name="batches", postgresql_where=sa.text("state IN ('proposed', 'building', 'ready')"))
