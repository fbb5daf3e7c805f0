"""Errors of the farm's database layer: one root, small named subclasses.

`session.transaction` turns driver errors into these, so callers never catch
SQLAlchemy or psycopg2 exceptions; the operations of `services.db` raise them directly.
"""

from __future__ import annotations


class DatabaseError(Exception):
    """Root of every error raised by `services.db`."""


class RowNotFound(DatabaseError):
    """A row the caller named does not exist."""


class Conflict(DatabaseError):
    """A unique constraint refused the write (a duplicate). `constraint` names it when known."""

    def __init__(self, message: str, *, constraint: str | None = None):
        super().__init__(message)
        self.constraint = constraint


class ConstraintViolation(DatabaseError):
    """A foreign-key, check or not-null constraint refused the write."""

    def __init__(self, message: str, *, constraint: str | None = None):
        super().__init__(message)
        self.constraint = constraint


class Contention(DatabaseError):
    """A deadlock or serialization failure: the transaction may be retried as a whole."""


class Unavailable(DatabaseError):
    """The database could not be reached or dropped the connection."""


class SchemaOutOfDate(DatabaseError):
    """The database's schema revision is not the one this code expects."""

    def __init__(self, *, current: str | None, expected: str):
        super().__init__(
            f"database schema is at revision {current or '<none>'}, this code expects {expected}; "
            "run the migrations (services.db.migrate.upgrade)"
        )
        self.current = current
        self.expected = expected


class LeaseNotHeld(DatabaseError):
    """The sender does not hold an active lease on the batch it writes to (another agent's
    lease, an expired or finished one, or a candidate of another batch)."""


class TokenRevoked(DatabaseError):
    """The caller's token was revoked: what it asks is not done (a service's token cache
    may still have let the call through for a moment after the revocation committed)."""


class InvalidTransition(DatabaseError):
    """A state change the row's current state does not allow (e.g. a done batch made ready)."""
