"""Simulated device agents for `tunefarm bench farm-load`: many agents in one process
(asyncio, `grpc.aio`), each speaking the agent protocol to a real lease service as
`tunefarm agent` does, without running anything:

    Register -> (Heartbeat every interval the service asks for) -> loop:
        LeaseBatch (long poll) -> Fetch its kernels and task data (unless --no-fetch)
        -> ReportResults: one stand-in result per candidate (a fixed cost, verified),
           then Finish; the acks say what was stored

A load generator for the bench only: the product's agent is `services/agent/`.

    python -m tunefarm_app.bench.load_agents --server HOST:PORT --device-class C --agents 200
    (token in TUNEFARM_AGENT_TOKEN; runs until SIGTERM, then prints its counts as JSON)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass

STAND_IN_COST_SECS = 1e-4
"""The cost every stand-in result reports (three timed repeats of it)."""


@dataclass
class LoadCounts:
    registered: int = 0
    leases: int = 0
    results_sent: int = 0
    results_acked: int = 0
    empty_polls: int = 0  # LeaseBatch answered without a batch
    lost_leases: int = 0  # a lease the service no longer let the agent use (expired meanwhile)
    rpc_errors: int = 0
    heartbeats: int = 0
    fetched_bytes: int = 0


async def _heartbeats(
    stub, agent_id: int, held: set[int], metadata, interval: float, counts: LoadCounts, stop: asyncio.Event
) -> None:
    from services.protocol.generated import measurer_pb2 as pb

    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), timeout=interval)
            return
        except TimeoutError:
            pass
        try:
            request = pb.HeartbeatRequest(agent_id=agent_id, held_lease_ids=sorted(held))
            await stub.Heartbeat(request, metadata=metadata, timeout=30)
            counts.heartbeats += 1
        except Exception:
            counts.rpc_errors += 1


async def _fetch(stub, agent_id: int, batch, metadata, counts: LoadCounts) -> None:
    from services.protocol.generated import measurer_pb2 as pb

    refs = [c.kernel for c in batch.candidates]
    if batch.task_data.id:
        refs.append(batch.task_data)
    async for chunk in stub.Fetch(pb.FetchRequest(agent_id=agent_id, lease_id=batch.lease_id, refs=refs),
                                  metadata=metadata, timeout=60):  # fmt: skip
        counts.fetched_bytes += sum(len(p.data) for p in chunk.parts)


async def _report(stub, agent_id: int, batch, metadata, counts: LoadCounts) -> None:
    from services.protocol import wire
    from services.protocol.generated import measurer_pb2 as pb
    from tunefarm.records import RunResult

    messages = [
        pb.ResultMessage(
            agent_id=agent_id,
            lease_id=batch.lease_id,
            result=wire.result_to_pb(
                c.batch_candidate_id, RunResult(c.candidate_key, (STAND_IN_COST_SECS,) * 3, 0.0, verified=True)
            ),
        )
        for c in batch.candidates
    ]
    messages.append(pb.ResultMessage(agent_id=agent_id, lease_id=batch.lease_id, finish=pb.Finish()))
    counts.results_sent += len(batch.candidates)
    async for ack in stub.ReportResults(iter(messages), metadata=metadata, timeout=60):
        counts.results_acked += len(ack.batch_candidate_ids)
        if ack.finished:
            break


async def simulated_agent(
    stub, *, name: str, device_class: str, capabilities, metadata, fetch: bool, counts: LoadCounts, stop: asyncio.Event
) -> None:
    """One agent until `stop`: register, heartbeat, lease, (fetch,) report stand-in results."""
    import grpc

    from services.protocol import wire
    from services.protocol.generated import measurer_pb2 as pb

    while True:
        try:
            reg = await stub.Register(
                pb.RegisterRequest(name=name, device_class=device_class, capabilities=capabilities),
                metadata=metadata, timeout=60,
            )  # fmt: skip
            break
        except grpc.aio.AioRpcError:
            counts.rpc_errors += 1
            if stop.is_set():
                return
            await asyncio.sleep(0.5)
    counts.registered += 1
    metadata = (*metadata, (wire.AGENT_SECRET_HEADER, reg.agent_secret))  # this registration's secret
    held: set[int] = set()  # the lease being reported, named in heartbeats as the agent does
    beating = asyncio.create_task(
        _heartbeats(stub, reg.agent_id, held, metadata, reg.heartbeat_interval_secs or 5.0, counts, stop)
    )
    try:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                resp = await stub.LeaseBatch(pb.LeaseBatchRequest(agent_id=reg.agent_id), metadata=metadata, timeout=60)
            except grpc.aio.AioRpcError:
                counts.rpc_errors += 1
                await asyncio.sleep(0.5)
                continue
            if not resp.HasField("batch"):
                counts.empty_polls += 1
                if time.monotonic() - t0 < 0.05:  # as the agent: an instant empty answer is not asked again at once
                    await asyncio.sleep(0.2)
                continue
            counts.leases += 1
            held.add(resp.batch.lease_id)
            try:
                if fetch:
                    await _fetch(stub, reg.agent_id, resp.batch, metadata, counts)
                await _report(stub, reg.agent_id, resp.batch, metadata, counts)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    counts.lost_leases += 1
                else:
                    counts.rpc_errors += 1
            finally:
                held.discard(resp.batch.lease_id)
    finally:
        beating.cancel()


async def run_agents(*, server: str, token: str, device_class: str, agents: int, fetch: bool, prefix: str) -> LoadCounts:
    """`agents` simulated agents on one channel until SIGTERM or SIGINT."""
    import grpc
    from google.protobuf.json_format import ParseDict

    from services.agent import capabilities as caps_mod
    from services.protocol import wire
    from services.protocol.generated import measurer_pb2 as pb
    from services.protocol.generated import measurer_pb2_grpc as pb_grpc

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    caps = ParseDict({**caps_mod.detect(probe=False), "tvm_version": "stand-in"}, pb.Capabilities(),
                     ignore_unknown_fields=True)  # fmt: skip
    counts = LoadCounts()
    metadata = wire.auth_metadata(token)
    async with grpc.aio.insecure_channel(server) as channel:
        stub = pb_grpc.AgentServiceStub(channel)
        tasks = [
            asyncio.create_task(
                simulated_agent(stub, name=f"{prefix}-{i}", device_class=device_class, capabilities=caps,
                                metadata=metadata, fetch=fetch, counts=counts, stop=stop)  # fmt: skip
            )
            for i in range(agents)
        ]
        await stop.wait()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tunefarm_app.bench.load_agents", description=__doc__.split("\n")[0])
    parser.add_argument("--server", required=True, help="the lease service, HOST:PORT")
    parser.add_argument("--device-class", required=True, help="the class the agents register for")
    parser.add_argument("--agents", type=int, default=200, help="simulated agents (default 200)")
    parser.add_argument("--name-prefix", default="load-agent", help="agents are named PREFIX-0, PREFIX-1, ...")
    parser.add_argument("--no-fetch", action="store_true", help="do not fetch the leased batches' files")
    args = parser.parse_args(argv)
    token = os.environ.get("TUNEFARM_AGENT_TOKEN", "")
    if not token:
        print("load_agents: error: TUNEFARM_AGENT_TOKEN is not set", file=sys.stderr)
        return 2
    counts = asyncio.run(run_agents(server=args.server, token=token, device_class=args.device_class,
                                    agents=args.agents, fetch=not args.no_fetch, prefix=args.name_prefix))  # fmt: skip
    print(json.dumps(asdict(counts)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
