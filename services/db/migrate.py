"""Schema migrations (Alembic, shipped in this package) and the schema-version check.

The Alembic configuration is built here, so migrations run from the installed package
with no alembic.ini:

    upgrade(url)              # to the newest revision ("farm up", tests)
    check_schema(url)         # every service at start: raises SchemaOutOfDate
    create_database(url) / drop_database(url)

To write a new revision from a source checkout (against a database at head):

    python -c "from services.db.migrate import revision; revision(URL, 'what changes')"

then review it by hand (enums, partial indexes and downgrade steps need care).
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, exc, make_url, text
from sqlalchemy.engine import URL
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from services.db.exceptions import SchemaOutOfDate
from services.db.session import translate

MIGRATIONS_DIR = Path(__file__).with_name("migrations")
"""The Alembic script directory (env.py and versions/)."""

MAINTENANCE_DB = "postgres"
"""The database connected to when creating or dropping another one."""


def alembic_config(url: str | URL) -> Config:
    """An Alembic config for the database at `url`; env.py reads the URL from `attributes`
    (not from the ini options, whose interpolation would mangle '%' in passwords)."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["url"] = str(url) if isinstance(url, str) else url.render_as_string(hide_password=False)
    return config


def upgrade(url: str | URL, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str | URL, revision: str) -> None:
    """Downgrade to `revision` ("base": drop everything the migrations created)."""
    command.downgrade(alembic_config(url), revision)


def revision(url: str | URL, message: str) -> None:
    """Autogenerate a new revision from the models' difference to the database at `url`."""
    command.revision(alembic_config(url), message=message, autogenerate=True)


def head_revision() -> str:
    """The revision this code expects the database to be at."""
    head = ScriptDirectory.from_config(alembic_config("postgresql://")).get_current_head()
    assert head is not None, "no migration in services/db/migrations/versions"
    return head


def current_revision(url: str | URL) -> str | None:
    """The revision the database at `url` is at (None: never migrated)."""
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    except exc.SQLAlchemyError as error:
        raise translate(error) from error
    finally:
        engine.dispose()


def check_schema(url: str | URL) -> None:
    """Raise `SchemaOutOfDate` unless the database at `url` is at `head_revision()`."""
    current, expected = current_revision(url), head_revision()
    if current != expected:
        raise SchemaOutOfDate(current=current, expected=expected)


def create_database(url: str | URL) -> None:
    """Create the database `url` names (on the same server); `Conflict` if it exists,
    `Unavailable` if the server cannot be reached."""
    _admin(url, "CREATE DATABASE {}")


def drop_database(url: str | URL) -> None:
    """Drop the database `url` names, closing its open connections; no error if absent."""
    _admin(url, "DROP DATABASE IF EXISTS {} WITH (FORCE)")


def database_exists(url: str | URL) -> bool:
    target = make_url(url)
    engine = create_engine(target.set(database=MAINTENANCE_DB), poolclass=NullPool)
    try:
        with engine.connect() as conn:
            found = conn.execute(text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": target.database})
            return found.first() is not None
    except exc.SQLAlchemyError as error:
        raise translate(error) from error
    finally:
        engine.dispose()


def _admin(url: str | URL, statement: str) -> None:
    target = make_url(url)
    if not target.database:
        raise ValueError(f"{target!r} names no database")
    engine = create_engine(
        target.set(database=MAINTENANCE_DB), poolclass=NullPool, isolation_level="AUTOCOMMIT"
    )
    try:
        with engine.connect() as conn:
            name = conn.dialect.identifier_preparer.quote(target.database)
            conn.execute(text(statement.format(name)))
    except exc.SQLAlchemyError as error:
        raise translate(error) from error
    finally:
        engine.dispose()


def schema_revision(session: Session) -> str:
    """The revision the session's database is at (it has been migrated: the API checked at start)."""
    return str(session.execute(text("SELECT version_num FROM alembic_version")).scalar_one())
