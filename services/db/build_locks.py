"""Build locks: who is building a batch right now, as PostgreSQL sees it (`holding`, `held`).

A build worker takes the lock (a session-level advisory lock on `(BUILD_LOCK_NAMESPACE,
batch id)`, on a connection of its own) before it claims a batch and keeps it until the
batch's builds are stored. A worker that dies (SIGKILL, a lost machine) or loses its
database connection loses the lock with it, at once: PostgreSQL ends the session.

So a batch that is proposed or building while nobody holds its lock is being built by
no one. The scheduler (`FarmMeasurer`) looks for exactly that, and whether the batch's
RQ job still waits in Redis, to enqueue the build again: a killed worker's batch, or a
batch whose job Redis lost, is built by another worker.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from sqlalchemy import Engine, exc, text
from sqlalchemy.orm import Session

from services.db.session import translate

BUILD_LOCK_NAMESPACE = 0x74660002
"""First key of the build locks (the scheduler's job locks use 0x74660001)."""

_TRY_LOCK = text("SELECT pg_try_advisory_lock(:ns, :id)")
_UNLOCK = text("SELECT pg_advisory_unlock(:ns, :id)")
# The two-key form of an advisory lock shows up in pg_locks as classid, objid (both oid,
# unsigned), objsubid 2.
# Advisory locks belong to a database; pg_locks lists the whole cluster's.
_HELD = text(
    "SELECT objid::bigint FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 2 "
    "AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
    "AND classid = CAST(:ns AS oid) AND objid = ANY(CAST(:ids AS oid[]))"
)


def _key(batch_id: int) -> int:
    """The lock's second key: the batch id's low 32 bits as PostgreSQL's signed int4
    (ids 2**32 apart share a lock, which costs at most a wait, never a wrong build)."""
    low = batch_id & 0xFFFFFFFF
    return low - (1 << 32) if low >= 1 << 31 else low


@contextmanager
def holding(engine: Engine, batch_id: int) -> Iterator[bool]:
    """Try to take the batch's build lock for the block, on a connection of its own;
    yields whether this process got it (False: another worker is building the batch).
    Raises `services.db.exceptions.Unavailable` when the database cannot be reached."""
    key = {"ns": BUILD_LOCK_NAMESPACE, "id": _key(batch_id)}
    try:
        conn = engine.connect().execution_options(isolation_level="AUTOCOMMIT")
    except exc.SQLAlchemyError as error:
        raise translate(error) from error
    with conn:
        try:
            got = bool(conn.execute(_TRY_LOCK, key).scalar())
        except exc.SQLAlchemyError as error:
            raise translate(error) from error
        try:
            yield got
        finally:
            if got and not conn.invalidated:
                try:
                    conn.execute(_UNLOCK, key)
                except Exception:  # the connection is gone, and the lock with it
                    conn.invalidate()


def held(session: Session, batch_ids: Iterable[int]) -> set[int]:
    """The batches among `batch_ids` some worker holds the build lock of now."""
    by_oid = {batch_id & 0xFFFFFFFF: batch_id for batch_id in batch_ids}
    if not by_oid:
        return set()
    rows = session.scalars(_HELD, {"ns": BUILD_LOCK_NAMESPACE, "ids": sorted(by_oid)})
    return {by_oid[int(oid)] for oid in rows}
