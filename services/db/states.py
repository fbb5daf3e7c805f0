"""The states of the farm's rows (tokens, agents, jobs, batches, leases, confirmations, model
runs), as the tables keep them (PostgreSQL enums of their values, `models.py`).
"""

from __future__ import annotations

from enum import StrEnum


class TokenKind(StrEnum):
    TEAM = "team"  # authenticates a team on the HTTP API
    AGENT = "agent"  # authenticates a device agent on the gRPC lease service


class AgentState(StrEnum):
    IDLE = "idle"  # heartbeating, holds no lease
    BUSY = "busy"  # heartbeating, holds a lease
    OFFLINE = "offline"  # heartbeats stopped
    DISABLED = "disabled"  # taken out of service by an operator; gets no lease


class JobState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    FINISHING = "finishing"  # budget spent or target met: building the tuned model
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


class BatchState(StrEnum):
    PROPOSED = "proposed"  # written by the scheduler, enqueued for a build worker
    BUILDING = "building"  # a build worker has it
    READY = "ready"  # built, waiting for an agent of its device class
    LEASED = "leased"  # an agent holds an active lease on it
    DONE = "done"  # every candidate has its measurement
    FAILED = "failed"  # could not be built or measured at all; its candidates are lost

    @property
    def is_terminal(self) -> bool:
        return self in (BatchState.DONE, BatchState.FAILED)


class LeaseState(StrEnum):
    ACTIVE = "active"  # the agent may write results under it
    FINISHED = "finished"  # the agent said it was done
    EXPIRED = "expired"  # heartbeats stopped before the deadline; the batch went back to the queue


class ConfirmationState(StrEnum):
    """Where a measurement stands with its confirmation (`services.db.confirmations`):
    None on a measurement never asked for one (it never was a task's best)."""

    PENDING = "pending"  # a confirmation batch re-measures its kernel
    CONFIRMED = "confirmed"  # re-measured as fast (within `trust.CONFIRM_TOLERANCE`), or by its own agent
    DISPUTED = "disputed"  # another agent measured it slower, or its output wrong: a false timing
    FAILED = "failed"  # the confirmation gave no comparable time (an error, a given-up batch):


class ModelRunState(StrEnum):
    READY = "ready"  # waiting for an agent of its class
    LEASED = "leased"  # an agent runs it (until `expires_at`, extended by its heartbeats)
    DONE = "done"  # ran: outputs and latencies stored
    FAILED = "failed"  # did not run (the agent's error, too many leases, or superseded)

    @property
    def is_terminal(self) -> bool:
        return self in (ModelRunState.DONE, ModelRunState.FAILED)
