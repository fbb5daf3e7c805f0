"""Alembic revisions of the farm schema (loaded by Alembic, not imported)."""
