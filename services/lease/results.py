"""A results stream's side on the lease service (`ReportResults`): what it may store, and storing it.

`ReportResults` stores a stream's results in groups (`results_flush_secs`,
`results_flush_max`): one transaction for the results that arrived together, and the
lease's finish in the same transaction as the last group (`store`). Every stored result
is acknowledged; the agent resends what was not acknowledged after a reconnect, and the
unique batch candidate of a measurement makes a resent result a no-op. The results of an
agent that registered as emulated (`Capabilities.emulated`) are stored as emulated
records: their outputs were checked, their costs are the emulator's.

Results are stored only from the agent holding the lease, and only for what it was
handed; everything else is refused and nothing of the refused stream's pending results
is stored:

| a results stream that ... | status |
|---|---|
| names a lease that is not the sender's active one (expired, re-leased to another agent, finished, another agent's, or none at all) | FAILED_PRECONDITION |
| carries a candidate not in the lease's batch (unknown, or another batch's), a result under another candidate's key, or the same candidate twice | INVALID_ARGUMENT |
| carries a candidate measured before this lease (by an earlier lease of the batch, or given up) | ALREADY_EXISTS |

A result sent again on a new stream of the same lease (the agent reconnected before the
acknowledgement) is acknowledged and stored once.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from services.db import codec, leases, measurements
from services.db.models import Batch, BatchCandidate, BatchState, DeviceClass, Measurement, Workload
from services.lease.auth import AgentInfo, held_lease
from services.protocol.errors import AlreadyMeasured, BadRequest
from services.protocol.generated import measurer_pb2 as pb
from tunefarm.records import BuildResult, MeasureInput, MeasureRecord, MeasureResult, RunResult


@dataclass
class StreamContext:
    """What a results stream needs to turn run results into records, loaded once."""

    lease_id: int
    batch_id: int
    workload_name: str
    target: dict[str, Any]
    inputs: dict[int, MeasureInput]
    builds: dict[int, dict[str, Any] | None]
    # Candidates of the batch measured before this lease (by an earlier lease, or given
    # up): this lease was not handed them, so no result of its may be stored for them.
    measured_elsewhere: dict[int, int | None] = field(default_factory=dict)
    _seen: set[int] = field(default_factory=set)
    _build_cache: dict[int, BuildResult] = field(default_factory=dict)

    def admit(self, bc_id: int, run: RunResult) -> RunResult:
        """`run` if this stream may carry it: a candidate of the lease's batch, not
        measured under another lease, of the candidate's own key, and sent once per stream
        (a stream reopened after a break sends unacknowledged results again: that is a new
        stream, and storing them again is a no-op). Raises `BadRequest` or `AlreadyMeasured`."""
        inp = self.inputs.get(bc_id)
        if inp is None:
            raise BadRequest(f"candidate {bc_id} is not in batch {self.batch_id} of lease {self.lease_id}")
        if bc_id in self.measured_elsewhere:
            by = self.measured_elsewhere[bc_id]
            raise AlreadyMeasured(
                f"candidate {bc_id} was measured before lease {self.lease_id}"
                + (f" (under lease {by})" if by is not None else " (given up)")
                + "; its result is not this lease's to report"
            )
        if bc_id in self._seen:
            raise BadRequest(f"candidate {bc_id} sent twice on one results stream")
        if run.candidate_key != inp.key:  # the message names only what the sender sent
            raise BadRequest(f"result of {run.candidate_key!r} sent for candidate {bc_id}, whose key is another")
        self._seen.add(bc_id)
        return run

    def record(self, bc_id: int, run: RunResult, stamp: float) -> MeasureRecord:
        inp = self.inputs[bc_id]
        build = self._build_cache.get(bc_id)
        if build is None:
            raw = self.builds.get(bc_id)
            build = codec.build_from_json(raw) if raw else BuildResult(inp.key, None, 0.0)
            self._build_cache[bc_id] = build
        return MeasureRecord.of(
            MeasureResult(inp, build, run), workload=self.workload_name, target=self.target, timestamp=stamp
        )


def stream_context(s: Session, lease_id: int, agent: AgentInfo) -> StreamContext:
    """What a stream of the lease needs, loaded once; `LeaseLost` unless the lease is the
    agent's active one."""
    lease = held_lease(s, lease_id, agent.agent_id)
    name, target = s.execute(
        select(Workload.name, DeviceClass.target)
        .join(Batch, Batch.workload_id == Workload.id)
        .join(DeviceClass, DeviceClass.id == Batch.device_class_id)
        .where(Batch.id == lease.batch_id)
    ).one()
    rows = s.execute(
        select(
            BatchCandidate.id,
            BatchCandidate.input,
            BatchCandidate.build,
            Measurement.id.label("measurement_id"),
            Measurement.lease_id,
        )
        .outerjoin(Measurement, Measurement.batch_candidate_id == BatchCandidate.id)
        .where(BatchCandidate.batch_id == lease.batch_id)
    ).all()
    return StreamContext(
        lease_id=lease.id,
        batch_id=lease.batch_id,
        workload_name=name,
        target=dict(target),
        inputs={r.id: codec.input_from_json(r.input) for r in rows},
        builds={r.id: r.build for r in rows},
        measured_elsewhere={
            r.id: r.lease_id for r in rows if r.measurement_id is not None and r.lease_id != lease.id
        },
    )


def store(
    s: Session,
    ctx: StreamContext,
    agent: AgentInfo,
    items: list[tuple[int, RunResult]],
    finish: bool,
) -> BatchState | None:
    """Store a group of a stream's results (and the lease's finish with the last); the
    batch's state when finished."""
    if finish:  # lock order: the batch before its lease (finish_lease locks both)
        s.execute(select(Batch.id).where(Batch.id == ctx.batch_id).with_for_update())
    stamp = time.time()
    records = [(bc_id, ctx.record(bc_id, run, stamp)) for bc_id, run in items]
    measurements.record_measurements(
        s, lease_id=ctx.lease_id, agent_id=agent.agent_id, items=records, fingerprint=agent.fingerprint
    )
    if finish:
        return leases.finish_lease(s, lease_id=ctx.lease_id, agent_id=agent.agent_id)
    return None


END = object()
"""The agent closed its side of a results stream."""


class Inbox:
    """A stream's incoming messages, readable with a timeout: a thread drains the request
    iterator (which only blocks) into a queue; a broken stream arrives as its exception."""

    def __init__(self, requests: Iterator[pb.ResultMessage]):
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        threading.Thread(target=self._pump, args=(requests,), daemon=True, name="results-inbox").start()

    def _pump(self, requests: Iterator[pb.ResultMessage]) -> None:
        try:
            for msg in requests:
                self._queue.put(msg)
            self._queue.put(END)
        except Exception as exc:  # cancelled, connection lost
            self._queue.put(exc)

    def get(self, timeout: float | None) -> object:
        """The next message, `END`, an exception, or None when `timeout` passed first."""
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None
