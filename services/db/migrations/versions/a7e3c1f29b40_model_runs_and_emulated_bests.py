"""Model runs: a tuned model run on an agent of its class (a class whose code the
scheduler's host cannot run), for its outputs and its latency; and whether a job task's
best time was measured under an emulator.

Revision ID: a7e3c1f29b40
Revises: dfafefe04f90
Create Date: 2026-11-24 10:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "a7e3c1f29b40"
down_revision = "dfafefe04f90"
branch_labels = None
depends_on = None

MODEL_RUN_STATE = postgresql.ENUM("ready", "leased", "done", "failed", name="model_run_state", create_type=False)


def upgrade() -> None:
    MODEL_RUN_STATE.create(op.get_bind())
    op.create_table(
        "model_runs",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("job_id", sa.BigInteger(), nullable=False),
        sa.Column("device_class_id", sa.BigInteger(), nullable=False),
        sa.Column("state", MODEL_RUN_STATE, server_default="ready", nullable=False),
        sa.Column("library_path", sa.Text(), nullable=False),
        sa.Column("library_sha256", sa.String(length=64), nullable=False),
        sa.Column("library_size", sa.BigInteger(), nullable=False),
        sa.Column("inputs_path", sa.Text(), nullable=False),
        sa.Column("inputs_sha256", sa.String(length=64), nullable=False),
        sa.Column("inputs_size", sa.BigInteger(), nullable=False),
        sa.Column("repeat", sa.Integer(), nullable=False),
        sa.Column("warmup", sa.Integer(), nullable=False),
        sa.Column("timeout_secs", sa.Double(), nullable=False),
        sa.Column("attempts", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("agent_id", sa.BigInteger(), nullable=True),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("outputs_path", sa.Text(), nullable=True),
        sa.Column("result", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint("attempts >= 0", name=op.f("ck_model_runs_attempts_nonnegative")),
        sa.CheckConstraint(
            "state <> 'leased' OR (agent_id IS NOT NULL AND expires_at IS NOT NULL)",
            name=op.f("ck_model_runs_leased_has_agent"),
        ),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_model_runs_job_id_jobs"), ondelete="CASCADE"),
        sa.ForeignKeyConstraint(
            ["device_class_id"], ["device_classes.id"], name=op.f("fk_model_runs_device_class_id_device_classes")
        ),
        sa.ForeignKeyConstraint(["agent_id"], ["agents.id"], name=op.f("fk_model_runs_agent_id_agents")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_model_runs")),
    )
    op.create_index(
        "ix_model_runs_queue",
        "model_runs",
        ["device_class_id", "id"],
        unique=False,
        postgresql_where=sa.text("state IN ('ready', 'leased')"),
    )
    op.create_index("ix_model_runs_job_id", "model_runs", ["job_id"], unique=False)
    op.add_column("job_tasks", sa.Column("best_emulated", sa.Boolean(), server_default=sa.text("false"), nullable=False))


def downgrade() -> None:
    op.drop_column("job_tasks", "best_emulated")
    op.drop_index("ix_model_runs_job_id", table_name="model_runs")
    op.drop_index("ix_model_runs_queue", table_name="model_runs", postgresql_where=sa.text("state IN ('ready', 'leased')"))
    op.drop_table("model_runs")
    MODEL_RUN_STATE.drop(op.get_bind())
