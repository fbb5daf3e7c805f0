"""Revoked tokens, pushed at once to every process that trusts verified tokens for a while.

The API and the lease service keep tokens they verified in a `VerifiedTokens` cache (a
poller's every request would otherwise cost a database round trip). Revoking a token
(`tokens.revoke_token`) sends `NOTIFY tunefarm_token_revoked, '<token hash>'` in the
revoking transaction, which PostgreSQL delivers when it commits. A `RevocationListener`
holds one connection of its own that LISTENs on that channel in a thread and drops each
revoked token from the caches that subscribed, so a revoked token is refused from the
next request on, whatever the cache's time to live.

While the listener is not connected (starting, or the database lost) the caches trust
nothing they hold and every token is verified against the database; when it connects
again they are emptied, since a revocation may have passed meanwhile.
"""

from __future__ import annotations

import logging
import select
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from sqlalchemy import Engine

log = logging.getLogger("tunefarm.db.revocations")

CHANNEL = "tunefarm_token_revoked"
"""The PostgreSQL notification channel; the payload is the revoked token's hash."""

RECONNECT_SECS = 1.0
"""How long the listener waits before connecting again after losing its connection."""

POLL_SECS = 0.5
"""How often the listener thread looks whether it was asked to stop."""

MAX_ENTRIES = 10_000
"""Tokens a cache holds at most (emptied when full)."""

V = TypeVar("V")


class RevocationListener:
    """LISTENs for revoked tokens on a connection of its own; `subscribe` callbacks get
    each revoked token's hash (`on_revoked`) and are told to forget everything when the
    listener (re)connects (`on_reset`)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._revoked: list[Callable[[str], None]] = []
        self._reset: list[Callable[[], None]] = []
        self._connected = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def connected(self) -> bool:
        """Revocations reach the subscribers now."""
        return self._connected.is_set()

    def subscribe(self, on_revoked: Callable[[str], None], on_reset: Callable[[], None]) -> None:
        self._revoked.append(on_revoked)
        self._reset.append(on_reset)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True, name="token-revocations")
        self._thread.start()

    def wait_connected(self, timeout: float) -> bool:
        return self._connected.wait(timeout)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._listen()
            except Exception as exc:  # the database went away: verify every token until it is back
                self._connected.clear()
                log.warning("token revocations: not listening (%s); every token is checked meanwhile", exc)
                self._stop.wait(RECONNECT_SECS)

    def _listen(self) -> None:
        raw = self.engine.raw_connection()
        conn = raw.driver_connection
        raw.detach()  # a connection of our own, never returned to the pool
        try:
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute(f"LISTEN {CHANNEL}")
            for reset in self._reset:
                reset()
            self._connected.set()
            while not self._stop.is_set():
                if select.select([conn], [], [], POLL_SECS)[0]:
                    conn.poll()
                    while conn.notifies:
                        token_hash = conn.notifies.pop(0).payload
                        for revoked in self._revoked:
                            revoked(token_hash)
        finally:
            self._connected.clear()
            conn.close()


class VerifiedTokens(Generic[V]):
    """What a verified token stands for (a team, a token id), by the token's hash, each
    trusted for `ttl` seconds, and only while `listener` (when given) is connected: a
    revoked token is dropped as soon as the listener hears of it, and never put back."""

    def __init__(self, ttl: float, listener: RevocationListener | None = None):
        self.ttl = ttl
        self.listener = listener
        self._entries: dict[str, tuple[float, V]] = {}
        self._revoked: set[str] = set()
        self._lock = threading.Lock()
        if listener is not None:
            listener.subscribe(self.revoke, self.clear)

    def get(self, token_hash: str) -> V | None:
        if self.listener is not None and not self.listener.connected:
            return None
        with self._lock:
            entry = self._entries.get(token_hash)
            if entry is None or entry[0] < time.monotonic():
                self._entries.pop(token_hash, None)
                return None
            return entry[1]

    def put(self, token_hash: str, value: V) -> None:
        """Remember a token verified just now (unless revoked since: a verification that
        raced its revocation must not bring it back)."""
        if self.ttl <= 0:
            return
        with self._lock:
            if token_hash in self._revoked:
                return
            if len(self._entries) >= MAX_ENTRIES:
                self._entries.clear()
            self._entries[token_hash] = (time.monotonic() + self.ttl, value)

    def revoke(self, token_hash: str) -> None:
        with self._lock:
            self._entries.pop(token_hash, None)
            if len(self._revoked) >= MAX_ENTRIES:
                self._revoked.clear()  # revoked tokens fail verification anyway; this only guards races
            self._revoked.add(token_hash)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
