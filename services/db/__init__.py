"""The farm's PostgreSQL schema and the small operations every farm process shares.

| module | what it holds |
|---|---|
| `settings.py` | `DatabaseSettings` (TUNEFARM_DATABASE_URL, pool sizes) |
| `models.py` | the tables (SQLAlchemy 2 ORM), their states and invariants |
| `session.py` | engine and session factory, `transaction()` (commit, rollback, typed errors) |
| `exceptions.py` | `DatabaseError` and its subclasses |
| `migrate.py` | Alembic from the package: `upgrade`, `check_schema`, `create_database`, ... |
| `queries.py` | tokens, the batch state machine, leases, exactly-once measurements, cost models |
| `codec.py` | the JSON forms of records kept in JSONB columns |
| `migrations/` | env.py and the revisions |

Nothing here starts a process or knows about HTTP, gRPC or RQ: the services build on it.
"""
