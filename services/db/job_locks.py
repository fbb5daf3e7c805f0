"""Which scheduler runs a job: a session-level advisory lock per job,
`pg_try_advisory_lock(LOCK_NAMESPACE, job id)`, held on one connection of its own (in
autocommit: no transaction stays open) for as long as the process runs the job. A
scheduler that dies, or loses that connection, releases every job it held.
"""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session, sessionmaker

from services.db.exceptions import Unavailable

LOCK_NAMESPACE = 0x74660001
"""First key of the per-job advisory locks (`pg_try_advisory_lock(LOCK_NAMESPACE, job id)`)."""

_TRY_LOCK = text("SELECT pg_try_advisory_lock(:ns, :id)")
_UNLOCK = text("SELECT pg_advisory_unlock(:ns, :id)")


class JobLocks:
    """The job locks one process holds, on one connection of `sessions`' engine (opened
    on first use, and again after it was closed or invalidated: the locks held on the
    old one are gone with it)."""

    def __init__(self, sessions: sessionmaker[Session]):
        self._sessions = sessions
        self._connection: Connection | None = None
        self.held: set[int] = set()

    def _connect(self) -> Connection:
        conn = self._connection
        if conn is None or conn.closed or conn.invalidated:
            engine = self._sessions.kw["bind"]
            self._connection = conn = engine.connect().execution_options(isolation_level="AUTOCOMMIT")
            self.held.clear()
        return conn

    def try_lock(self, job_id: int) -> bool:
        """Take the job's lock unless another process holds it; True if this one holds it
        now. Raises `Unavailable` when the lock connection fails."""
        if job_id in self.held:
            return True
        try:
            got = bool(self._connect().execute(_TRY_LOCK, {"ns": LOCK_NAMESPACE, "id": job_id}).scalar())
        except Exception as exc:
            raise Unavailable(f"advisory lock: {exc}") from exc
        if got:
            self.held.add(job_id)
        return got

    def unlock(self, job_id: int) -> bool:
        """Release the job's lock (if held). False when the lock connection failed: the
        caller should `close` it (its other locks cannot be trusted either)."""
        if job_id not in self.held:
            return True
        self.held.discard(job_id)
        try:
            self._connect().execute(_UNLOCK, {"ns": LOCK_NAMESPACE, "id": job_id})
        except Exception:
            return False
        return True

    def close(self) -> None:
        """Close the lock connection: every lock it held is released."""
        if self._connection is not None:
            try:
                self._connection.close()
            except Exception:
                pass
        self._connection = None
        self.held.clear()
