"""The results of a lease on their way to the lease service (ReportResults).

An agent streams each result as soon as it exists. The server acknowledges what it
stored; when the stream breaks (a server restart, the network), it is opened again and
every result not acknowledged yet is sent again (storing is idempotent). `finish` sends
Finish and waits for the server to store everything: done in the background while the
agent leases and fetches its next batch.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc

from services.agent.channel import FATAL_ERRORS, AgentLink, Backoff
from services.protocol.errors import LeaseLost, MeasurerError, Transient, from_rpc_error
from services.protocol.generated import measurer_pb2 as pb

log = logging.getLogger("tunefarm.agent")

STOP_GRACE_SECS = 10.0
"""A stopping agent tries this long to deliver the results it has and finish its lease."""

_CLOSE = object()
"""Put in a stream's outbox: close the agent's side of the stream."""


class ResultStream:
    """The results of one lease on a ReportResults stream.

    Results are kept until the server acknowledges them. When the stream breaks (server
    restart, network), it is opened again and every unacknowledged result is sent again;
    `finish` sends Finish and waits for the server's answer, reopening as needed. A
    refused lease (FAILED_PRECONDITION) raises `LeaseLost`.
    """

    def __init__(self, agent: AgentLink, lease_id: int):
        self.agent = agent
        self.lease_id = lease_id
        self._lock = threading.Lock()
        self._unacked: dict[int, pb.Result] = {}
        self._outbox: queue.SimpleQueue[object] | None = None
        self._reader: threading.Thread | None = None
        self._call: Any = None
        self._failure: MeasurerError | None = None
        self._finished: str | None = None  # the batch state the server answered Finish with
        self._backoff = Backoff(agent.settings.reconnect_max_secs)
        self._next_open = 0.0

    def send(self, result: pb.Result) -> None:
        with self._lock:
            self._unacked[result.batch_candidate_id] = result
        self._check()
        if self._outbox is not None:
            self._outbox.put(self._message(result=result))
        else:
            self._try_open()  # sends everything unacknowledged, this one included

    def finish(self) -> str:
        """Send Finish; the batch's state once the server has stored everything. Keeps
        trying while the server is away; once the agent is stopping, for STOP_GRACE_SECS."""
        deadline: float | None = None
        while deadline is None or time.monotonic() < deadline:
            if deadline is None and self.agent.stop.is_set():
                deadline = time.monotonic() + STOP_GRACE_SECS
            self._check()
            if self._outbox is None and not self._try_open():
                time.sleep(min(1.0, max(0.01, self._next_open - time.monotonic())))
                continue
            assert self._outbox is not None and self._reader is not None
            self._outbox.put(self._message(finish=pb.Finish()))
            self._outbox.put(_CLOSE)
            self._outbox = None
            self._reader.join()
            if self._finished is not None:
                return self._finished
            if isinstance(self._failure, (LeaseLost, *FATAL_ERRORS)):
                raise self._failure
            log.info("results stream of lease %d broke (%s); reopening", self.lease_id, self._failure)
        raise Transient(f"stopped before lease {self.lease_id} was finished")

    def close(self) -> None:
        if self._outbox is not None:
            self._outbox.put(_CLOSE)
            self._outbox = None
        if self._call is not None:
            self._call.cancel()
        if self._reader is not None:
            self._reader.join(timeout=5)

    def _message(self, **body: Any) -> pb.ResultMessage:
        assert self.agent.agent_id is not None
        return pb.ResultMessage(agent_id=self.agent.agent_id, lease_id=self.lease_id, **body)

    def _check(self) -> None:
        """Raise a lease refusal; forget a broken stream (reopened on the next send)."""
        failure = self._failure
        if failure is None:
            return
        if isinstance(failure, (LeaseLost, *FATAL_ERRORS)):
            raise failure
        if self._outbox is not None:
            self._outbox.put(_CLOSE)
            self._outbox = None

    def _try_open(self) -> bool:
        """Open the stream and send every unacknowledged result; False while the last
        opening is too recent (backoff)."""
        now = time.monotonic()
        if now < self._next_open:
            return False
        if self._reader is not None:
            self._reader.join()
        self._failure = None
        outbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        with self._lock:
            for result in self._unacked.values():
                outbox.put(self._message(result=result))
        self._call = self.agent.stub.ReportResults(_drain(outbox), metadata=self.agent.metadata)
        self._outbox = outbox
        self._reader = threading.Thread(target=self._read, args=(self._call,), daemon=True, name="agent-acks")
        self._reader.start()
        self._next_open = now + self._backoff.next()
        return True

    def _read(self, call: Iterator[pb.ResultAck]) -> None:
        try:
            for ack in call:
                with self._lock:
                    for bc_id in ack.batch_candidate_ids:
                        self._unacked.pop(bc_id, None)
                if ack.finished:
                    self._finished = ack.batch_state or "done"
                    self._backoff.reset()
            if self._finished is None:
                self._failure = Transient("the server closed the results stream")
        except grpc.RpcError as exc:
            self._failure = from_rpc_error(exc)


def _drain(outbox: queue.SimpleQueue[object]) -> Iterator[pb.ResultMessage]:
    while True:
        item = outbox.get()
        if item is _CLOSE:
            return
        assert isinstance(item, pb.ResultMessage)
        yield item
