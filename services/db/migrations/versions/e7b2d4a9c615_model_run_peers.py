"""Model runs time the peers too: a timed run carries the ONNX graph onnxruntime and
OpenVINO are timed on beside the tuned model (its path, sha256, size and the farm's
signature) and the names of its inputs' arrays; the agent's timings of the peers (or why
a peer was not timed) are kept with the run.

Revision ID: e7b2d4a9c615
Revises: e4b7a2c9d136
Create Date: 2026-12-02 10:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "e7b2d4a9c615"
down_revision = "e4b7a2c9d136"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("model_runs", sa.Column("onnx_path", sa.Text(), nullable=True))
    op.add_column("model_runs", sa.Column("onnx_sha256", sa.String(length=64), nullable=True))
    op.add_column("model_runs", sa.Column("onnx_size", sa.BigInteger(), nullable=True))
    op.add_column("model_runs", sa.Column("onnx_signature", sa.Text(), nullable=True))
    op.add_column("model_runs", sa.Column("input_names", postgresql.JSONB(astext_type=sa.Text()), nullable=True))
    op.add_column("model_runs", sa.Column("peer_latencies", postgresql.JSONB(astext_type=sa.Text()), nullable=True))


def downgrade() -> None:
    for column in ("peer_latencies", "input_names", "onnx_signature", "onnx_size", "onnx_sha256", "onnx_path"):
        op.drop_column("model_runs", column)
