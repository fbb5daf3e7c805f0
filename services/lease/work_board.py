"""Which device classes have something to lease, for the long polls waiting for it.

`LeaseBatch` is a long poll (`lease_wait_secs`); while it waits it tries to lease only
when its class has something to lease (`WorkBoard`: one query per `lease_recheck_secs`
for every waiting agent together), so hundreds of idle agents do not keep the
database's connections from heartbeats and results; and at most
`grpc_max_workers - RPC_THREADS_KEPT_FREE` wait at once (more answer empty at once), so
they do not keep the RPC threads from them either (services/lease/servicer.py).
"""

from __future__ import annotations

import math
import threading
import time

from services.db import leases
from services.db.session import SessionFactory, transaction


class WorkBoard:
    """Which device classes have something to lease (`leases.classes_with_work`), read
    at most once per `interval` for every waiting LeaseBatch together: a long poll asks
    the database to lease only when its class may have work, so many idle agents cost
    one query per interval, not one each (which starved heartbeats of connections)."""

    def __init__(self, sessions: SessionFactory, interval: float):
        self.sessions = sessions
        self.interval = interval
        self._lock = threading.Lock()
        self._classes: set[int] = set()
        self._read_at = -math.inf

    def has_work(self, device_class_id: int) -> bool:
        with self._lock:  # one reader; the other waiting calls take its answer
            if time.monotonic() - self._read_at >= self.interval:
                with transaction(self.sessions) as s:
                    self._classes = leases.classes_with_work(s)
                self._read_at = time.monotonic()
            return device_class_id in self._classes
