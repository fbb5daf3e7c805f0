"""A results stream's side on the lease service (`ReportResults`): what it may store, and storing it.

`ReportResults` stores a stream's results in groups (`acknowledged`: `results_flush_secs`,
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

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from services.db import batches, codec, leases, measurements
from services.db.session import Session
from services.db.states import BatchState
from services.lease.auth import AgentInfo, held_lease
from services.protocol import wire
from services.protocol.errors import AlreadyMeasured, BadRequest
from services.protocol.generated import measurer_pb2 as pb
from tunefarm.records import BuildResult, MeasureInput, MeasureRecord, MeasureResult, RunResult

log = logging.getLogger("tunefarm.lease_service")


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
    name, target = batches.workload_and_target(s, batch_id=lease.batch_id)
    rows = measurements.candidate_results(s, batch_id=lease.batch_id)
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
        batches.lock_batch(s, batch_id=ctx.batch_id)
    stamp = time.time()
    records = [(bc_id, ctx.record(bc_id, run, stamp)) for bc_id, run in items]
    measurements.record_measurements(
        s, lease_id=ctx.lease_id, agent_id=agent.agent_id, items=records, fingerprint=agent.fingerprint
    )
    if finish:
        return leases.finish_lease(s, lease_id=ctx.lease_id, agent_id=agent.agent_id)
    return None


def acknowledged(
    inbox: Inbox,
    first: pb.ResultMessage,
    ctx: StreamContext,
    agent: AgentInfo,
    store_group: Callable[[list[tuple[int, RunResult]], bool], BatchState | None],
    is_active: Callable[[], bool],
    *,
    flush_max: int,
    flush_secs: float,
) -> Iterator[pb.ResultAck]:
    """The acknowledgements of a stream's messages, `first` and then what `inbox` brings:
    results are stored in groups (`store_group(items, finish)`, a transaction each) of at
    most `flush_max` or what came within `flush_secs`, and each stored group is
    acknowledged while the agent listens (`is_active`)."""
    lease_id = ctx.lease_id
    pending: dict[int, RunResult] = {}
    opened = 0.0
    finish = False
    msg: object = first
    while True:
        if isinstance(msg, pb.ResultMessage):
            if msg.lease_id != lease_id or msg.agent_id != agent.agent_id:
                raise BadRequest("one results stream carries one lease")
            body = msg.WhichOneof("body")
            if body == "result":
                bc_id = msg.result.batch_candidate_id
                run = ctx.admit(bc_id, wire.run_result_from_pb(msg.result))
                if not pending:
                    opened = time.monotonic()
                # An emulated agent's costs are the emulator's: its results say so.
                pending[bc_id] = replace(run, emulated=agent.emulated)
            elif body == "finish":
                finish = True
        elif isinstance(msg, BaseException):  # the agent went away: keep what it sent
            log.info("results stream of lease %d broke: %s", lease_id, msg)
        end = finish or msg is END or isinstance(msg, BaseException)
        due = pending and (len(pending) >= flush_max or time.monotonic() - opened >= flush_secs)
        if end or due:
            if pending or finish:
                items = list(pending.items())
                pending.clear()
                state = store_group(items, finish)
                if is_active():
                    yield pb.ResultAck(
                        batch_candidate_ids=[i for i, _ in items],
                        finished=finish,
                        batch_state=str(state) if state is not None else "",
                    )
            if end:
                return
        timeout = None if not pending else max(0.0, opened + flush_secs - time.monotonic())
        msg = inbox.get(timeout)


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
