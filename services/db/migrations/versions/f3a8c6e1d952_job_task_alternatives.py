"""Alternatives of a job's tasks: `job_tasks.alternative_of` names the task (its row) a
row is another program of (a 3x3 convolution's Winograd F(2,3) or F(4,3)); NULL for the
model's own tasks. The scheduler adds these rows when it starts a job on a CPU class.

Revision ID: f3a8c6e1d952
Revises: e7b2d4a9c615
Create Date: 2026-12-03 10:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "f3a8c6e1d952"
down_revision = "e7b2d4a9c615"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("job_tasks", sa.Column("alternative_of", sa.BigInteger(), nullable=True))
    op.create_foreign_key(
        op.f("fk_job_tasks_alternative_of_job_tasks"), "job_tasks", "job_tasks", ["alternative_of"], ["id"],
        ondelete="CASCADE",
    )


def downgrade() -> None:
    op.drop_constraint(op.f("fk_job_tasks_alternative_of_job_tasks"), "job_tasks", type_="foreignkey")
    op.drop_column("job_tasks", "alternative_of")
