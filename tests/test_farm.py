"""The measurement farm's data plane against a real PostgreSQL and Redis on loopback:
FarmMeasurer -> RQ build job (SimpleWorker, burst) -> lease service (gRPC) -> agents
(threads, or subprocesses where one is killed) -> results back through FarmMeasurer.

Each test has its own device class, job, queue names (a Redis prefix) and agent token;
the database is the module's throw-away one (`database_url`). Leases last 3 s here, so
a killed agent's batch moves on quickly.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import grpc
import pytest

tvm = pytest.importorskip("tvm")
redis_mod = pytest.importorskip("redis")
pytest.importorskip("rq")

from aarch64_fixtures import ELF_MACHINE_AARCH64, elf_machine  # noqa: E402
from farm_fixtures import placeholder_model  # noqa: E402
from sqlalchemy import func, select, update  # noqa: E402
from tvm import te  # noqa: E402
from tvm.script import tirx as T  # noqa: E402

from services.agent import capabilities  # noqa: E402
from services.agent.agent import run_agent  # noqa: E402
from services.agent.settings import AgentSettings  # noqa: E402
from services.db import agents, batches, build_locks, leases, measurements, tokens  # noqa: E402
from services.db.models import Agent, Batch, BatchCandidate, DeviceClass, Job, Lease, Measurement, Team  # noqa: E402
from services.db.session import transaction  # noqa: E402
from services.db.states import AgentState, BatchState, LeaseState, TokenKind  # noqa: E402
from services.lease.server import make_server  # noqa: E402
from services.lease.settings import LeaseServiceSettings  # noqa: E402
from services.protocol import wire  # noqa: E402
from services.protocol.generated import measurer_pb2 as pb  # noqa: E402
from services.protocol.generated import measurer_pb2_grpc as pb_grpc  # noqa: E402
from services.scheduler.farm_measurer import FarmMeasurer  # noqa: E402
from services.worker import jobs  # noqa: E402
from services.worker.build_worker import build_worker  # noqa: E402
from services.worker.settings import WorkerSettings  # noqa: E402
from tunefarm.export import artifact_suffix  # noqa: E402
from tunefarm.measure import MeasureBatch  # noqa: E402
from tunefarm.measure.builder import LocalBuilder  # noqa: E402
from tunefarm.records import Candidate, ErrorKind, MeasureInput, TimingConfig  # noqa: E402
from tunefarm.target import host_target_dict  # noqa: E402
from tunefarm.workloads import workload_from_prim_func, workload_from_te  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LEASE_SECS = 3.0
FAST = TimingConfig(repeat=2, min_repeat_ms=1.0)


# -- workloads and candidates ---------------------------------------------------------------


def gemm(n: int = 64):
    a = te.placeholder((n, n), "float32", name="A")
    b = te.placeholder((n, n), "float32", name="B")
    k = te.reduce_axis((0, n), name="k")
    c = te.compute((n, n), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k), name="C")
    return workload_from_te(f"gemm{n}", [a, b, c], reference=lambda x, y: [x @ y])


def gemm_trace(wl, ti: int, tj: int, block: str = "C") -> list:
    sch = tvm.s_tir.Schedule(wl.mod)
    i, j, k = sch.get_loops(sch.get_sblock(block))
    i0, i1 = sch.split(i, [None, ti])
    j0, j1 = sch.split(j, [None, tj])
    sch.reorder(i0, j0, i1, k, j1)
    sch.vectorize(j1)
    return json.loads(json.dumps(sch.trace.as_json(), default=lambda o: o.value))


def gemm_inputs(wl, task_key: str, n: int, *, bad: int = 0) -> list[MeasureInput]:
    """`n` distinct schedules of the GEMM, then `bad` ones whose trace names a missing block."""
    tiles = [(ti, tj) for ti in (1, 2, 4, 8, 16) for tj in (4, 8, 16, 32)]
    out = [
        MeasureInput(task_key, Candidate.make(0, {"C.i": ti, "C.j": tj}), "test", gemm_trace(wl, ti, tj))
        for ti, tj in tiles[:n]
    ]
    for m in range(bad):
        trace = gemm_trace(wl, 4, 8)
        trace[0][0][2][0] = "no_such_block"
        out.append(MeasureInput(task_key, Candidate.make(1, {"C.bad": m}), "test", trace))
    return out


@T.prim_func(s_tir=True)
def aborting_copy(A: T.Buffer((4,), "float32"), B: T.Buffer((4,), "float32")):
    for i in range(4):
        with T.sblock("B"):
            vi = T.axis.spatial(4, i)
            T.evaluate(T.call_extern("int32", "abort"))
            B[vi] = A[vi]


# -- the farm -------------------------------------------------------------------------------


@dataclass
class Farm:
    sessions: object
    redis: object
    root: Path
    server_address: str
    device_class: str
    job_id: int
    token: str
    prefix: str
    target: dict
    public_key: Path  # the farm's signing key's public half: the agents check kernels with it

    def measurer(self, **kw) -> FarmMeasurer:
        return FarmMeasurer(
            self.sessions,
            self.redis,
            artifact_root=self.root,
            job_id=self.job_id,
            device_class=self.device_class,
            queue_prefix=self.prefix,
            poll_interval=0.05,
            stuck_check_secs=1.0,
            **kw,
        )

    def build(self) -> None:
        """Run the class's build queue empty in this process (RQ SimpleWorker, burst)."""
        build_worker(self.redis, [self.device_class], self.prefix).work(burst=True)

    def agent_settings(self, name: str, work_dir: Path) -> AgentSettings:
        return AgentSettings(
            server=self.server_address,
            token=self.token,
            device_class=self.device_class,
            name=name,
            work_dir=work_dir,
            num_threads=1,
            reconnect_max_secs=1.0,
            rpc_timeout_secs=10.0,
            lease_wait_secs=2.0,
            signing_public_key=self.public_key,
        )

    def batch_rows(self) -> list[Batch]:
        """The job's search batches (not the confirmations of its bests)."""
        with transaction(self.sessions) as s:
            return list(
                s.scalars(
                    select(Batch)
                    .where(Batch.job_id == self.job_id, Batch.confirms_measurement_id.is_(None))
                    .order_by(Batch.id)
                )
            )


@pytest.fixture(scope="module")
def artifact_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("artifacts")


@pytest.fixture(scope="module")
def lease_settings(database_url, artifact_root) -> LeaseServiceSettings:
    return LeaseServiceSettings(
        database_url=database_url,
        lease_bind=f"127.0.0.1:{free_port()}",
        artifact_root=artifact_root,
        lease_secs=LEASE_SECS,
        heartbeat_interval_secs=0.3,
        sweep_interval_secs=0.2,
        lease_wait_secs=0.5,
        lease_recheck_secs=0.05,
        results_flush_secs=0.02,
    )


@pytest.fixture(scope="module")
def lease_server(lease_settings, db_sessions):
    server = make_server(lease_settings, sessions=db_sessions)
    server.start()
    yield server
    server.stop(grace=0)


@pytest.fixture(scope="module")
def signing_keys(tmp_path_factory) -> tuple[Path, Path]:
    """The farm's signing key pair: (private key, public key)."""
    from services.protocol.signing import ensure_key_pair

    d = tmp_path_factory.mktemp("signing")
    ensure_key_pair(d / "farm-signing.key", d / "farm-signing.pub")
    return d / "farm-signing.key", d / "farm-signing.pub"


@pytest.fixture(scope="module")
def worker_context(database_url, artifact_root, db_sessions, signing_keys):
    """Build jobs of this module run in this process, over two warm build processes;
    they sign every kernel with the farm's key."""
    builder = LocalBuilder(artifact_root / "kernels", n_workers=2)
    builder.start()
    settings = WorkerSettings(database_url=database_url, artifact_root=artifact_root, signing_key_file=signing_keys[0])
    jobs.configure(settings, builder=builder, sessions=db_sessions)
    yield
    jobs.shutdown()


@pytest.fixture(scope="module")
def agent_caps() -> dict:
    return {**capabilities.detect(probe=False), **capabilities.probe_tvm()}


@pytest.fixture
def farm(db_sessions, redis_conn, artifact_root, lease_server, worker_context, signing_keys) -> Iterator[Farm]:
    uid = uuid.uuid4().hex[:10]
    target = host_target_dict()
    with transaction(db_sessions) as s:
        team = Team(name=f"team-{uid}")
        dc = DeviceClass(name=f"cls-{uid}", target=target)
        s.add_all([team, dc])
        s.flush()
        model = placeholder_model(team.id)
        s.add(model)
        s.flush()
        job = Job(team_id=team.id, model_id=model.id, device_class_id=dc.id, trial_budget=1000)
        s.add(job)
        s.flush()
        _, token = tokens.issue_token(s, kind=TokenKind.AGENT, label=uid)
        job_id = job.id
    prefix = f"test-{uid}"
    yield Farm(
        db_sessions, redis_conn, artifact_root, lease_server.address, f"cls-{uid}", job_id, token, prefix, target,
        signing_keys[1],
    )
    for key in redis_conn.scan_iter(f"*{prefix}*"):
        redis_conn.delete(key)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ThreadAgent:
    thread: threading.Thread
    stop: threading.Event
    errors: list

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=30)
        assert not self.thread.is_alive()
        assert self.errors == []


