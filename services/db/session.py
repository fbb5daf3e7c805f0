"""Engine, sessions and the one transaction context manager every farm process uses.

    factory = make_session_factory(DatabaseSettings())
    with transaction(factory) as session:
        ...   # committed on exit, rolled back on any exception

Driver errors never leave `transaction`: they become the typed errors of `exceptions`
(a unique violation is a `Conflict`, a deadlock a `Contention`, a lost server `Unavailable`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from sqlalchemy import Engine, create_engine, exc
from sqlalchemy.orm import Session, sessionmaker

from services.db.exceptions import (
    Conflict,
    ConstraintViolation,
    Contention,
    DatabaseError,
    Unavailable,
)
from services.db.settings import DatabaseSettings

T = TypeVar("T")

# SQLSTATE codes (PostgreSQL appendix A) that get their own error class.
UNIQUE_VIOLATION = "23505"
EXCLUSION_VIOLATION = "23P01"
SERIALIZATION_FAILURE = "40001"
DEADLOCK_DETECTED = "40P01"
LOCK_NOT_AVAILABLE = "55P03"
DUPLICATE_DATABASE = "42P04"


def make_engine(settings: DatabaseSettings | str) -> Engine:
    """An engine for `settings` (or a bare URL, with the default pool settings)."""
    if isinstance(settings, str):
        settings = DatabaseSettings(database_url=settings)
    return create_engine(
        settings.database_url,
        pool_size=settings.database_pool_size,
        max_overflow=settings.database_max_overflow,
        pool_timeout=settings.database_pool_timeout,
        pool_pre_ping=True,
        echo=settings.database_echo,
    )


def make_session_factory(source: Engine | DatabaseSettings | str) -> sessionmaker[Session]:
    """Sessions bound to `source`. Objects stay readable after commit (a snapshot, not
    reloaded), so values read in a transaction can be returned from it."""
    engine = source if isinstance(source, Engine) else make_engine(source)
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def transaction(factory: sessionmaker[Session]) -> Iterator[Session]:
    """A session whose work is committed when the block ends and rolled back when it raises.

    SQLAlchemy and driver errors, from the block or from the commit, are re-raised as
    `DatabaseError` subclasses (see `translate`); other exceptions pass through unchanged.
    """
    session = factory()
    try:
        yield session
        session.commit()
    except exc.SQLAlchemyError as error:
        session.rollback()
        raise translate(error) from error
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def retrying(
    factory: sessionmaker[Session],
    work: Callable[[Session], T],
    *,
    patience_secs: float,
    pause_secs: float = 0.5,
    on_retry: Callable[[DatabaseError], None] = lambda error: None,
) -> T:
    """`work(session)` in one `transaction`, run again while the database is unreachable
    (a restart: `Unavailable`) or the transaction lost a deadlock (`Contention`), until
    `patience_secs` have passed; then the last error is raised. For work that must not
    fail because the database went away for a moment (a build worker storing its builds).
    `work` must be safe to run again: a failed attempt was rolled back."""
    deadline = time.monotonic() + patience_secs
    while True:
        try:
            with transaction(factory) as session:
                return work(session)
        except (Unavailable, Contention) as error:
            if time.monotonic() >= deadline:
                raise
            on_retry(error)
            time.sleep(pause_secs)


def translate(error: exc.SQLAlchemyError) -> DatabaseError:
    """The `DatabaseError` for a SQLAlchemy error."""
    orig = getattr(error, "orig", None)
    code = getattr(orig, "pgcode", None) or getattr(orig, "sqlstate", None)
    diag = getattr(orig, "diag", None)
    constraint = getattr(diag, "constraint_name", None)
    message = str(orig).strip() if orig is not None else str(error)
    if code in (UNIQUE_VIOLATION, EXCLUSION_VIOLATION, DUPLICATE_DATABASE):
        return Conflict(message, constraint=constraint)
    if isinstance(error, exc.IntegrityError):
        return ConstraintViolation(message, constraint=constraint)
    if code in (SERIALIZATION_FAILURE, DEADLOCK_DETECTED, LOCK_NOT_AVAILABLE):
        return Contention(message)
    if isinstance(error, (exc.OperationalError, exc.InterfaceError, exc.TimeoutError)) or getattr(
        error, "connection_invalidated", False
    ):
        return Unavailable(message)
    return DatabaseError(message)


SQLAlchemyError = exc.SQLAlchemyError
"""SQLAlchemy's own root error, for callers outside `services.db` that report what escapes
untranslated from outside a `transaction` (a malformed URL, Alembic's migrations).
(`DatabaseError` here is `services.db.exceptions.DatabaseError`, what `translate` makes.)"""


SessionFactory = sessionmaker[Session]
"""What `make_session_factory` returns, by the name callers outside `services.db` use."""
