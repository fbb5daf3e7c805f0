"""A farm database by its URL, outside the pooled sessions of a running service: the URL
of another database on the same server, and a one-off look from a command-line process
on a connection of its own (no pool, nothing left open).

Creating, dropping, migrating a database and asking whether it exists: `migrate`.
"""

from __future__ import annotations

from sqlalchemy import create_engine, make_url, text
from sqlalchemy.pool import NullPool


def with_database(url: str, database: str) -> str:
    """`url` naming the database `database` instead (the same server, user and password;
    the password stays in the text)."""
    return make_url(url).set(database=database).render_as_string(hide_password=False)


def agent_registered(url: str, *, name: str, token_id: int | None) -> bool:
    """Whether the agent `name` has registered (idle or busy) with the agent token
    `token_id`, asked on a connection of its own, closed after (`farm up` asks every half
    second while it waits for its agents); False when the database cannot be asked."""
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            n = conn.execute(
                text(
                    "SELECT count(*) FROM agents WHERE name = :n AND state IN ('idle', 'busy') AND token_id = :t"
                ),
                {"n": name, "t": token_id},
            ).scalar()
            return bool(n)
    except Exception:
        return False
    finally:
        engine.dispose()
