"""Cost model transfer: a class's cost model version may descend from another class's
version (the class started from its nearest class's model); the column names that one.

Revision ID: b41d7e9c2a58
Revises: a7e3c1f29b40
Create Date: 2026-11-24 19:40:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "b41d7e9c2a58"
down_revision = "a7e3c1f29b40"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("cost_model_versions", sa.Column("transferred_from_id", sa.BigInteger(), nullable=True))
    op.create_foreign_key(
        op.f("fk_cost_model_versions_transferred_from_id_cost_model_versions"),
        "cost_model_versions",
        "cost_model_versions",
        ["transferred_from_id"],
        ["id"],
    )


def downgrade() -> None:
    op.drop_constraint(
        op.f("fk_cost_model_versions_transferred_from_id_cost_model_versions"), "cost_model_versions", type_="foreignkey"
    )
    op.drop_column("cost_model_versions", "transferred_from_id")
