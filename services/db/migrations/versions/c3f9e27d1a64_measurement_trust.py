"""Measurement trust: a timing floor (error kind below_floor, workloads' buffer bytes),
confirmations of a task's best (confirmation batches, the confirmations table, the
measurement's confirmation state, the task's confirmed best), agents' standing
(confirmation counters, below-floor count, quarantine), and the order in which the
class's cost model learns measurements whose agent is in good standing (vouched_seq).

Measurements stored before this revision were all believed: each is vouched for with its
id, and the sequence continues after the largest, so cost model versions saved before
(whose last_measurement_id is an id) keep their place.

Revision ID: c3f9e27d1a64
Revises: c5d2e8a1f073
Create Date: 2026-11-25 09:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "c3f9e27d1a64"
down_revision = "c5d2e8a1f073"
branch_labels = None
depends_on = None

CONFIRMATION_STATE = postgresql.ENUM(
    "pending", "confirmed", "disputed", "failed", name="confirmation_state", create_type=False
)
ERROR_KIND = postgresql.ENUM(name="error_kind", create_type=False)
OLD_ERROR_KINDS = ("none", "build_error", "build_timeout", "run_crash", "run_error", "run_timeout", "wrong_result")


def upgrade() -> None:
    op.execute("ALTER TYPE error_kind ADD VALUE IF NOT EXISTS 'below_floor'")
    CONFIRMATION_STATE.create(op.get_bind())
    op.add_column("workloads", sa.Column("io_bytes", sa.BigInteger(), nullable=True))
    for name in ("below_floor", "confirmations_agreed", "confirmations_disputed"):
        op.add_column("agents", sa.Column(name, sa.BigInteger(), server_default=sa.text("0"), nullable=False))
    op.add_column("agents", sa.Column("quarantined_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("job_tasks", sa.Column("best_confirmed", sa.Boolean(), server_default=sa.text("false"), nullable=False))
    op.add_column("job_tasks", sa.Column("confirmed_cost", sa.Double(), nullable=True))
    op.add_column("job_tasks", sa.Column("confirmed_measurement_id", sa.BigInteger(), nullable=True))
    op.create_foreign_key(
        op.f("fk_job_tasks_confirmed_measurement_id_measurements"),
        "job_tasks",
        "measurements",
        ["confirmed_measurement_id"],
        ["id"],
    )
    op.add_column("batches", sa.Column("confirms_measurement_id", sa.BigInteger(), nullable=True))
    op.add_column("batches", sa.Column("avoid_agent_id", sa.BigInteger(), nullable=True))
    op.create_foreign_key(
        op.f("fk_batches_confirms_measurement_id_measurements"), "batches", "measurements", ["confirms_measurement_id"], ["id"]
    )
    op.create_foreign_key(op.f("fk_batches_avoid_agent_id_agents"), "batches", "agents", ["avoid_agent_id"], ["id"])
    _measurements_upgrade()
    _confirmations_table()


def _measurements_upgrade() -> None:
    op.add_column("measurements", sa.Column("confirmation", CONFIRMATION_STATE, nullable=True))
    op.add_column("measurements", sa.Column("confirmed_by_agent_id", sa.BigInteger(), nullable=True))
    op.add_column("measurements", sa.Column("vouched_seq", sa.BigInteger(), nullable=True))
    op.create_foreign_key(
        op.f("fk_measurements_confirmed_by_agent_id_agents"), "measurements", "agents", ["confirmed_by_agent_id"], ["id"]
    )
    op.execute("CREATE SEQUENCE measurements_vouched_seq")
    op.execute("UPDATE measurements SET vouched_seq = id")
    op.execute("SELECT setval('measurements_vouched_seq', (SELECT COALESCE(MAX(id), 0) + 1 FROM measurements), false)")
    op.create_index("ix_measurements_job_task_id_cost", "measurements", ["job_task_id", "cost"], unique=False)
    op.create_index(
        "ix_measurements_device_class_id_vouched_seq",
        "measurements",
        ["device_class_id", "vouched_seq"],
        unique=False,
        postgresql_where=sa.text("vouched_seq IS NOT NULL"),
    )
    op.create_index(
        "ix_measurements_unvouched",
        "measurements",
        ["device_class_id"],
        unique=False,
        postgresql_where=sa.text("vouched_seq IS NULL"),
    )


def _confirmations_table() -> None:
    op.create_table(
        "confirmations",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("batch_candidate_id", sa.BigInteger(), nullable=False),
        sa.Column("measurement_id", sa.BigInteger(), nullable=False),
        sa.Column("agent_id", sa.BigInteger(), nullable=True),
        sa.Column("lease_id", sa.BigInteger(), nullable=True),
        sa.Column("cost", sa.Double(), nullable=True),
        sa.Column("error_kind", ERROR_KIND, nullable=False),
        sa.Column("outcome", CONFIRMATION_STATE, nullable=False),
        sa.Column("record", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("fingerprint", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.CheckConstraint("cost IS NULL OR cost >= 0", name=op.f("ck_confirmations_cost_nonnegative")),
        sa.CheckConstraint("(error_kind = 'none') OR cost IS NULL", name=op.f("ck_confirmations_error_has_no_cost")),
        sa.ForeignKeyConstraint(
            ["batch_candidate_id"], ["batch_candidates.id"], name=op.f("fk_confirmations_batch_candidate_id_batch_candidates")
        ),
        sa.ForeignKeyConstraint(["measurement_id"], ["measurements.id"], name=op.f("fk_confirmations_measurement_id_measurements")),
        sa.ForeignKeyConstraint(["agent_id"], ["agents.id"], name=op.f("fk_confirmations_agent_id_agents")),
        sa.ForeignKeyConstraint(["lease_id"], ["leases.id"], name=op.f("fk_confirmations_lease_id_leases")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_confirmations")),
        sa.UniqueConstraint("batch_candidate_id", name=op.f("uq_confirmations_batch_candidate_id")),
    )
    op.create_index("ix_confirmations_measurement_id", "confirmations", ["measurement_id"], unique=False)
    op.create_index("ix_confirmations_agent_id", "confirmations", ["agent_id"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_confirmations_agent_id", table_name="confirmations")
    op.drop_index("ix_confirmations_measurement_id", table_name="confirmations")
    op.drop_table("confirmations")
    # Confirmation batches go with the confirmations (their candidates first).
    op.execute(
        "DELETE FROM leases WHERE batch_id IN (SELECT id FROM batches WHERE confirms_measurement_id IS NOT NULL)"
    )
    op.execute(
        "DELETE FROM batch_candidates WHERE batch_id IN (SELECT id FROM batches WHERE confirms_measurement_id IS NOT NULL)"
    )
    op.execute("DELETE FROM batches WHERE confirms_measurement_id IS NOT NULL")
    op.drop_index("ix_measurements_unvouched", table_name="measurements", postgresql_where=sa.text("vouched_seq IS NULL"))
    op.drop_index(
        "ix_measurements_device_class_id_vouched_seq",
        table_name="measurements",
        postgresql_where=sa.text("vouched_seq IS NOT NULL"),
    )
    op.drop_index("ix_measurements_job_task_id_cost", table_name="measurements")
    op.drop_constraint(op.f("fk_measurements_confirmed_by_agent_id_agents"), "measurements", type_="foreignkey")
    for name in ("vouched_seq", "confirmed_by_agent_id", "confirmation"):
        op.drop_column("measurements", name)
    op.execute("DROP SEQUENCE measurements_vouched_seq")
    op.drop_constraint(op.f("fk_batches_avoid_agent_id_agents"), "batches", type_="foreignkey")
    op.drop_constraint(op.f("fk_batches_confirms_measurement_id_measurements"), "batches", type_="foreignkey")
    op.drop_column("batches", "avoid_agent_id")
    op.drop_column("batches", "confirms_measurement_id")
    op.drop_constraint(op.f("fk_job_tasks_confirmed_measurement_id_measurements"), "job_tasks", type_="foreignkey")
    for name in ("confirmed_measurement_id", "confirmed_cost", "best_confirmed"):
        op.drop_column("job_tasks", name)
    for name in ("quarantined_at", "confirmations_disputed", "confirmations_agreed", "below_floor"):
        op.drop_column("agents", name)
    op.drop_column("workloads", "io_bytes")
    CONFIRMATION_STATE.drop(op.get_bind())
    _drop_below_floor()


def _drop_below_floor() -> None:
    """PostgreSQL cannot drop an enum value: the type is made again without it (a
    below-floor result becomes the run error it was stored instead of)."""
    old = ", ".join(f"'{k}'" for k in OLD_ERROR_KINDS)
    check = op.f("ck_measurements_error_has_no_cost")
    op.drop_constraint(check, "measurements", type_="check")
    op.execute("ALTER TYPE error_kind RENAME TO error_kind_with_below_floor")
    op.execute(f"CREATE TYPE error_kind AS ENUM ({old})")
    op.execute(
        "ALTER TABLE measurements ALTER COLUMN error_kind TYPE error_kind USING "
        "(CASE WHEN error_kind::text = 'below_floor' THEN 'run_error' ELSE error_kind::text END)::error_kind"
    )
    op.execute("DROP TYPE error_kind_with_below_floor")
    op.create_check_constraint(check, "measurements", "(error_kind = 'none') OR cost IS NULL")
