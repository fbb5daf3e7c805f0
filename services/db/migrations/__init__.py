"""Alembic script directory of the farm schema (see services.db.migrate)."""