def start_thread_agent(farm: Farm, name: str, tmp_path: Path, caps: dict) -> ThreadAgent:
    stop = threading.Event()
    errors: list = []

    def target() -> None:
        try:
            run_agent(farm.agent_settings(name, tmp_path / name), stop=stop, capabilities=caps)
        except Exception as exc:  # surfaced by close()
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True, name=f"agent-{name}")
    thread.start()
    return ThreadAgent(thread, stop, errors)


def collect_all(measurer: FarmMeasurer, n: int, timeout: float = 180.0) -> list:
    """Up to `n` results, or fewer after `timeout` seconds (a guard against a hang: a loaded
    machine starts agents and builds slowly)."""
    out: list = []
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        out += measurer.collect(timeout=0.5)
    return out


def wait_until(condition, *, timeout: float, what: str) -> None:
    """Polls `condition` until it holds; fails naming `what` after `timeout` seconds (a
    limit for a hang, not a speed: loaded machines start agents slowly)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not seen in {timeout:.0f} s"
        time.sleep(0.1)


def measurements_per_candidate(farm: Farm) -> dict[str, int]:
    with transaction(farm.sessions) as s:
        rows = s.execute(
            select(BatchCandidate.candidate_key, func.count(Measurement.id))
            .join(Batch, Batch.id == BatchCandidate.batch_id)
            .outerjoin(Measurement, Measurement.batch_candidate_id == BatchCandidate.id)
            .where(Batch.job_id == farm.job_id)
            .group_by(BatchCandidate.candidate_key)
        ).all()
    return {key: n for key, n in rows}


# -- tests ----------------------------------------------------------------------------------


def test_a_batch_is_built_leased_measured_and_collected(farm, tmp_path, agent_caps):
    wl = gemm()
    task_key = f"{wl.key}@test"
    measurer = farm.measurer()
    task = measurer.prepare(wl, task_key, farm.target)
    assert task.verify  # the numpy reference gave expected outputs
    inputs = gemm_inputs(wl, task_key, 4, bad=1)
    measurer.submit(MeasureBatch(id="0:1", task=task, inputs=tuple(inputs), timing=FAST))
    assert measurer.pending == 5
    assert [b.state for b in farm.batch_rows()] == [BatchState.PROPOSED]

    farm.build()  # RQ SimpleWorker, burst: builds, records the bad one, marks the batch ready
    (batch,) = farm.batch_rows()
    assert batch.state is BatchState.READY

    # A scheduler restarted now adopts the batch from the database.
    restarted = farm.measurer(after_measurement_id=0)
    (adopted,) = restarted.in_flight_batches()
    assert adopted.id == f"farm-{batch.id}" and adopted.task.key == task_key
    assert {m.key for m in adopted.inputs} == {m.key for m in inputs[:4]}  # the bad one is measured (build error)

    agent = start_thread_agent(farm, f"{farm.device_class}-a", tmp_path, agent_caps)
    try:
        results = collect_all(measurer, 5)
    finally:
        agent.close()
    assert sorted(r.key for r in results) == sorted(m.key for m in inputs)
    assert measurer.pending == 0
    by_key = {r.key: r for r in results}
    for m in inputs[:4]:
        r = by_key[m.key]
        assert r.error_kind is ErrorKind.NONE, r.error_msg
        assert r.verified and len(r.costs) == FAST.repeat and min(r.costs) > 0 and r.run_secs > 0
        assert (r.task, r.candidate, r.sketch_sig, r.trace) == (m.task, m.candidate, m.sketch_sig, m.trace)
    bad = by_key[inputs[4].key]
    assert bad.error_kind is ErrorKind.BUILD_ERROR and bad.run_secs == 0 and "no_such_block" in bad.error_msg

    assert sorted(r.key for r in collect_all(restarted, 4)) == sorted(m.key for m in inputs[:4])
    (batch,) = farm.batch_rows()
    assert batch.state is BatchState.DONE and batch.attempts == 1
    assert set(measurements_per_candidate(farm).values()) == {1}
    with transaction(farm.sessions) as s:
        job = s.get(Job, farm.job_id)
        assert job.trials_used == 5
        lease = s.scalars(select(Lease).where(Lease.batch_id == batch.id)).one()
        assert lease.state is LeaseState.FINISHED
        agent_row = s.get(Agent, lease.agent_id)
        assert agent_row.measurements_done == 4 and agent_row.capabilities["tvm_version"]
    measurer.close()
    restarted.close()


def test_a_crashing_kernel_is_a_run_crash_and_the_agent_goes_on(farm, tmp_path, agent_caps):
    crash = workload_from_prim_func("aborting_copy", aborting_copy, reference=lambda a: [a])
    good = gemm(32)
    measurer = farm.measurer()
    crash_task = measurer.prepare(crash, f"{crash.key}@test", farm.target)
    good_task = measurer.prepare(good, f"{good.key}@test", farm.target)
    crash_input = MeasureInput(crash_task.key, Candidate.make(0, {}), "test", [[], []])
    good_inputs = gemm_inputs(good, good_task.key, 2)
    measurer.submit(MeasureBatch(id="0:1", task=crash_task, inputs=(crash_input,), timing=FAST))
    measurer.submit(MeasureBatch(id="1:1", task=good_task, inputs=tuple(good_inputs), timing=FAST))
    farm.build()
    agent = start_thread_agent(farm, f"{farm.device_class}-a", tmp_path, agent_caps)
    try:
        results = {r.key: r for r in collect_all(measurer, 3)}
    finally:
        agent.close()
    crashed = results[crash_input.key]
    assert crashed.error_kind is ErrorKind.RUN_CRASH and "SIGABRT" in crashed.error_msg
    for m in good_inputs:  # measured after the crash, by the same agent
        assert results[m.key].error_kind is ErrorKind.NONE, results[m.key].error_msg
    with transaction(farm.sessions) as s:
        agents = {m.agent_id for m in s.scalars(select(Measurement).where(Measurement.job_id == farm.job_id))}
        assert len(agents) == 1
        assert s.get(Agent, agents.pop()).errors_by_kind == {"run_crash": 1}
    measurer.close()


def test_agent_service_refuses_team_tokens_and_strangers(farm):
    with transaction(farm.sessions) as s:
        team_id = s.scalar(select(Job.team_id).where(Job.id == farm.job_id))
        _, team_token = tokens.issue_token(s, kind=TokenKind.TEAM, team_id=team_id)
        _, other_agent_token = tokens.issue_token(s, kind=TokenKind.AGENT)
    request = pb.RegisterRequest(
        device_class=farm.device_class,
        name=f"{farm.device_class}-x",
        capabilities=pb.Capabilities(arch="x86_64", target_json=json.dumps(farm.target)),
    )
    with grpc.insecure_channel(farm.server_address) as channel:
        stub = pb_grpc.AgentServiceStub(channel)
        for metadata, code in (
            (wire.auth_metadata(team_token), grpc.StatusCode.PERMISSION_DENIED),
            (wire.auth_metadata("tfa_not-a-token"), grpc.StatusCode.UNAUTHENTICATED),
            ((), grpc.StatusCode.UNAUTHENTICATED),
        ):
            with pytest.raises(grpc.RpcError) as err:
                stub.Register(request, metadata=metadata, timeout=10)
            assert err.value.code() is code, err.value.details()
        agent_id = stub.Register(request, metadata=wire.auth_metadata(farm.token), timeout=10).agent_id
        # Another token may neither act as this agent nor take its name.
        with pytest.raises(grpc.RpcError) as err:
            stub.Heartbeat(pb.HeartbeatRequest(agent_id=agent_id), metadata=wire.auth_metadata(other_agent_token))
        assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as err:
            stub.Register(request, metadata=wire.auth_metadata(other_agent_token), timeout=10)
        assert err.value.code() is grpc.StatusCode.ALREADY_EXISTS
        with pytest.raises(grpc.RpcError) as err:
            stub.LeaseBatch(pb.LeaseBatchRequest(agent_id=agent_id), metadata=wire.auth_metadata(team_token))
        assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED


def test_cross_target_batches_are_built_for_the_board(farm):
    """An aarch64 class's kernels: shared libraries linked by the cross compiler (an
    aarch64 ELF), or, without one, .tar archives the board links."""
    wl = gemm(16)
    aarch64 = {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon"]}
    suffix = artifact_suffix(aarch64)
    with transaction(farm.sessions) as s:
        s.scalars(select(DeviceClass).where(DeviceClass.name == farm.device_class)).one().target = aarch64
    measurer = farm.measurer()
    task = measurer.prepare(wl, f"{wl.key}@arm", aarch64)
    inputs = gemm_inputs(wl, task.key, 2)
    measurer.submit(MeasureBatch(id="0:1", task=task, inputs=tuple(inputs), timing=FAST))
    farm.build()
    (batch,) = farm.batch_rows()
    assert batch.state is BatchState.READY  # waits for an aarch64 agent
    with transaction(farm.sessions) as s:
        paths = list(s.scalars(select(BatchCandidate.artifact_path).where(BatchCandidate.batch_id == batch.id)))
    assert len(paths) == 2 and all(p.endswith(suffix) for p in paths)
    assert all((farm.root / p).stat().st_size > 0 for p in paths)
    if suffix == ".so":
        assert {elf_machine(farm.root / p) for p in paths} == {ELF_MACHINE_AARCH64}
    measurer.cancel_pending()
    assert {r.error_kind for r in collect_all(measurer, 2)} == {ErrorKind.RUN_ERROR}
    measurer.close()


def test_a_tuned_model_is_run_by_an_agent_of_its_class(farm, tmp_path, agent_caps, signing_keys):
    """The path every tuned model takes (here on this host's class, so no emulator is
    needed): the scheduler's model check queues a model run, an agent leases it, runs the
    library and times it beside onnxruntime on the signed ONNX graph, and sends outputs
    and latencies, the check compares them with onnxruntime. A library that does not
    load fails the job; a run no agent takes in time leaves the model unchecked."""
    pytest.importorskip("onnxruntime")
    from onnx_models import tiny_onnx

    from services.protocol.signing import ArtifactSigner
    from services.scheduler.exceptions import JobFailed
    from services.scheduler.model_check import DeviceRun, check_on_device
    from tunefarm.models.build import build_model_library
    from tunefarm.models.finish import load_model

    m = load_model(tiny_onnx(tmp_path / "tiny.onnx"), {"x": [1, 3, 8, 8]}, name="tiny")
    built = build_model_library(
        m.tasks.fused_mod, tmp_path / "tuned", target=farm.target, inputs=m.imported.inputs, outputs=m.imported.outputs
    )
    with transaction(farm.sessions) as s:
        class_id = s.scalar(select(DeviceClass.id).where(DeviceClass.name == farm.device_class))
    where = DeviceRun(
        farm.sessions, farm.root, job_id=farm.job_id, device_class_id=class_id, device_class=farm.device_class,
        wait_secs=0.5, stop=threading.Event(), repeat=5, warmup=1, poll_secs=0.05,
        signer=ArtifactSigner.from_file(signing_keys[0]),
    )  # fmt: skip
    unchecked = check_on_device(m, built.directory, where)  # no agent yet
    assert unchecked.check["ok"] is None and "no agent of" in unchecked.check["problem"]
    assert built.library.is_file()

    where = replace(where, wait_secs=60.0)
    agent = start_thread_agent(farm, f"{farm.device_class}-m", tmp_path, {**agent_caps, "emulated": False})
    try:
        outcome = check_on_device(m, built.directory, where)
        assert outcome.check["ok"] is True and outcome.check["max_rel_error"] < 1e-4
        assert outcome.latency["median"] > 0 and outcome.latency["emulated"] is False
        assert outcome.measured_on["agent"] == f"{farm.device_class}-m" and outcome.measured_on["emulated"] is False
        ort = outcome.onnxruntime_latency  # timed by the agent, beside the model, on its threads
        assert ort["median"] > 0 and ort["runs"] == outcome.latency["runs"] == 5 and ort["emulated"] is False
        assert ort["threads"] == outcome.latency["threads"] == 1 and len(ort["round_medians"]) == 5
        assert outcome.peer_notes is None
        built.library.write_bytes(b"not a library")
        with pytest.raises(JobFailed, match="did not run on"):
            check_on_device(m, built.directory, where)
        assert not built.library.exists()  # not kept
    finally:
        agent.close()


def test_a_model_run_on_a_gpu_agent_says_which_gpu():
    """`measured_on` of a model run names the GPU of the agent that ran it (its registered
    capabilities, copied into the run's fingerprint by the lease service)."""
    from services.db.models import ModelRun
    from services.scheduler.model_check import DeviceRun, _measured_on

    where = DeviceRun(None, Path("."), job_id=1, device_class_id=1, device_class="cuda-sm_90", wait_secs=1.0,
                      stop=threading.Event())  # fmt: skip
    fingerprint = {"agent": "gpu-1", "gpu_name": "NVIDIA H100 80GB HBM3", "gpu_compute_capability": "9.0"}
    on_gpu = _measured_on(where, 7, ModelRun(result={"agent": "gpu-1", "emulated": False, "fingerprint": fingerprint}))
    assert on_gpu == {
        "on": "an agent of the class", "device_class": "cuda-sm_90", "agent": "gpu-1", "emulated": False,
        "model_run": 7, "gpu": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0",
    }  # fmt: skip
    on_cpu = _measured_on(where, 8, ModelRun(result={"agent": "cpu-1", "fingerprint": {"agent": "cpu-1"}}))
    assert "gpu" not in on_cpu and on_cpu["agent"] == "cpu-1"
    assert _measured_on(where, 9, None)["agent"] is None  # not run


def test_peers_timed_on_an_emulator_are_labelled_so_and_a_peer_not_timed_is_a_note():
    """What the scheduler makes of a model run's peer timings: latencies as `tune`'s report
    has them (threads, round medians), flagged emulated when the agent is; a peer the
    agent could not time, or an agent that timed none, is a note."""
    from services.scheduler.model_check import _peers

    stored = {
        "onnxruntime": {"latency_samples": [2e-3, 4e-3, 3e-3], "round_medians": [2e-3, 4e-3, 3e-3], "threads": 2},
        "openvino": {"error": "timing openvino failed (raised): cannot read the model"},
    }
    peers, notes = _peers(stored, emulated=True)
    assert peers == {"onnxruntime": {"mean": pytest.approx(3e-3), "median": 3e-3, "p90": pytest.approx(3.8e-3),
                                     "p99": pytest.approx(3.98e-3), "threads": 2, "runs": 3,
                                     "round_medians": [2e-3, 4e-3, 3e-3], "emulated": True}}  # fmt: skip
    assert notes == {"openvino": "timing openvino failed (raised): cannot read the model"}
    assert _peers(stored, emulated=False)[0]["onnxruntime"]["emulated"] is False
    assert _peers({}, emulated=False) == ({}, {"onnxruntime": "the agent timed no peers (an agent older than peer timing)"})


def test_the_agent_imports_no_server_side_packages():
    code = (
        "import json, sys; import services.agent.cli\n"
        "bad = ('sqlalchemy', 'pydantic', 'pydantic_settings', 'redis', 'rq', 'xgboost', 'tvm', 'tunefarm.search',\n"
        "       'services.db', 'services.scheduler', 'services.worker', 'services.lease', 'services.api',\n"
        "       'services.common')\n"
        "print(json.dumps(sorted(m for m in sys.modules if any(m == b or m.startswith(b + '.') for b in bad))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


@pytest.mark.slow
def test_a_killed_agents_batch_is_leased_again_and_measured_exactly_once(farm, tmp_path):
    wl = gemm()
    measurer = farm.measurer()
    task = measurer.prepare(wl, f"{wl.key}@test", farm.target)
    inputs = gemm_inputs(wl, task.key, 8)
    names = [f"{farm.device_class}-p{i}" for i in range(2)]
    env = {**os.environ, "TUNEFARM_AGENT_TOKEN": farm.token, "PYTHONUNBUFFERED": "1"}
    procs = {}
    for name in names:
        log = open(tmp_path / f"{name}.log", "wb")  # noqa: SIM115 (closed with the process)
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "services.agent", "--server", farm.server_address,
             "--device-class", farm.device_class, "--name", name, "--work-dir", str(tmp_path / name),
             "--threads", "1", "--signing-public-key", str(farm.public_key)],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        # ~0.25 s per kernel: the batch takes a few seconds, long enough to kill its agent midway.
        slow = TimingConfig(repeat=3, min_repeat_ms=60.0)
        measurer.submit(MeasureBatch(id="0:1", task=task, inputs=tuple(inputs), timing=slow))
        farm.build()
        (batch,) = farm.batch_rows()
        deadline = time.monotonic() + 60
        while sum(measurements_per_candidate(farm).values()) < 2:
            assert time.monotonic() < deadline, "no measurement arrived"
            time.sleep(0.05)
        with transaction(farm.sessions) as s:
            first = s.scalars(select(Lease).where(Lease.batch_id == batch.id)).one()
            holder = s.get(Agent, first.agent_id).name
        os.kill(procs[holder].pid, signal.SIGKILL)
        procs[holder].wait(timeout=10)

        results = collect_all(measurer, len(inputs))
        assert sorted(r.key for r in results) == sorted(m.key for m in inputs)
        assert all(r.error_kind is ErrorKind.NONE for r in results), [r.error_msg for r in results]
        assert measurements_per_candidate(farm) == {m.key: 1 for m in inputs}
        with transaction(farm.sessions) as s:
            leases = list(s.scalars(select(Lease).where(Lease.batch_id == batch.id).order_by(Lease.id)))
            state = s.scalar(select(Batch.state).where(Batch.id == batch.id))
            survivor = s.get(Agent, leases[-1].agent_id).name
        assert state is BatchState.DONE
        # The killed agent's lease expired; the survivor finished the batch (on a loaded
        # machine its own lease may have expired once on the way and been renewed).
        assert leases[0].state is LeaseState.EXPIRED and leases[-1].state is LeaseState.FINISHED
        assert all(le.state is LeaseState.EXPIRED for le in leases[1:-1])
        assert survivor != holder

        # A late result under the expired lease is refused.
        with transaction(farm.sessions) as s:
            bc_id = s.scalar(select(BatchCandidate.id).where(BatchCandidate.batch_id == batch.id).limit(1))
            key = s.scalar(select(BatchCandidate.candidate_key).where(BatchCandidate.id == bc_id))
        late = pb.ResultMessage(
            agent_id=first.agent_id,
            lease_id=first.id,
            result=pb.Result(batch_candidate_id=bc_id, candidate_key=key, costs=[1e-3], run_secs=0.1),
        )
        # The killed agent's secret died with it: the token alone cannot send it.
        with grpc.insecure_channel(farm.server_address) as channel:
            stub = pb_grpc.AgentServiceStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                list(stub.ReportResults(iter([late]), metadata=wire.auth_metadata(farm.token), timeout=10))
        assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        measurer.close()


@pytest.mark.slow
def test_a_second_lease_service_on_a_taken_port_is_refused(lease_settings, db_sessions, lease_server):
    """gRPC binds with SO_REUSEPORT unless told not to: a second lease service (or another
    process of the farm's user) on the port would have taken a share of the agents'
    connections without a word."""
    with pytest.raises(OSError, match=f"^cannot listen on {lease_settings.lease_bind}: "):
        make_server(lease_settings, sessions=db_sessions)


def test_the_agent_survives_a_lease_service_restart(farm, tmp_path, agent_caps, lease_settings, db_sessions):
    # Its own lease service on its own port, stopped and started again mid-batch.
    settings = lease_settings.model_copy(update={"lease_bind": f"127.0.0.1:{free_port()}", "lease_secs": 30.0})
    server = make_server(settings, sessions=db_sessions)
    server.start()
    farm.server_address = server.address
    wl = gemm()
    measurer = farm.measurer()
    task = measurer.prepare(wl, f"{wl.key}@test", farm.target)
    inputs = gemm_inputs(wl, task.key, 6)
    measurer.submit(MeasureBatch(id="0:1", task=task, inputs=tuple(inputs), timing=TimingConfig(repeat=3, min_repeat_ms=60.0)))
    farm.build()
    agent = start_thread_agent(farm, f"{farm.device_class}-r", tmp_path, agent_caps)
    try:
        results = collect_all(measurer, 1)
        server.stop(grace=0)
        time.sleep(1.0)
        server = make_server(settings, sessions=db_sessions)
        server.start()
        results += collect_all(measurer, len(inputs) - len(results))
    finally:
        agent.close()
        server.stop(grace=0)
    assert sorted(r.key for r in results) == sorted(m.key for m in inputs)
    assert all(r.error_kind is ErrorKind.NONE for r in results), [r.error_msg for r in results]
    assert measurements_per_candidate(farm) == {m.key: 1 for m in inputs}
    (batch,) = farm.batch_rows()
    assert batch.state is BatchState.DONE and batch.attempts == 1  # the same lease throughout
    measurer.close()


class LoseTheFirstGrant(grpc.UnaryUnaryClientInterceptor):
    """The first LeaseBatch answer that grants a batch never reaches the agent: the lease
    exists in the database, the agent sees a broken call (a lease service killed, or the
    connection cut, between the grant and its answer)."""

    def __init__(self) -> None:
        self.lost: list[int] = []

    def intercept_unary_unary(self, continuation, details, request):
        outcome = continuation(details, request)
        if details.method.endswith("/LeaseBatch") and not self.lost and outcome.code() is grpc.StatusCode.OK:
            answer = outcome.result()
            if answer.HasField("batch"):
                self.lost.append(answer.batch.lease_id)
                raise grpc.RpcError("the connection broke before the answer arrived")
        return outcome


@pytest.mark.slow
def test_a_lease_whose_grant_never_reached_the_agent_is_leased_again_at_once(farm, tmp_path, agent_caps, lease_settings, db_sessions):
    # Leases last 300 s and heartbeats come every 0.3 s: heartbeats that renewed every
    # active lease of the agent would keep the lost one alive for ever, and even a lease
    # left to its deadline would outlast the two minutes given to measuring the batch.
    from services.agent.agent import DeviceAgent

    settings = lease_settings.model_copy(update={"lease_bind": f"127.0.0.1:{free_port()}", "lease_secs": 300.0})
    server = make_server(settings, sessions=db_sessions)
    server.start()
    farm.server_address = server.address
    wl = gemm()
    measurer = farm.measurer()
    task = measurer.prepare(wl, f"{wl.key}@test", farm.target)
    inputs = gemm_inputs(wl, task.key, 3)
    measurer.submit(MeasureBatch(id="0:1", task=task, inputs=tuple(inputs), timing=FAST))
    farm.build()
    stop = threading.Event()
    agent = DeviceAgent(farm.agent_settings(f"{farm.device_class}-lost", tmp_path / "lost"), capabilities=agent_caps, stop=stop)
    dropper = LoseTheFirstGrant()
    agent.stub = pb_grpc.AgentServiceStub(grpc.intercept_channel(agent.channel, dropper))
    errors: list = []
    thread = threading.Thread(target=lambda: _run_collecting(agent, errors), daemon=True)
    thread.start()
    try:
        wait_until(lambda: dropper.lost or errors, timeout=120, what="the agent's first grant")
        results = collect_all(measurer, len(inputs), timeout=120)  # well within the lost lease's 300 s
    finally:
        stop.set()
        thread.join(timeout=30)
        server.stop(grace=0)
    assert errors == []
    assert len(dropper.lost) == 1
    assert sorted(r.key for r in results) == sorted(m.key for m in inputs)
    assert measurements_per_candidate(farm) == {m.key: 1 for m in inputs}
    with transaction(farm.sessions) as s:
        leases = list(s.scalars(  # of the search batch (the agent may confirm its best too)
            select(Lease).join(Batch, Batch.id == Lease.batch_id)
            .where(Lease.agent_id == agent.agent_id, Batch.confirms_measurement_id.is_(None)).order_by(Lease.id)
        ))  # fmt: skip
    assert [le.id for le in leases][0] == dropper.lost[0]
    assert [le.state for le in leases] == [LeaseState.EXPIRED, LeaseState.FINISHED]
    assert leases[0].finished_at - leases[0].granted_at < timedelta(seconds=150)
    measurer.close()


class SeeLeaseBatch(grpc.UnaryUnaryClientInterceptor):
    """Says when the agent asks for work (LeaseBatch), and passes the call on."""

    def __init__(self) -> None:
        self.asked = threading.Event()

    def intercept_unary_unary(self, continuation, details, request):
        if details.method.endswith("/LeaseBatch"):
            self.asked.set()
        return continuation(details, request)


def test_a_stopping_agent_does_not_wait_out_its_long_poll(farm, tmp_path, agent_caps, lease_settings, db_sessions):
    """Stopped while the server holds its LeaseBatch (a long poll of two minutes here, with
    nothing to lease), the agent cancels it and goes offline at once: it does not wait
    for the answer first (`farm down`, a service manager's stop)."""
    from services.agent.agent import DeviceAgent

    settings = lease_settings.model_copy(update={"lease_bind": f"127.0.0.1:{free_port()}", "lease_wait_secs": 120.0})
    server = make_server(settings, sessions=db_sessions)
    server.start()
    farm.server_address = server.address
    stop = threading.Event()
    agent_settings = replace(farm.agent_settings(f"{farm.device_class}-stops", tmp_path / "stops"), lease_wait_secs=150.0)
    agent = DeviceAgent(agent_settings, capabilities=agent_caps, stop=stop)
    seen = SeeLeaseBatch()
    agent.stub = pb_grpc.AgentServiceStub(grpc.intercept_channel(agent.channel, seen))
    errors: list = []
    thread = threading.Thread(target=lambda: _run_collecting(agent, errors), daemon=True)
    thread.start()
    try:
        wait_until(seen.asked.is_set, timeout=120, what="the agent's LeaseBatch")
        stop.set()  # while the call is out: the server answers at the end of its 120 s
        thread.join(timeout=60)
        assert not thread.is_alive()
    finally:
        stop.set()
        thread.join(timeout=180)
        server.stop(grace=0)
    assert errors == []
    with transaction(farm.sessions) as s:
        assert s.get(Agent, agent.agent_id).state is AgentState.OFFLINE  # GoOffline, not a dead connection


def test_a_heartbeat_renews_only_the_leases_the_agent_names(farm):
    wl = gemm(16)
    measurer = farm.measurer()
    task = measurer.prepare(wl, f"{wl.key}@test", farm.target)
    batch_id = _ready_without_building(farm, measurer, task, gemm_inputs(wl, task.key, 2))
    with transaction(farm.sessions) as s:
        agent = agents.register_agent(
            s, name=f"{farm.device_class}-hb", device_class_id=measurer.device_class_id, token_id=None, capabilities={}
        )
        now = s.scalar(select(func.now()))
        lease = leases.lease_next_batch(s, agent_id=agent.id, lease_secs=10, now=now)
    later = now + timedelta(seconds=8)
    with transaction(farm.sessions) as s:  # the grant never arrived: the agent names nothing
        assert leases.heartbeat(s, agent_id=agent.id, lease_secs=10, lease_ids=[], now=later) == []
    with transaction(farm.sessions) as s:
        assert s.get(Lease, lease.id).expires_at == now + timedelta(seconds=10)
        assert leases.expire_leases(s, now=now + timedelta(seconds=11)) == [batch_id]
    with transaction(farm.sessions) as s:  # leased again; this time the agent names it
        again = leases.lease_next_batch(s, agent_id=agent.id, lease_secs=10, now=later + timedelta(seconds=4))
    with transaction(farm.sessions) as s:
        assert leases.heartbeat(
            s, agent_id=agent.id, lease_secs=10, lease_ids=[again.id, lease.id], now=later + timedelta(seconds=9)
        ) == [again.id]
        assert s.get(Lease, again.id).expires_at == later + timedelta(seconds=19)
    with transaction(farm.sessions) as s:  # a LeaseBatch naming nothing ends it at once
        assert agents.release_agent_leases(s, agent_id=agent.id, keep_lease_ids=[]) == [batch_id]
        assert s.get(Lease, again.id).state is LeaseState.EXPIRED
        assert s.scalar(select(Batch.state).where(Batch.id == batch_id)) is BatchState.READY
    measurer.close()


def test_an_agent_going_offline_gives_its_leases_back_at_once(farm):
    """GoOffline (an agent's SIGTERM): its lease ends now and the batch is ready for
    another agent, not after the lease window; the agent is offline, not idle."""
    from services.db import liveness

    wl = gemm(16)
    measurer = farm.measurer()
    task = measurer.prepare(wl, f"{wl.key}@test", farm.target)
    batch_id = _ready_without_building(farm, measurer, task, gemm_inputs(wl, task.key, 2))
    with transaction(farm.sessions) as s:
        agent = agents.register_agent(
            s, name=f"{farm.device_class}-off", device_class_id=measurer.device_class_id, token_id=None, capabilities={}
        )
        lease = leases.lease_next_batch(s, agent_id=agent.id, lease_secs=600)
    with transaction(farm.sessions) as s:
        assert liveness.go_offline(s, agent_id=agent.id) == [batch_id]
    with transaction(farm.sessions) as s:
        assert s.get(Lease, lease.id).state is LeaseState.EXPIRED
        assert s.scalar(select(Batch.state).where(Batch.id == batch_id)) is BatchState.READY
        assert s.get(Agent, agent.id).state is AgentState.OFFLINE
    measurer.close()


def _run_collecting(agent, errors: list) -> None:
    try:
        agent.run()
    except Exception as exc:  # surfaced by the test
        errors.append(exc)


def _ready_without_building(farm: Farm, measurer: FarmMeasurer, task, inputs) -> int:
    """Submit a batch and put it in the queue as if built (no kernels: for lease logic)."""
    measurer.submit(MeasureBatch(id="0:1", task=task, inputs=tuple(inputs), timing=FAST))
    (batch,) = farm.batch_rows()
    with transaction(farm.sessions) as s:
        batches.transition_batch(s, batch_id=batch.id, to=BatchState.BUILDING)
        batches.mark_batch_ready(s, batch_id=batch.id)
    return batch.id


def test_results_of_a_lease_are_stored_in_bulk_exactly_once(farm):
    from services.db.exceptions import LeaseNotHeld
    from tunefarm.records import BuildResult as Build
    from tunefarm.records import MeasureRecord, MeasureResult, RunResult

    wl = gemm(16)
    measurer = farm.measurer()
    task = measurer.prepare(wl, f"{wl.key}@test", farm.target)
    inputs = gemm_inputs(wl, task.key, 3)
    batch_id = _ready_without_building(farm, measurer, task, inputs)
    with transaction(farm.sessions) as s:
        agent = agents.register_agent(
            s, name=f"{farm.device_class}-bulk", device_class_id=measurer.device_class_id, token_id=None, capabilities={}
        )
        lease = leases.lease_next_batch(s, agent_id=agent.id, lease_secs=60)
        ids = {c.candidate_key: c.id for c in batches.unmeasured_candidates(s, batch_id=batch_id)}

    def record(m: MeasureInput, cost: float | None) -> MeasureRecord:
        kind = ErrorKind.NONE if cost else ErrorKind.WRONG_RESULT
        run = RunResult(m.key, (cost,) if cost else (), 0.1, kind, "" if cost else "off by one", verified=bool(cost))
        return MeasureRecord.of(MeasureResult(m, Build(m.key, "k.so", 0.1), run), workload="w", target={}, timestamp=1.0)

    items = [(ids[m.key], record(m, c)) for m, c in zip(inputs, (2e-3, 1e-3, None))]
    for created in (True, False):  # a resent stream stores nothing twice
        with transaction(farm.sessions) as s:
            got = measurements.record_measurements(s, lease_id=lease.id, agent_id=agent.id, items=items, fingerprint={})
        assert [r.created for r in got] == [created] * 3
    with transaction(farm.sessions) as s:
        job = s.get(Job, farm.job_id)
        row = s.get(Agent, agent.id)
        best = s.scalar(select(Measurement.candidate_key).where(Measurement.id == job.tasks[0].best_measurement_id))
        assert job.trials_used == 3 and job.tasks[0].trials == 3 and job.tasks[0].best_cost == 1e-3
        assert best == inputs[1].key
        assert row.measurements_done == 3 and row.errors_by_kind == {"wrong_result": 1}
        leases.finish_lease(s, lease_id=lease.id, agent_id=agent.id)
    with pytest.raises(LeaseNotHeld), transaction(farm.sessions) as s:  # the lease is finished
        measurements.record_measurements(s, lease_id=lease.id, agent_id=agent.id, items=items[:1], fingerprint={})
    assert sorted(r.key for r in collect_all(measurer, 3)) == sorted(m.key for m in inputs)
    measurer.close()


def test_a_batch_no_agent_finishes_is_given_up_with_error_results(farm, lease_settings, db_sessions):
    from services.lease.sweeper import Sweeper

    wl = gemm(16)
    measurer = farm.measurer()
    task = measurer.prepare(wl, f"{wl.key}@test", farm.target)
    inputs = gemm_inputs(wl, task.key, 2)
    batch_id = _ready_without_building(farm, measurer, task, inputs)
    with transaction(farm.sessions) as s:
        agent = agents.register_agent(
            s, name=f"{farm.device_class}-dies", device_class_id=measurer.device_class_id, token_id=None, capabilities={}
        )
        now = s.scalar(select(func.now()))

    for attempt in range(3):  # leased, then its agent goes silent and the lease expires, three times
        t = now + timedelta(seconds=100 * attempt)
        with transaction(farm.sessions) as s:
            assert leases.lease_next_batch(s, agent_id=agent.id, lease_secs=10, now=t).batch_id == batch_id
        with transaction(farm.sessions) as s:
            assert leases.expire_leases(s, now=t + timedelta(seconds=11)) == [batch_id]
    report = Sweeper(lease_settings.model_copy(update={"max_lease_attempts": 3}), db_sessions).sweep()
    assert report.given_up == [batch_id]
    results = collect_all(measurer, 2)
    assert sorted(r.key for r in results) == sorted(m.key for m in inputs)
    assert {r.error_kind for r in results} == {ErrorKind.RUN_CRASH}
    assert "leased 3 times" in results[0].error_msg
    (batch,) = farm.batch_rows()
    assert batch.state is BatchState.FAILED
    assert measurements_per_candidate(farm) == {m.key: 1 for m in inputs}
    measurer.close()


def test_the_generated_grpc_code_is_what_make_proto_writes(tmp_path):
    pytest.importorskip("grpc_tools")
    from services.protocol import proto_build

    written = proto_build.build(tmp_path)
    for path in written:
        checked_in = proto_build.OUT_DIR / path.name
        assert checked_in.read_text() == path.read_text(), f"{checked_in} is stale: run `make proto`"


# -- results the lease service refuses --------------------------------------------------------


def _ready_batches(farm: Farm, measurer: FarmMeasurer, task, groups: list[list[MeasureInput]]) -> list[int]:
    """Submit one batch per group and put each in the queue as if built."""
    for n, group in enumerate(groups):
        measurer.submit(MeasureBatch(id=f"0:{n + 1}", task=task, inputs=tuple(group), timing=FAST))
    ids = [b.id for b in farm.batch_rows()]
    with transaction(farm.sessions) as s:
        for batch_id in ids:
            batches.transition_batch(s, batch_id=batch_id, to=BatchState.BUILDING)
            batches.mark_batch_ready(s, batch_id=batch_id)
    return ids


def _report(stub, metadata, agent_id: int, lease_id: int, results: list[pb.Result], finish: bool = False) -> list:
    """One ReportResults stream: the acks, or the stream's RpcError."""
    msgs = [pb.ResultMessage(agent_id=agent_id, lease_id=lease_id, result=r) for r in results]
    if finish:
        msgs.append(pb.ResultMessage(agent_id=agent_id, lease_id=lease_id, finish=pb.Finish()))
    return list(stub.ReportResults(iter(msgs), metadata=metadata, timeout=10))


class Registrar:
    """Registers agents over raw gRPC and keeps each one's secret, as an agent does."""

    def __init__(self, stub, farm: Farm):
        self.stub = stub
        self.farm = farm
        self.secrets: dict[int, str] = {}

    def register(self, name: str, token: str) -> int:
        caps = pb.Capabilities(arch=os.uname().machine, target_json=json.dumps(self.farm.target))
        request = pb.RegisterRequest(name=f"{self.farm.device_class}-{name}", device_class=self.farm.device_class,
                                     capabilities=caps)  # fmt: skip
        resp = self.stub.Register(request, metadata=wire.auth_metadata(token), timeout=10)
        assert resp.agent_secret.startswith(wire.AGENT_SECRET_PREFIX)
        self.secrets[resp.agent_id] = resp.agent_secret
        return resp.agent_id

    def meta(self, token: str, agent_id: int):
        """A call's metadata: `token` and the secret agent `agent_id` was given."""
        return wire.agent_metadata(token, self.secrets[agent_id])


def _ok(candidate: pb.LeasedCandidate, cost: float) -> pb.Result:
    return pb.Result(
        batch_candidate_id=candidate.batch_candidate_id, candidate_key=candidate.candidate_key,
        costs=[cost], run_secs=0.01, error_kind=pb.ERROR_KIND_NONE, verified=True,
    )


def _stored(farm: Farm) -> dict[int, tuple[int | None, float | None]]:
    """Every measurement of the farm's job: candidate id -> (lease id, cost)."""
    with transaction(farm.sessions) as s:
        rows = s.execute(
            select(Measurement.batch_candidate_id, Measurement.lease_id, Measurement.cost).where(
                Measurement.job_id == farm.job_id
            )
        ).all()
    return {r.batch_candidate_id: (r.lease_id, r.cost) for r in rows}


def test_late_and_fabricated_results_are_refused_and_nothing_is_stored(farm):
    """At the gRPC level against the real lease service: results from an agent that does
    not hold the lease (it expired and the batch went to another agent; another agent's
    lease; a lease that does not exist) and fabricated ones (unknown candidate, a candidate
    of another batch, the same candidate twice, one measured under another lease) are
    refused with their status code, and nothing of theirs is stored."""
    wl = gemm(16)
    measurer = farm.measurer()
    task = measurer.prepare(wl, f"{wl.key}@test", farm.target)
    inputs = gemm_inputs(wl, task.key, 6)
    first, second = _ready_batches(farm, measurer, task, [inputs[:4], inputs[4:]])
    with transaction(farm.sessions) as s:
        _, token_b = tokens.issue_token(s, kind=TokenKind.AGENT, label="b")
        other_batch_candidate = s.scalar(select(func.min(BatchCandidate.id)).where(BatchCandidate.batch_id == second))
    code = grpc.StatusCode
    with grpc.insecure_channel(farm.server_address) as channel:
        stub = pb_grpc.AgentServiceStub(channel)
        agents = Registrar(stub, farm)
        register, meta = agents.register, agents.meta

        def lease(agent_id: int, token: str) -> pb.LeasedBatch:
            resp = stub.LeaseBatch(pb.LeaseBatchRequest(agent_id=agent_id), metadata=meta(token, agent_id), timeout=10)
            assert resp.HasField("batch")
            return resp.batch

        def refused(expected: grpc.StatusCode, token: str, agent_id: int, lease_id: int, results, finish=False) -> str:
            before = _stored(farm)
            with pytest.raises(grpc.RpcError) as err:
                _report(stub, meta(token, agent_id), agent_id, lease_id, results, finish)
            assert err.value.code() is expected, err.value.details()
            assert _stored(farm) == before  # nothing of it was stored
            return err.value.details()

        a, b = register("a", farm.token), register("b", token_b)
        la = lease(a, farm.token)
        assert la.batch_id == first and len(la.candidates) == 4
        c1, c2, c3, c4 = la.candidates
        # Fabricated results under A's own lease.
        forged = pb.Result(batch_candidate_id=10**12, candidate_key="x", costs=[1e-3])
        assert "not in batch" in refused(code.INVALID_ARGUMENT, farm.token, a, la.lease_id, [forged])
        of_other_batch = pb.Result(batch_candidate_id=other_batch_candidate, candidate_key=inputs[4].key, costs=[1e-3])
        refused(code.INVALID_ARGUMENT, farm.token, a, la.lease_id, [of_other_batch])
        wrong_key = pb.Result(batch_candidate_id=c1.batch_candidate_id, candidate_key=c2.candidate_key, costs=[1e-3])
        details = refused(code.INVALID_ARGUMENT, farm.token, a, la.lease_id, [wrong_key])
        assert c1.candidate_key not in details  # the key it should have had is never told
        # A lease that does not exist, for a batch never leased; and another agent's lease.
        never = pb.Result(batch_candidate_id=other_batch_candidate, candidate_key=inputs[4].key, costs=[1e-3])
        refused(code.FAILED_PRECONDITION, farm.token, a, la.lease_id + 10**6, [never])
        refused(code.FAILED_PRECONDITION, token_b, b, la.lease_id, [_ok(c1, 1e-3)], finish=True)
        refused(code.PERMISSION_DENIED, token_b, a, la.lease_id, [_ok(c1, 1e-3)])  # acting as A with B's token

        # A reports c1; the same result again on a new stream (a reconnect) is stored once.
        for _ in range(2):
            acks = _report(stub, meta(farm.token, a), a, la.lease_id, [_ok(c1, 2e-3)])
            assert [list(x.batch_candidate_ids) for x in acks] == [[c1.batch_candidate_id]]
        assert _stored(farm) == {c1.batch_candidate_id: (la.lease_id, 2e-3)}
        # The same candidate twice on one stream: refused; the second copy is never stored
        # (the first may be, when the stream stored it before the second came).
        with pytest.raises(grpc.RpcError) as err:
            _report(stub, meta(farm.token, a), a, la.lease_id, [_ok(c4, 3e-3), _ok(c4, 4e-3)])
        assert err.value.code() is code.INVALID_ARGUMENT and "twice" in err.value.details()
        c4_stored = _stored(farm).get(c4.batch_candidate_id)
        assert c4_stored in (None, (la.lease_id, 3e-3))

        # A goes silent: its lease expires and B leases the batch (only what is unmeasured).
        with transaction(farm.sessions) as s:
            s.execute(update(Lease).where(Lease.id == la.lease_id).values(expires_at=func.now() - timedelta(seconds=60)))
        # The sweeper requeues it (while the sweeper holds the batch, a lease skips it).
        deadline = time.monotonic() + 10
        while farm.batch_rows()[0].state is not BatchState.READY:
            assert time.monotonic() < deadline, "the expired lease was not swept"
            time.sleep(0.05)
        lb = lease(b, token_b)
        assert lb.batch_id == first and lb.lease_id != la.lease_id
        unmeasured = [c2, c3] + ([c4] if c4_stored is None else [])
        assert [c.batch_candidate_id for c in lb.candidates] == [c.batch_candidate_id for c in unmeasured]
        # A's late results and finish are refused; so is B reporting what A measured.
        details = refused(code.FAILED_PRECONDITION, farm.token, a, la.lease_id, [_ok(c2, 5e-3), _ok(c3, 5e-3)], True)
        assert "expired" in details
        refused(code.ALREADY_EXISTS, token_b, b, lb.lease_id, [_ok(c1, 6e-3)])
        refused(code.FAILED_PRECONDITION, farm.token, a, lb.lease_id, [_ok(c2, 5e-3)])  # B's lease, A's results
        # B's results are stored and finish the batch.
        acks = _report(stub, meta(token_b, b), b, lb.lease_id, [_ok(c, 7e-3) for c in unmeasured], finish=True)
        assert acks[-1].finished and acks[-1].batch_state == "done"
    assert _stored(farm) == {
        c1.batch_candidate_id: (la.lease_id, 2e-3),
        c2.batch_candidate_id: (lb.lease_id, 7e-3),
        c3.batch_candidate_id: (lb.lease_id, 7e-3),
        c4.batch_candidate_id: c4_stored or (lb.lease_id, 7e-3),
    }
    measurer.close()


def test_a_token_the_database_says_is_revoked_is_refused_before_its_notification_arrives(
    farm, lease_server, monkeypatch
):
    """The revocation's notification may come late (a loaded machine): the lease service's
    own database checks (leasing, heartbeats) refuse the token meanwhile, and the first
    refusal drops it from the token cache, so no later call with it is answered either."""
    assert lease_server.revocations.wait_connected(10)
    monkeypatch.setattr(lease_server.revocations, "_revoked", [])  # the notification reaches nobody
    code = grpc.StatusCode
    with grpc.insecure_channel(farm.server_address) as channel:
        stub = pb_grpc.AgentServiceStub(channel)
        agents = Registrar(stub, farm)
        a = agents.register("late", farm.token)
        meta = agents.meta(farm.token, a)
        stub.Heartbeat(pb.HeartbeatRequest(agent_id=a), metadata=meta, timeout=10)  # the token is cached now
        with transaction(farm.sessions) as s:
            tokens.revoke_token_by_ref(s, ref=farm.token)
        with pytest.raises(grpc.RpcError) as err:  # the lease's own check: refused, not "withheld"
            stub.LeaseBatch(pb.LeaseBatchRequest(agent_id=a), metadata=meta, timeout=10)
        assert err.value.code() is code.UNAUTHENTICATED and "revoked" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:  # and from now on at the token itself
            _report(stub, meta, a, 1, [], finish=True)
        assert err.value.code() is code.UNAUTHENTICATED and "unknown or revoked token" in err.value.details()


def test_a_revoked_agent_token_is_refused_at_once_and_its_agents_get_no_more_work(farm, lease_server):
    """The lease service trusts a verified token for 30 s (its cache); revoking it
    reaches the service at once (a PostgreSQL notification): the agent's next call is
    UNAUTHENTICATED, its lease ends (the batch goes to another agent without waiting for
    the lease to expire), and nothing it sends is stored."""

    assert lease_server.servicer.settings.token_cache_secs >= 30
    assert lease_server.revocations.wait_connected(10)
    wl = gemm(16)
    measurer = farm.measurer()
    task = measurer.prepare(wl, f"{wl.key}@test", farm.target)
    batch_id = _ready_without_building(farm, measurer, task, gemm_inputs(wl, task.key, 2))
    with transaction(farm.sessions) as s:
        _, token_b = tokens.issue_token(s, kind=TokenKind.AGENT, label="b")
    code = grpc.StatusCode
    with grpc.insecure_channel(farm.server_address) as channel:
        stub = pb_grpc.AgentServiceStub(channel)
        agents = Registrar(stub, farm)
        a, b = agents.register("a", farm.token), agents.register("b", token_b)
        meta_a, meta_b = agents.meta(farm.token, a), agents.meta(token_b, b)
        la = stub.LeaseBatch(pb.LeaseBatchRequest(agent_id=a), metadata=meta_a, timeout=10).batch
        assert la.batch_id == batch_id
        stub.Heartbeat(pb.HeartbeatRequest(agent_id=a, held_lease_ids=[la.lease_id]), metadata=meta_a, timeout=10)  # the token is cached now
        with transaction(farm.sessions) as s:
            revoked = tokens.revoke_token_by_ref(s, ref=farm.token)
            assert revoked.kind is TokenKind.AGENT and revoked.revoked_at is not None
        deadline = time.monotonic() + 10  # the notification's way: milliseconds, not the cache's 30 s
        while True:
            try:
                stub.Heartbeat(pb.HeartbeatRequest(agent_id=a), metadata=meta_a, timeout=10)
            except grpc.RpcError as err:
                assert err.code() is code.UNAUTHENTICATED and "revoked" in err.details()
                break
            assert time.monotonic() < deadline, "a revoked token was still accepted"
            time.sleep(0.05)
        with pytest.raises(grpc.RpcError) as err:
            stub.LeaseBatch(pb.LeaseBatchRequest(agent_id=a), metadata=meta_a, timeout=10)
        assert err.value.code() is code.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            _report(stub, meta_a, a, la.lease_id, [_ok(la.candidates[0], 1e-3)], finish=True)
        assert err.value.code() is code.UNAUTHENTICATED
        with transaction(farm.sessions) as s:
            assert s.get(Agent, a).state.value == "offline"
            assert s.get(Lease, la.lease_id).state is LeaseState.EXPIRED
            assert leases.lease_next_batch(s, agent_id=a, lease_secs=60) is None  # even past the service
        # The batch went back to the queue at once: another agent leases it now.
        lb = stub.LeaseBatch(pb.LeaseBatchRequest(agent_id=b), metadata=meta_b, timeout=10).batch
        assert lb.batch_id == batch_id and len(lb.candidates) == 2
        assert agents.register("a", token_b) == a  # the board, given a new token, keeps its agent name
    assert _stored(farm) == {}
    measurer.close()
# -- the build lock (services.db.build_locks) ----------------------------------------------


def build_locks_held(sessions, ids):
    with transaction(sessions) as s:
        return build_locks.held(s, ids)


def test_one_worker_holds_a_batch_and_the_scheduler_sees_it(db_sessions):
    engine = db_sessions.kw["bind"]
    big = 2**32 + 7  # ids beyond 32 bits share the low bits' lock, and are reported as asked
    assert build_locks_held(db_sessions, [7, 8, big]) == set()
    with build_locks.holding(engine, 7) as mine:
        assert mine
        with build_locks.holding(engine, 7) as theirs:  # another worker: another connection
            assert not theirs
        assert build_locks_held(db_sessions, [7, 8]) == {7}
        assert build_locks_held(db_sessions, [big]) == {big}
    assert build_locks_held(db_sessions, [7, 8]) == set()


def test_a_lost_connection_releases_the_lock(db_sessions):
    from sqlalchemy import text

    engine = db_sessions.kw["bind"]
    with build_locks.holding(engine, 11) as mine:
        assert mine and build_locks_held(db_sessions, [11]) == {11}
        with engine.connect() as admin:  # the worker's session ends, as when it is killed
            admin.execute(text(
                "SELECT pg_terminate_backend(pid, 10000) FROM pg_locks WHERE locktype = 'advisory' AND objid = 11 "
                "AND classid = CAST(:ns AS oid) AND database = (SELECT oid FROM pg_database "
                "WHERE datname = current_database())"
            ), {"ns": build_locks.BUILD_LOCK_NAMESPACE})  # fmt: skip
            admin.commit()
        assert build_locks_held(db_sessions, [11]) == set()
    assert build_locks_held(db_sessions, [11]) == set()  # leaving the block after the loss is quiet


# -- measurement trust: a lying agent (timing floor, confirmations, quarantine) ---------------


_SECRETS: dict[int, str] = {}
"""The secret each agent registered by `_register` was given (agent ids are unique in the module's database)."""


def _register(stub, farm: Farm, name: str, token: str) -> int:
    caps = pb.Capabilities(arch=os.uname().machine, target_json=json.dumps(farm.target))
    request = pb.RegisterRequest(name=f"{farm.device_class}-{name}", device_class=farm.device_class, capabilities=caps)
    resp = stub.Register(request, metadata=wire.auth_metadata(token), timeout=10)
    _SECRETS[resp.agent_id] = resp.agent_secret
    return resp.agent_id


def _meta(token: str, agent_id: int):
    return wire.agent_metadata(token, _SECRETS[agent_id])


def _lease(stub, agent_id: int, token: str) -> pb.LeasedBatch | None:
    """One LeaseBatch (a long poll of the module's 0.5 s): the batch, or None."""
    resp = stub.LeaseBatch(pb.LeaseBatchRequest(agent_id=agent_id), metadata=_meta(token, agent_id), timeout=10)
    return resp.batch if resp.HasField("batch") else None


def _measure(stub, token: str, agent_id: int, leased: pb.LeasedBatch, costs: list[float]) -> str:
    """Report one verified time per leased candidate and finish; the batch's state."""
    results = [_ok(c, t) for c, t in zip(leased.candidates, costs)]
    acks = _report(stub, _meta(token, agent_id), agent_id, leased.lease_id, results, True)
    return acks[-1].batch_state


def _task_row(farm: Farm):
    from services.db.models import JobTask

    with transaction(farm.sessions) as s:
        return s.scalars(select(JobTask).where(JobTask.job_id == farm.job_id)).one()


def _standing(farm: Farm, agent_id: int):
    from services.api import crud

    with transaction(farm.sessions) as s:
        return next(d for d in crud.list_devices(s, fresh_secs=60.0) if d.id == agent_id)


def _class_model_learns(farm: Farm, device_class_id: int, decoded=None) -> int:
    """Programs the class's shared cost model learns from Postgres now (a fresh scheduler's
    view, or, with `decoded`, that of the scheduler whose measurer decoded those records)."""
    from services.scheduler.shared_model import ClassModels

    models = ClassModels(
        farm.sessions, farm.root, warmup=1, save_every=10**6, catch_up_secs=0, transfer=False, decoded=decoded
    )
    return models.get(device_class_id).model.num_samples


def test_times_below_the_timing_floor_are_refused_and_flag_the_agent(farm):
    """Issue 22: an agent with a valid token reports 1 ns, verified, for a batch it never
    ran. The times are below what the class's cores could do (FLOPs at peak): stored as
    below_floor errors, never the task's best, never learnt; the agent is flagged."""
    from services.db import timing_floor
    from tunefarm.search.task import make_task

    wl = gemm(128)
    measurer = farm.measurer()
    task = measurer.prepare(wl, make_task(wl, farm.target).key, farm.target)  # the key the class's model knows
    inputs = gemm_inputs(wl, task.key, 3)
    _ready_batches(farm, measurer, task, [inputs])
    floor = timing_floor.floor_secs(farm.target, flops=wl.flops, io_bytes=3 * 128 * 128 * 4)
    assert floor > 1e-9  # the premise: 1 ns is faster than the class can multiply these matrices
    with grpc.insecure_channel(farm.server_address) as channel:
        stub = pb_grpc.AgentServiceStub(channel)
        liar = _register(stub, farm, "liar", farm.token)
        leased = _lease(stub, liar, farm.token)
        assert _measure(stub, farm.token, liar, leased, [1e-9] * 3) == "done"
    results = collect_all(measurer, 3)
    assert {r.error_kind for r in results} == {ErrorKind.BELOW_FLOOR}
    assert "below the class's timing floor" in results[0].error_msg
    task_row = _task_row(farm)
    assert task_row.best_cost is None and task_row.best_measurement_id is None and task_row.trials == 3
    with transaction(farm.sessions) as s:
        stored = s.execute(select(Measurement.error_kind, Measurement.cost).where(Measurement.job_id == farm.job_id)).all()
        confirmations = s.scalar(select(func.count()).select_from(Batch).where(
            Batch.job_id == farm.job_id, Batch.confirms_measurement_id.is_not(None)))  # fmt: skip
    assert sorted(stored) == [(ErrorKind.BELOW_FLOOR, None)] * 3 and confirmations == 0
    device = _standing(farm, liar)
    assert device.standing == "flagged" and device.below_floor == 3 and device.errors_by_kind == {"below_floor": 3}
    assert "3 result(s) below the timing floor" in device.flag_reasons
    assert _class_model_learns(farm, measurer.device_class_id) == 0
    measurer.close()


def test_a_lying_agents_fast_times_are_disputed_by_other_agents_and_never_count(farm):
    """Issue 22: the liar's times are above the floor, but far faster than the kernels
    run. Its best is measured again by another agent (never by itself while one is
    live), disputed, and never counts; the agent is flagged and leased no one's
    confirmation; an honest agent's best is confirmed by a second honest agent; the
    class's model learns the honest measurements only. Every candidate is measured once;
    a confirmation is a row of its own."""
    from services.db import job_store
    from services.db.models import Confirmation
    from services.db.states import ConfirmationState
    from tunefarm.search.task import make_task

    wl = gemm(128)
    measurer = farm.measurer()
    task = measurer.prepare(wl, make_task(wl, farm.target).key, farm.target)  # the key the class's model knows
    inputs = gemm_inputs(wl, task.key, 5)
    first, second = _ready_batches(farm, measurer, task, [inputs[:3], inputs[3:]])
    with transaction(farm.sessions) as s:
        _, token_h = tokens.issue_token(s, kind=TokenKind.AGENT, label="honest")
        _, token_h2 = tokens.issue_token(s, kind=TokenKind.AGENT, label="honest-2")
    with grpc.insecure_channel(farm.server_address) as channel:
        stub = pb_grpc.AgentServiceStub(channel)
        liar, honest, honest2 = (_register(stub, farm, n, t) for n, t in
                                 (("liar", farm.token), ("honest", token_h), ("honest-2", token_h2)))  # fmt: skip
        leased = _lease(stub, liar, farm.token)
        assert leased.batch_id == first
        _measure(stub, farm.token, liar, leased, [1e-6, 2e-6, 5e-4])  # real: ~1e-4 s; the last, never a best
        fake = _task_row(farm)
        assert fake.best_cost == 1e-6 and not fake.best_confirmed and fake.confirmed_cost is None
        leased = _lease(stub, honest, token_h)
        assert leased.batch_id == second  # the queue's order: the confirmation came later
        _measure(stub, token_h, honest, leased, [3e-4, 4e-4])
        check = _lease(stub, honest2, token_h2)  # the liar's best, measured again
        assert check.batch_id not in (first, second) and check.candidates[0].candidate_key == inputs[0].key
        _measure(stub, token_h2, honest2, check, [3.1e-4])
        assert _standing(farm, liar).standing == "flagged"
        assert _lease(stub, liar, farm.token) is None  # flagged: no one's confirmation, not even its own
        check = _lease(stub, honest, token_h)  # the liar's next-fastest time, measured again
        assert check.candidates[0].candidate_key == inputs[1].key
        _measure(stub, token_h, honest, check, [3.2e-4])
        assert _lease(stub, honest, token_h) is None  # its own best: another agent that may confirm is live
        check = _lease(stub, honest2, token_h2)
        assert check.candidates[0].candidate_key == inputs[3].key
        _measure(stub, token_h2, honest2, check, [3.05e-4])
    best = _task_row(farm)
    assert best.best_cost == 3e-4 and best.best_confirmed and best.confirmed_cost == 3e-4
    assert best.confirmed_measurement_id == best.best_measurement_id
    with transaction(farm.sessions) as s:
        rows = s.execute(select(Measurement.candidate_key, Measurement.agent_id, Measurement.confirmation,
                                Measurement.vouched_seq).where(Measurement.job_id == farm.job_id)).all()  # fmt: skip
        checks = s.execute(
            select(Confirmation.agent_id, Confirmation.outcome, Confirmation.cost)
            .join(Measurement, Measurement.id == Confirmation.measurement_id)
            .where(Measurement.job_id == farm.job_id).order_by(Confirmation.id)
        ).all()  # fmt: skip
        assert job_store.confirmed_keys(s, job_id=farm.job_id) == {task.key: {inputs[3].key}}
        assert s.get(Job, farm.job_id).trials_used == 5  # confirmations are no trials
    by_key = {r.candidate_key: r for r in rows}
    assert len(rows) == 5 == len(by_key)  # each candidate measured once
    assert [by_key[m.key].confirmation for m in inputs] == [
        ConfirmationState.DISPUTED, ConfirmationState.DISPUTED, None, ConfirmationState.CONFIRMED, None]
    assert checks == [(honest2, ConfirmationState.DISPUTED, 3.1e-4), (honest, ConfirmationState.DISPUTED, 3.2e-4),
                      (honest2, ConfirmationState.CONFIRMED, 3.05e-4)]  # fmt: skip
    assert sorted(r.key for r in collect_all(measurer, 5)) == sorted(m.key for m in inputs)
    assert measurer.decoded.decoded == 5  # each measurement's record decoded once by its job
    liar_row, honest_row = _standing(farm, liar), _standing(farm, honest)
    assert liar_row.confirmations_disputed == 2 and liar_row.confirmations_agreed == 0
    assert any("disputed by other agents" in r for r in liar_row.flag_reasons)
    assert honest_row.standing == "trusted" and honest_row.confirmations_agreed == 1
    assert _standing(farm, honest2).standing == "unconfirmed"
    # The class's model learns the honest agent's two measurements, none of the liar's
    # (not even the one nobody disputed: an agent none of whose times was confirmed).
    assert _class_model_learns(farm, measurer.device_class_id) == 2
    # In the scheduler that polled them, the class's model takes the records its job
    # decoded: nothing is decoded a second time.
    assert _class_model_learns(farm, measurer.device_class_id, measurer.decoded) == 2
    assert measurer.decoded.decoded == 5
    with transaction(farm.sessions) as s:
        vouched = dict(s.execute(select(Measurement.candidate_key, Measurement.vouched_seq)
                                 .where(Measurement.job_id == farm.job_id)).all())  # fmt: skip
    assert [vouched[m.key] is not None for m in inputs] == [False, False, False, True, True]
    measurer.close()


def test_a_quarantined_agent_is_leased_nothing_and_its_unconfirmed_times_count_for_nothing(farm, database_url, capsys):
    from tunefarm_app.cli import main as cli

    wl = gemm(128)
    measurer = farm.measurer()
    task = measurer.prepare(wl, f"{wl.key}@test", farm.target)
    inputs = gemm_inputs(wl, task.key, 4)
    first, second = _ready_batches(farm, measurer, task, [inputs[:2], inputs[2:]])
    with transaction(farm.sessions) as s:
        _, token_h = tokens.issue_token(s, kind=TokenKind.AGENT, label="honest")
    code = grpc.StatusCode
    with grpc.insecure_channel(farm.server_address) as channel:
        stub = pb_grpc.AgentServiceStub(channel)
        suspect = _register(stub, farm, "suspect", farm.token)
        _measure(stub, farm.token, suspect, _lease(stub, suspect, farm.token), [2e-4, 3e-4])
        assert _task_row(farm).best_cost == 2e-4  # its best, not confirmed yet
        held = _lease(stub, suspect, farm.token)
        assert held.batch_id == second
        name = f"{farm.device_class}-suspect"
        assert cli(["farm", "agent", "quarantine", name, "--database-url", database_url]) == 0
        assert "disabled, quarantined" in capsys.readouterr().out
        assert cli(["farm", "agent", "quarantine", "no-such-agent", "--database-url", database_url]) == 2
        assert "no agent named 'no-such-agent'" in capsys.readouterr().err
        with pytest.raises(grpc.RpcError) as err:  # its lease ended with the quarantine
            _measure(stub, farm.token, suspect, held, [1e-4, 1e-4])
        assert err.value.code() is code.FAILED_PRECONDITION
        assert _lease(stub, suspect, farm.token) is None  # work is waiting, but not for it
        assert _task_row(farm).best_cost is None  # its unconfirmed times count for nothing
        assert _standing(farm, suspect).standing == "quarantined"
        honest = _register(stub, farm, "honest", token_h)
        leased = _lease(stub, honest, token_h)
        assert leased.batch_id == second
        _measure(stub, token_h, honest, leased, [2.5e-4, 3.5e-4])
        assert _task_row(farm).best_cost == 2.5e-4
        assert cli(["farm", "agent", "unquarantine", name, "--database-url", database_url]) == 0
        assert "offline" in capsys.readouterr().out
        stub.Heartbeat(pb.HeartbeatRequest(agent_id=suspect), metadata=_meta(farm.token, suspect), timeout=10)
        check = _lease(stub, suspect, farm.token)  # leased again: the honest agent's best, to confirm
        assert check is not None and check.candidates[0].candidate_key == inputs[2].key
    assert _task_row(farm).best_cost == 2e-4  # its times count again (still unconfirmed)
    assert measurements_per_candidate(farm) == {m.key: 1 for m in inputs}
    measurer.close()
