"""The lease service's sweeper: a thread that expires leases whose heartbeats stopped
(their batches go back to the queue), marks silent agents offline, and gives up batches
leased `max_lease_attempts` times without being finished (`measurements.abandon_batch`: their
unmeasured candidates become run_crash results, so the scheduler still gets exactly one
result per candidate).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from services.db import agents, batches, leases, measurements
from services.db import exceptions as db_exc
from services.db.session import SessionFactory, transaction
from services.lease.settings import LeaseServiceSettings

log = logging.getLogger("tunefarm.lease_service")


def given_up_reason(leases: int) -> str:
    return (
        f"not measured: the batch was leased {leases} times and no agent finished it "
        "(its agents died or stopped heartbeating while measuring it)"
    )


@dataclass(frozen=True)
class SweepReport:
    requeued: list[int]  # batches whose lease expired
    offline: list[int]  # agents marked offline
    given_up: list[int]  # batches abandoned after max_lease_attempts


class Sweeper:
    """Every `sweep_interval_secs`: expire leases whose heartbeats stopped, mark silent
    agents offline, give up batches that were leased too often. Safe to run in several
    replicas at once (expire_leases skips batches another transaction holds)."""

    def __init__(self, settings: LeaseServiceSettings, sessions: SessionFactory):
        self.settings = settings
        self.sessions = sessions
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, daemon=True, name="lease-sweeper")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.wait(self.settings.sweep_interval_secs):
            try:
                report = self.sweep()
            except db_exc.DatabaseError as exc:
                log.warning("sweep failed: %s", exc)
                continue
            if report.requeued or report.offline or report.given_up:
                log.info(
                    "sweep: %d leases expired, %d agents offline, %d batches given up",
                    len(report.requeued),
                    len(report.offline),
                    len(report.given_up),
                )

    def sweep(self) -> SweepReport:
        st = self.settings
        with transaction(self.sessions) as s:
            requeued = leases.expire_leases(s)
            offline = agents.mark_agents_offline(s, stale_secs=st.agent_stale_secs)
        given_up = []
        with transaction(self.sessions) as s:
            for batch_id, attempts in batches.overleased_batches(s, min_attempts=st.max_lease_attempts, limit=100):
                measurements.abandon_batch(s, batch_id=batch_id, reason=given_up_reason(attempts))
                given_up.append(batch_id)
        return SweepReport(requeued, offline, given_up)
