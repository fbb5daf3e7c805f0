"""Attacks on the farm's agents and their service (a reachable lease service, a lying
agent, a false server), each reproduced against the real code:

- agents that share a token try to act as each other (the real lease service on a
  throw-away database): every call naming another agent is refused and tells nothing;
  registering a name again replaces its secret;
- an agent naming a device class no operator created is refused (and nothing is made);
- a false lease service (a hand-written gRPC servicer here) hands the real agent
  kernels and a model library whose loading would leave a marker file: unsigned, signed
  with another key, or with the farm's signature of another candidate. None is loaded
  (no marker; each is a run error); the one the farm signed is (its marker appears);
- it names task data and a kernel with paths that climb out of the work directory:
  nothing is written outside it;
- an agent told to reach another host in plaintext, or without the farm's public key,
  does not start (one line, exit status 2);
- the kernel process of an agent running as root runs as nobody, without network and
  without the agent's token (a kernel whose constructor reports what it can do).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import pytest
from sqlalchemy import select

from services.agent import capabilities
from services.agent.agent import run_agent
from services.agent.cli import main as agent_main
from services.agent.settings import AgentSettings
from services.db import tokens
from services.db.models import Agent, DeviceClass, Lease, Measurement
from services.db.session import transaction
from services.db.states import LeaseState, TokenKind
from services.lease.server import LeaseServer, make_server
from services.lease.settings import LeaseServiceSettings
from services.protocol import wire
from services.protocol.errors import BadRequest
from services.protocol.generated import measurer_pb2 as pb
from services.protocol.generated import measurer_pb2_grpc as pb_grpc
from services.protocol.signing import ArtifactSigner, SignedKind, ensure_key_pair
from tunefarm.measure.runner import LocalRunner
from tunefarm.records import ErrorKind, RunInput, TimingConfig
from tunefarm.sandbox import Sandbox
from tunefarm.target import host_target_dict

AGENT_RUN_SECS = 180.0
"""How long an agent against the false server may take (it starts TVM twice, sandboxed)."""


# -- the real lease service ------------------------------------------------------------------


@pytest.fixture(scope="module")
def lease_server(database_url, db_sessions, tmp_path_factory) -> Iterator[LeaseServer]:
    settings = LeaseServiceSettings(database_url=database_url, lease_bind="127.0.0.1:0",
                                    artifact_root=tmp_path_factory.mktemp("artifacts"), lease_wait_secs=0.2,
                                    # the work board is read again within a long poll: a batch made by a
                                    # test just now is seen whatever an earlier test's poll left cached
                                    lease_recheck_secs=0.05)  # fmt: skip
    server = make_server(settings, sessions=db_sessions)
    server.start()
    yield server
    server.stop(grace=0)


@pytest.fixture
def ready_batch(db_sessions):
    """A device class with a ready batch (test_db's farm) and an agent token."""
    from test_db import make_farm

    farm = make_farm(db_sessions, batches=1, candidates=2, agents=0)
    with transaction(db_sessions) as s:
        _, token = tokens.issue_token(s, kind=TokenKind.AGENT, label="shared")
        class_name = s.get(DeviceClass, farm.device_class_id).name
    return farm, class_name, token


def _register(stub, token: str, class_name: str, name: str) -> tuple[int, str]:
    caps = pb.Capabilities(arch=os.uname().machine, target_json=json.dumps({"kind": "llvm"}))
    request = pb.RegisterRequest(name=name, device_class=class_name, capabilities=caps)
    resp = stub.Register(request, metadata=wire.auth_metadata(token), timeout=10)
    return resp.agent_id, resp.agent_secret


def test_agents_that_share_a_token_cannot_act_as_each_other(lease_server, ready_batch, db_sessions):
    farm, class_name, token = ready_batch
    with grpc.insecure_channel(lease_server.address) as channel:
        stub = pb_grpc.AgentServiceStub(channel)
        a, a_secret = _register(stub, token, class_name, f"{class_name}-a")
        b, b_secret = _register(stub, token, class_name, f"{class_name}-b")
        assert a_secret.startswith(wire.AGENT_SECRET_PREFIX) and b_secret.startswith(wire.AGENT_SECRET_PREFIX)
        own = wire.agent_metadata(token, a_secret)
        leased = stub.LeaseBatch(pb.LeaseBatchRequest(agent_id=a), metadata=own, timeout=10).batch
        assert leased.batch_id == farm.batch_ids[0]
        first = leased.candidates[0]
        result = pb.Result(batch_candidate_id=first.batch_candidate_id, candidate_key=first.candidate_key,
                           costs=[1e-3], run_secs=0.01, verified=True)  # fmt: skip

        def calls(metadata):
            """Every call of an agent, naming A, with `metadata`."""
            held = [leased.lease_id]
            yield lambda: stub.Heartbeat(pb.HeartbeatRequest(agent_id=a, held_lease_ids=held), metadata=metadata, timeout=10)
            yield lambda: stub.LeaseBatch(pb.LeaseBatchRequest(agent_id=a, held_lease_ids=held), metadata=metadata, timeout=10)
            refs = [c.kernel for c in leased.candidates]
            yield lambda: list(stub.Fetch(pb.FetchRequest(agent_id=a, lease_id=leased.lease_id, refs=refs),
                                          metadata=metadata, timeout=10))  # fmt: skip
            msgs = [pb.ResultMessage(agent_id=a, lease_id=leased.lease_id, result=result),
                    pb.ResultMessage(agent_id=a, lease_id=leased.lease_id, finish=pb.Finish())]  # fmt: skip
            yield lambda: list(stub.ReportResults(iter(msgs), metadata=metadata, timeout=10))
            health = pb.HealthReport(agent_id=a, status=pb.HEALTH_STATUS_FAILING, message="forged")
            yield lambda: stub.ReportHealth(health, metadata=metadata, timeout=10)
            yield lambda: stub.ReportModelRun(pb.ModelRunResult(agent_id=a, model_run_id=1, error="forged"),
                                              metadata=metadata, timeout=10)  # fmt: skip

        # B, another process with the same token: without a secret, with its own, with a guess.
        for metadata in (wire.auth_metadata(token), wire.agent_metadata(token, b_secret),
                         wire.agent_metadata(token, wire.AGENT_SECRET_PREFIX + "guess")):  # fmt: skip
            for call in calls(metadata):
                with pytest.raises(grpc.RpcError) as err:
                    call()
                assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED, err.value.details()
                details = err.value.details()
                assert "lease" not in details and a_secret not in details and first.candidate_key not in details
        # A itself goes on, holding its lease; nothing B sent was taken.
        answer = stub.Heartbeat(pb.HeartbeatRequest(agent_id=a, held_lease_ids=[leased.lease_id]), metadata=own, timeout=10)
        assert list(answer.active_lease_ids) == [leased.lease_id]
    with transaction(db_sessions) as s:
        assert s.get(Lease, leased.lease_id).state is LeaseState.ACTIVE
        assert "health" not in (s.get(Agent, a).capabilities or {})
        assert s.scalars(select(Measurement).where(Measurement.lease_id == leased.lease_id)).all() == []


def test_registering_a_name_again_replaces_its_secret(lease_server, ready_batch, db_sessions):
    _, class_name, token = ready_batch
    name = f"{class_name}-restarted"
    with grpc.insecure_channel(lease_server.address) as channel:
        stub = pb_grpc.AgentServiceStub(channel)
        agent_id, old = _register(stub, token, class_name, name)
        again, new = _register(stub, token, class_name, name)  # the agent restarted
        assert again == agent_id and new != old
        with pytest.raises(grpc.RpcError) as err:
            stub.Heartbeat(pb.HeartbeatRequest(agent_id=agent_id), metadata=wire.agent_metadata(token, old), timeout=10)
        assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
        stub.Heartbeat(pb.HeartbeatRequest(agent_id=agent_id), metadata=wire.agent_metadata(token, new), timeout=10)
    with transaction(db_sessions) as s:
        stored = s.get(Agent, agent_id).secret_hash
    assert stored == hashlib.sha256(new.encode()).hexdigest()  # its hash, never the secret


def test_an_agent_naming_a_class_no_operator_created_is_refused(lease_server, ready_batch, db_sessions):
    _, _, token = ready_batch
    made_up = f"made-up-{uuid.uuid4().hex[:8]}"
    with grpc.insecure_channel(lease_server.address) as channel:
        stub = pb_grpc.AgentServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            _register(stub, token, made_up, f"{made_up}-agent")
    assert err.value.code() is grpc.StatusCode.NOT_FOUND and "farm device-class" in err.value.details()
    with transaction(db_sessions) as s:
        assert s.scalar(select(DeviceClass.id).where(DeviceClass.name == made_up)) is None
    assert LeaseServiceSettings().auto_create_device_classes is False


def test_a_flagged_agent_is_told_why_it_gets_no_batch_while_an_honest_one_gets_it(lease_server, ready_batch, db_sessions,
                                                                                  database_url, capsys):
    farm, class_name, token = ready_batch
    with transaction(db_sessions) as s:
        _, honest_token = tokens.issue_token(s, kind=TokenKind.AGENT, label="honest")
    with grpc.insecure_channel(lease_server.address) as channel:
        stub = pb_grpc.AgentServiceStub(channel)
        liar, liar_secret = _register(stub, token, class_name, f"{class_name}-liar")
        honest, honest_secret = _register(stub, honest_token, class_name, f"{class_name}-honest")
        with transaction(db_sessions) as s:
            s.get(Agent, liar).below_floor = 2  # it reported times below the class's floor
        meta = wire.agent_metadata(token, liar_secret)
        started = time.monotonic()
        answer = stub.LeaseBatch(pb.LeaseBatchRequest(agent_id=liar, model_runs=True), metadata=meta, timeout=10)
        assert not answer.HasField("batch") and not answer.HasField("model_run")
        assert answer.withheld.startswith("flagged") and "2 result(s) below the timing floor" in answer.withheld
        assert time.monotonic() - started < 5  # answered at once, not a long poll
        stub.Heartbeat(pb.HeartbeatRequest(agent_id=liar), metadata=meta, timeout=10)  # it still heartbeats
        got = stub.LeaseBatch(pb.LeaseBatchRequest(agent_id=honest), metadata=wire.agent_metadata(honest_token, honest_secret),
                              timeout=10)  # fmt: skip
        assert got.batch.batch_id == farm.batch_ids[0] and not got.withheld
        # An operator looked and pardons it: it is leased work again.
        from tunefarm_app.cli import main as cli

        assert cli(["farm", "agent", "unflag", f"{class_name}-liar", "--database-url", database_url]) == 0
        assert "unconfirmed" in capsys.readouterr().out
        answer = stub.LeaseBatch(pb.LeaseBatchRequest(agent_id=liar), metadata=meta, timeout=10)
        assert not answer.withheld
    with transaction(db_sessions) as s:
        assert s.get(Agent, liar).last_heartbeat_at is not None


def test_a_lease_declares_each_kernels_size_so_the_agent_takes_no_more(lease_server, ready_batch, db_sessions):
    from services.db.models import BatchCandidate

    farm, class_name, token = ready_batch
    built, unbuilt = farm.candidate_ids[farm.batch_ids[0]]
    rel = f"kernels/{uuid.uuid4().hex}.so"
    path = lease_server.servicer.artifact_root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x7fELF" + b"\0" * 1230)
    with transaction(db_sessions) as s:
        s.get(BatchCandidate, built).artifact_path = rel
    with grpc.insecure_channel(lease_server.address) as channel:
        stub = pb_grpc.AgentServiceStub(channel)
        agent, secret = _register(stub, token, class_name, f"{class_name}-sized")
        leased = stub.LeaseBatch(pb.LeaseBatchRequest(agent_id=agent), metadata=wire.agent_metadata(token, secret),
                                 timeout=10).batch  # fmt: skip
    sizes = {c.batch_candidate_id: c.kernel.size for c in leased.candidates}
    assert sizes == {built: 1234, unbuilt: 0}


@pytest.mark.parametrize("name", ["evil\x1b[2J\x1b[31mname", "two\nlines", "a b", "é-look-alike", "x" * 129, "../x"])
def test_an_agent_name_with_other_characters_is_refused_at_registration(lease_server, ready_batch, db_sessions, name):
    _, class_name, token = ready_batch
    with grpc.insecure_channel(lease_server.address) as channel:
        stub = pb_grpc.AgentServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            _register(stub, token, class_name, name)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        details = err.value.details()
        assert wire.AGENT_NAME_RULE in details and "\x1b" not in details and "\n" not in details
        _register(stub, token, class_name, f"{class_name}-Host_1.example")  # letters, digits, '.', '_', '-'
    with transaction(db_sessions) as s:
        assert s.scalar(select(Agent.id).where(Agent.name == name)) is None


def test_agent_names_the_farm_makes_or_an_agent_is_given_follow_the_rule():
    from tunefarm.display import printable
    from tunefarm_app.farm_names import name_part as _name_part

    assert wire.valid_agent_name("box-avx2") and wire.valid_agent_name("a" * 128) and not wire.valid_agent_name("")
    assert wire.valid_agent_name(_name_part("host") + "-" + _name_part("my farm (test)") + "-agent")
    with pytest.raises(BadRequest, match="refused: a name is 1 to 128 characters"):
        AgentSettings(server="127.0.0.1:1", token="tfa_" + "x" * 40, accept_unsigned_code=True, name="box\x1b[2J")
    assert printable("ok\x1b[2J\nforged") == "ok\\x1b[2J\\nforged"  # what `tunefarm devices` prints of an old name


# -- a false lease service ---------------------------------------------------------------------


SECRET = wire.AGENT_SECRET_PREFIX + "handed-out-by-the-false-server"


class FalseLeaseService(pb_grpc.AgentServiceServicer):
    """A lease service that lies: it hands out what it was given (a model run, a batch),
    once each, serves whatever bytes it holds for a file, and keeps what the agent sends."""

    def __init__(self, offers: list[pb.LeaseBatchResponse], files: dict[tuple[int, int], bytes]):
        self.offers = list(offers)
        self.files = files
        self.results: dict[int, pb.Result] = {}
        self.model_runs: list[pb.ModelRunResult] = []
        self.lease_metadata: list[dict[str, str]] = []
        self._lock = threading.Lock()

    def Register(self, request, context):
        return pb.RegisterResponse(agent_id=7, target_json=json.dumps(host_target_dict()), heartbeat_interval_secs=0.2,
                                   lease_secs=30.0, poll_interval_secs=0.05, agent_secret=SECRET)  # fmt: skip

    def Heartbeat(self, request, context):
        return pb.HeartbeatResponse(active_lease_ids=request.held_lease_ids)

    def ReportHealth(self, request, context):
        return pb.HealthResponse()

    def LeaseBatch(self, request, context):
        with self._lock:
            self.lease_metadata.append(dict(context.invocation_metadata()))
            offer = self.offers.pop(0) if self.offers else None
        if offer is None:
            time.sleep(0.2)
            return pb.LeaseBatchResponse()
        return offer

    def Fetch(self, request, context):
        for i, ref in enumerate(request.refs):
            data = self.files.get((ref.kind, ref.id))
            if data is None:
                yield pb.FetchChunk(parts=[pb.FilePart(index=i, last=True, error="no such file")])
                continue
            sha = hashlib.sha256(data).hexdigest()
            yield pb.FetchChunk(parts=[pb.FilePart(index=i, data=data, last=True, total_size=len(data), sha256=sha)])

    def ReportResults(self, request_iterator, context):
        for msg in request_iterator:
            if msg.WhichOneof("body") == "result":
                with self._lock:
                    self.results[msg.result.batch_candidate_id] = msg.result
                yield pb.ResultAck(batch_candidate_ids=[msg.result.batch_candidate_id])
            else:
                yield pb.ResultAck(finished=True, batch_state="done")

    def ReportModelRun(self, request, context):
        with self._lock:
            self.model_runs.append(request)
        return pb.ModelRunAck()


def _serve(servicer: FalseLeaseService) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_AgentServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def _compiler() -> str:
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        if os.environ.get("CI"):  # CI claims these tests: a missing compiler fails them there
            pytest.fail("needs a C compiler (gcc or cc) on PATH")
        pytest.skip("needs a C compiler")
    return cc


def _shared_library(path: Path, source: str, **defines: str) -> bytes:
    """`source` compiled into a shared library at `path`; its bytes."""
    src = path.with_suffix(".c")
    src.write_text(source)
    flags = [f"-D{k}={v}" for k, v in defines.items()]
    subprocess.run([_compiler(), "-shared", "-fPIC", "-O1", *flags, "-o", str(path), str(src)], check=True,
                   capture_output=True, timeout=60)  # fmt: skip
    return path.read_bytes()


MARKER_SOURCE = r"""
#include <stdio.h>
__attribute__((constructor)) static void loaded(void) {
    FILE *f = fopen(MARKER, "w");
    if (f) { fputs("this library was loaded\n", f); fclose(f); }
}
"""
"""A library that leaves a file at MARKER as soon as it is loaded (before any kernel call)."""


def _c_string(text: str) -> str:
    return json.dumps(text)


def _task_data() -> bytes:
    """Task data of a kernel with one float32[4] input and one float32[4] output."""
    buffer = io.BytesIO()
    np.savez(buffer, task_data_version=np.int64(1), input_0=np.arange(4, dtype="float32"),
             output_shape_0=np.array([4], dtype="int64"), output_dtype_0=np.array("float32"))  # fmt: skip
    return buffer.getvalue()


@pytest.fixture
def marker_dir() -> Iterator[Path]:
    """Where a loaded library leaves its marker: a directory anyone may write in (the
    kernel process of an agent running as root is `nobody`)."""
    d = Path(tempfile.mkdtemp(prefix="tunefarm-marker-"))
    d.chmod(0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def farm_keys(tmp_path) -> tuple[ArtifactSigner, ArtifactSigner, Path]:
    """The farm's signer, another key's signer, and the farm's public key file."""
    ensure_key_pair(tmp_path / "farm.key", tmp_path / "farm.pub")
    ensure_key_pair(tmp_path / "other.key", tmp_path / "other.pub")
    return ArtifactSigner.from_file(tmp_path / "farm.key"), ArtifactSigner.from_file(tmp_path / "other.key"), tmp_path / "farm.pub"


def _run_agent_until(servicer: FalseLeaseService, settings: AgentSettings, done) -> list[BaseException]:
    """The real agent against `servicer` until `done()` (or AGENT_RUN_SECS); its errors."""
    stop = threading.Event()
    errors: list[BaseException] = []
    caps = {**capabilities.detect(probe=False), "emulated": False}

    def target() -> None:
        try:
            run_agent(settings, stop=stop, capabilities=caps)
        except Exception as exc:
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    deadline = time.monotonic() + AGENT_RUN_SECS
    try:
        while not done() and thread.is_alive():
            assert time.monotonic() < deadline, f"the agent sent {servicer.results} {servicer.model_runs}"
            time.sleep(0.1)
    finally:
        stop.set()
        thread.join(timeout=60)
    return errors


def _settings(address: str, work: Path, public_key: Path) -> AgentSettings:
    return AgentSettings(server=address, token="tfa_" + "x" * 40, device_class="false-class", name="victim",
                         work_dir=work, num_threads=1, reconnect_max_secs=0.5, rpc_timeout_secs=10.0,
                         lease_wait_secs=1.0, signing_public_key=public_key)  # fmt: skip


def _batch(candidates: list[pb.LeasedCandidate], task_data: pb.ArtifactRef) -> pb.LeaseBatchResponse:
    return pb.LeaseBatchResponse(batch=pb.LeasedBatch(
        lease_id=11, batch_id=3, attempt=1, candidates=candidates, task_data=task_data, n_inputs=1, n_outputs=1,
        verify=False, timing=wire.timing_to_pb(TimingConfig(repeat=1, min_repeat_ms=0.0)), run_timeout_secs=30.0,
        workload_name="false",
    ))  # fmt: skip


def test_a_false_server_cannot_make_the_agent_load_code_the_farm_did_not_sign(
    tmp_path, marker_dir, farm_keys, caplog
):
    farm, other, public_key = farm_keys
    caplog.set_level("INFO", logger="tunefarm.agent")
    kernels = {}  # candidate id -> (library bytes, signature, its marker)
    for bc_id, how in ((1, "unsigned"), (2, "other key"), (3, "another candidate's"), (4, "the farm's")):
        marker = marker_dir / f"kernel-{bc_id}"
        data = _shared_library(tmp_path / f"k{bc_id}.so", MARKER_SOURCE, MARKER=_c_string(str(marker)))
        sha = hashlib.sha256(data).hexdigest()
        signature = {
            "unsigned": b"",
            "other key": other.sign(SignedKind.KERNEL, bc_id, sha),
            "another candidate's": farm.sign(SignedKind.KERNEL, 99, sha),
            "the farm's": farm.sign(SignedKind.KERNEL, bc_id, sha),
        }[how]
        kernels[bc_id] = (data, signature, marker)
    library_marker = marker_dir / "model"
    library = _shared_library(tmp_path / "model.so", MARKER_SOURCE, MARKER=_c_string(str(library_marker)))
    task_data = _task_data()
    td_sha = hashlib.sha256(task_data).hexdigest()
    model_run = pb.LeasedModelRun(
        model_run_id=5, repeat=1, warmup=1, timeout_secs=30.0,
        library=pb.ArtifactRef(kind=pb.ARTIFACT_KIND_MODEL_LIBRARY, id=5, file_name="model.so",
                               signature=other.sign(SignedKind.MODEL_LIBRARY, 5, hashlib.sha256(library).hexdigest())),
        inputs=pb.ArtifactRef(kind=pb.ARTIFACT_KIND_MODEL_INPUTS, id=5, file_name="inputs.npz"),
    )  # fmt: skip
    candidates = [
        pb.LeasedCandidate(batch_candidate_id=bc_id, candidate_key=f"c{bc_id}",
                           kernel=pb.ArtifactRef(kind=pb.ARTIFACT_KIND_KERNEL, id=bc_id, file_name=f"k{bc_id}.so",
                                                 signature=signature))  # fmt: skip
        for bc_id, (_, signature, _) in kernels.items()
    ]
    files = {(pb.ARTIFACT_KIND_KERNEL, bc_id): data for bc_id, (data, _, _) in kernels.items()}
    files[(pb.ARTIFACT_KIND_TASK_DATA, 1)] = task_data
    files[(pb.ARTIFACT_KIND_MODEL_LIBRARY, 5)] = library
    files[(pb.ARTIFACT_KIND_MODEL_INPUTS, 5)] = task_data
    td_ref = pb.ArtifactRef(kind=pb.ARTIFACT_KIND_TASK_DATA, id=1, file_name=f"{td_sha}.npz", sha256=td_sha,
                            size=len(task_data))  # fmt: skip
    servicer = FalseLeaseService([pb.LeaseBatchResponse(model_run=model_run), _batch(candidates, td_ref)], files)
    server, address = _serve(servicer)
    try:
        errors = _run_agent_until(
            servicer, _settings(address, tmp_path / "work", public_key),
            lambda: len(servicer.results) == len(kernels) and servicer.model_runs,
        )
    finally:
        server.stop(0)
    assert errors == []
    for bc_id in (1, 2, 3):
        result = servicer.results[bc_id]
        assert result.error_kind == pb.ERROR_KIND_RUN_ERROR and "not loaded" in result.error_msg, result
        assert not kernels[bc_id][2].exists(), f"kernel {bc_id} was loaded"
    assert "not signed" in servicer.results[1].error_msg
    assert "does not verify" in servicer.results[2].error_msg and "does not verify" in servicer.results[3].error_msg
    assert kernels[4][2].exists()  # the one the farm signed was loaded (it has no kernel: a run error after)
    (model,) = servicer.model_runs
    assert "not loaded" in model.error and not library_marker.exists()
    # After registering, every call carried the secret the server handed out.
    assert servicer.lease_metadata and all(m.get(wire.AGENT_SECRET_HEADER) == SECRET for m in servicer.lease_metadata)
    assert any("loads only kernels and model libraries signed by the farm" in r.message for r in caplog.records)


@pytest.mark.slow
def test_a_false_server_cannot_make_the_agents_peers_parse_a_graph_the_farm_did_not_sign(tmp_path, farm_keys):
    """The ONNX graph a model run's peers are timed on is checked like code: one signed
    with another key is deleted unread; the model (signed by the farm) is still run and
    timed, and each peer reports why it was not."""
    pytest.importorskip("tvm")
    pytest.importorskip("onnxruntime")
    from onnx_models import tiny_onnx

    from tunefarm.models.build import build_model_library
    from tunefarm.models.finish import load_model, model_inputs
    from tunefarm.models.peers import ONNXRUNTIME

    farm, other, public_key = farm_keys
    onnx = tiny_onnx(tmp_path / "tiny.onnx")
    m = load_model(onnx, {"x": [1, 3, 8, 8]}, name="tiny")
    built = build_model_library(m.tasks.fused_mod, tmp_path / "tuned", target=host_target_dict(),
                                inputs=m.imported.inputs, outputs=m.imported.outputs)  # fmt: skip
    buffer = io.BytesIO()
    np.savez(buffer, *model_inputs(m).values())
    library, graph = built.library.read_bytes(), onnx.read_bytes()

    def ref(kind: int, name: str, data: bytes, signature: bytes = b"") -> pb.ArtifactRef:
        return pb.ArtifactRef(kind=kind, id=5, file_name=name, sha256=hashlib.sha256(data).hexdigest(), size=len(data),
                              signature=signature)  # fmt: skip

    model_run = pb.LeasedModelRun(
        model_run_id=5, repeat=4, warmup=1, timeout_secs=60.0, input_names=["x"],
        library=ref(pb.ARTIFACT_KIND_MODEL_LIBRARY, "model.so", library,
                    farm.sign(SignedKind.MODEL_LIBRARY, 5, hashlib.sha256(library).hexdigest())),
        inputs=ref(pb.ARTIFACT_KIND_MODEL_INPUTS, "inputs.npz", buffer.getvalue()),
        onnx_model=ref(pb.ARTIFACT_KIND_MODEL_ONNX, "model.onnx", graph,
                       other.sign(SignedKind.MODEL_ONNX, 5, hashlib.sha256(graph).hexdigest())),
    )  # fmt: skip
    files = {(pb.ARTIFACT_KIND_MODEL_LIBRARY, 5): library, (pb.ARTIFACT_KIND_MODEL_INPUTS, 5): buffer.getvalue(),
             (pb.ARTIFACT_KIND_MODEL_ONNX, 5): graph}  # fmt: skip
    servicer = FalseLeaseService([pb.LeaseBatchResponse(model_run=model_run)], files)
    server, address = _serve(servicer)
    try:
        errors = _run_agent_until(servicer, _settings(address, tmp_path / "work", public_key), lambda: servicer.model_runs)
    finally:
        server.stop(0)
    assert errors == []
    (ran,) = servicer.model_runs
    assert ran.error == "" and len(ran.latency_samples) == 4 and ran.outputs_npz  # the model ran, and was timed
    notes = {p.peer: p.error for p in ran.peers}
    assert not any(p.latency_samples for p in ran.peers)
    assert "not loaded" in notes[ONNXRUNTIME] and "does not verify" in notes[ONNXRUNTIME]


def test_a_false_server_cannot_make_the_agent_write_outside_its_work_directory(tmp_path, marker_dir, farm_keys):
    farm, _, public_key = farm_keys
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "x.npz").write_bytes(b"precious")  # what a climbing name would overwrite, even for a moment
    climb = "../" * 24 + str(outside).lstrip("/")  # from any depth: up to / and down to `outside`
    data = _shared_library(tmp_path / "k.so", MARKER_SOURCE, MARKER=_c_string(str(marker_dir / "kernel")))
    task_data = _task_data()
    kernel = pb.ArtifactRef(kind=pb.ARTIFACT_KIND_KERNEL, id=1, file_name=f"{climb}/evil.so",
                            signature=farm.sign(SignedKind.KERNEL, 1, hashlib.sha256(data).hexdigest()))  # fmt: skip
    td_ref = pb.ArtifactRef(kind=pb.ARTIFACT_KIND_TASK_DATA, id=1, file_name="x.npz", sha256=f"{climb}/x",
                            size=len(task_data))  # fmt: skip
    files = {(pb.ARTIFACT_KIND_KERNEL, 1): data, (pb.ARTIFACT_KIND_TASK_DATA, 1): task_data}
    candidates = [pb.LeasedCandidate(batch_candidate_id=1, candidate_key="c1", kernel=kernel)]
    servicer = FalseLeaseService([_batch(candidates, td_ref)], files)
    server, address = _serve(servicer)
    try:
        errors = _run_agent_until(servicer, _settings(address, tmp_path / "work", public_key),
                                  lambda: 1 in servicer.results)  # fmt: skip
    finally:
        server.stop(0)
    assert errors == []
    # Nothing landed there, nothing there was replaced (not even for a moment).
    assert {p.name: p.read_bytes() for p in outside.iterdir()} == {"x.npz": b"precious"}
    result = servicer.results[1]
    assert result.error_kind == pb.ERROR_KIND_RUN_ERROR and "task data unavailable: refused" in result.error_msg


def test_an_agent_told_it_is_leased_nothing_logs_why_keeps_heartbeating_and_asks_again(tmp_path, farm_keys, caplog):
    _, _, public_key = farm_keys
    beats: list[float] = []
    asks: list[float] = []
    reason = "flagged (2 result(s) below the timing floor)\x1b[2J"  # what a false server might put in it

    class Withholding(FalseLeaseService):
        """Leases nothing, saying why, until the agent has heartbeated twice meanwhile."""

        def Heartbeat(self, request, context):
            beats.append(time.monotonic())
            return super().Heartbeat(request, context)

        def LeaseBatch(self, request, context):
            if len(beats) < 2:
                asks.append(time.monotonic())
                return pb.LeaseBatchResponse(withheld=reason)
            return super().LeaseBatch(request, context)

    kernel = pb.ArtifactRef(kind=pb.ARTIFACT_KIND_KERNEL, id=1, file_name="k.so")
    td_ref = pb.ArtifactRef(kind=pb.ARTIFACT_KIND_TASK_DATA, id=1, file_name="x.npz", sha256="0" * 64, size=10)
    batch = _batch([pb.LeasedCandidate(batch_candidate_id=1, candidate_key="c1", kernel=kernel)], td_ref)
    servicer = Withholding([batch], {})
    server, address = _serve(servicer)
    caplog.set_level("INFO", logger="tunefarm")
    try:
        errors = _run_agent_until(servicer, _settings(address, tmp_path / "work", public_key),
                                  lambda: 1 in servicer.results)  # fmt: skip
    finally:
        server.stop(0)
    assert errors == []
    said = [r.getMessage() for r in caplog.records if "leases this agent nothing" in r.getMessage()]
    assert len(said) == 1 and "flagged (2 result(s) below the timing floor)\\x1b[2J" in said[0]  # once, escaped
    assert any("leases this agent work again" in r.getMessage() for r in caplog.records)
    # It asked again after each wait (1 s: its lease_wait_secs), not in a tight loop, and
    # heartbeated meanwhile (the server withheld work until it had).
    assert asks and all(later - earlier >= 0.9 for earlier, later in zip(asks, asks[1:]))
    assert len(beats) >= 2


def test_a_false_server_cannot_make_the_agent_download_more_than_the_lease_declared_or_its_limit(tmp_path, farm_keys):
    """Kernels that never end, one larger than declared, task data declared larger than
    the agent's limit: each refused (the stream cancelled at the first part over, never
    read to its end), as the errors of their candidates; the agent goes on."""
    _, _, public_key = farm_keys
    block = b"\0" * (64 << 10)
    requested: list[list[tuple[int, int]]] = []
    ended: list[int] = []

    class Flooding(FalseLeaseService):
        def Fetch(self, request, context):
            requested.append([(ref.kind, ref.id) for ref in request.refs])
            for i, ref in enumerate(request.refs):
                if ref.kind != pb.ARTIFACT_KIND_KERNEL:
                    yield from super().Fetch(pb.FetchRequest(refs=[ref]), context)
                    continue
                try:
                    offset = 0
                    while True:  # a kernel that never ends
                        yield pb.FetchChunk(parts=[pb.FilePart(index=i, offset=offset, data=block)])
                        offset += len(block)
                finally:
                    ended.append(ref.id)  # cancelled by the agent (or the test's end)

    task_data = _task_data()
    td_ok = pb.ArtifactRef(kind=pb.ARTIFACT_KIND_TASK_DATA, id=1, file_name="x.npz",
                           sha256=hashlib.sha256(task_data).hexdigest(), size=len(task_data))  # fmt: skip
    kernels = [pb.LeasedCandidate(batch_candidate_id=1, candidate_key="c1",
                                  kernel=pb.ArtifactRef(kind=pb.ARTIFACT_KIND_KERNEL, id=1, file_name="k.so")),
               pb.LeasedCandidate(batch_candidate_id=2, candidate_key="c2",
                                  kernel=pb.ArtifactRef(kind=pb.ARTIFACT_KIND_KERNEL, id=2, file_name="k.so", size=100))]  # fmt: skip
    first = _batch(kernels, td_ok)
    huge = pb.ArtifactRef(kind=pb.ARTIFACT_KIND_TASK_DATA, id=2, file_name="y.npz", sha256="1" * 64, size=2 << 30)
    second = _batch([pb.LeasedCandidate(batch_candidate_id=3, candidate_key="c3",
                                        kernel=pb.ArtifactRef(kind=pb.ARTIFACT_KIND_KERNEL, id=3, file_name="k.so",
                                                              size=10))], huge)  # fmt: skip
    second.batch.lease_id, second.batch.batch_id = 12, 4
    servicer = Flooding([first, second], {(pb.ARTIFACT_KIND_TASK_DATA, 1): task_data})
    server, address = _serve(servicer)
    settings = dataclasses.replace(_settings(address, tmp_path / "work", public_key), max_download_bytes=1 << 20)
    started = time.monotonic()
    try:
        errors = _run_agent_until(servicer, settings, lambda: {1, 2, 3} <= set(servicer.results))
    finally:
        server.stop(0)
    assert errors == []
    assert time.monotonic() - started < 60  # no stream was read to a deadline
    one, two, three = (servicer.results[i].error_msg for i in (1, 2, 3))
    assert one == "kernel unavailable: refused: more than 1048576 bytes, the agent's download limit " \
                  "(TUNEFARM_AGENT_MAX_DOWNLOAD_BYTES)"
    assert two == "kernel unavailable: refused: more than 100 bytes, the size the lease declared"
    assert three.startswith("task data unavailable: refused: 2147483648 bytes declared")
    assert sorted(ended) == [1, 2, 3]  # every endless stream was cancelled
    # Each refusal cancelled its stream and the rest was asked for again; the task data
    # declared too large was never asked for.
    task_data_ref = (pb.ARTIFACT_KIND_TASK_DATA, 1)
    kernel = pb.ARTIFACT_KIND_KERNEL
    assert requested == [[(kernel, 1), (kernel, 2), task_data_ref], [(kernel, 2), task_data_ref], [task_data_ref],
                         [(kernel, 3)]]  # fmt: skip
    assert not list((tmp_path / "work").rglob("*.part"))


# -- the agent's own refusals --------------------------------------------------------------------


def test_an_agent_refuses_plaintext_to_another_host(capsys, tmp_path, monkeypatch):
    token = "tfa_" + "x" * 40
    monkeypatch.setenv("TUNEFARM_AGENT_TOKEN", token)  # never on the command line
    with pytest.raises(BadRequest, match="refusing plaintext to 10.20.30.40:50051"):
        AgentSettings(server="10.20.30.40:50051", token=token, accept_unsigned_code=True)
    assert agent_main(["--server", "farm.example:50051", "--accept-unsigned-code"]) == 2
    out = capsys.readouterr().out.strip()
    assert "\n" not in out and "refusing plaintext to farm.example:50051" in out and "--insecure-plaintext" in out
    for local in ("127.0.0.1:1", "localhost:1", "[::1]:1"):
        AgentSettings(server=local, token=token, accept_unsigned_code=True)
    told = AgentSettings.from_env({"TUNEFARM_AGENT_SERVER": "farm.example:50051", "TUNEFARM_AGENT_TOKEN": token,
                                   "TUNEFARM_AGENT_INSECURE_PLAINTEXT": "1",
                                   "TUNEFARM_AGENT_ACCEPT_UNSIGNED_CODE": "1"})  # fmt: skip
    assert told.insecure_plaintext and not told.uses_tls


def test_an_agent_without_the_farms_public_key_does_not_start(capsys, tmp_path, monkeypatch):
    token = "tfa_" + "x" * 40
    monkeypatch.setenv("TUNEFARM_AGENT_TOKEN", token)  # never on the command line
    with pytest.raises(BadRequest, match="no signing public key"):
        AgentSettings(server="127.0.0.1:1", token=token)
    assert agent_main(["--server", "127.0.0.1:1", "--work-dir", str(tmp_path)]) == 2
    out = capsys.readouterr().out.strip()
    assert "\n" not in out and "no signing public key" in out and "--accept-unsigned-code" in out
    garbage = tmp_path / "farm.pub"
    garbage.write_text("not a key")
    argv = ["--server", "127.0.0.1:1", "--work-dir", str(tmp_path), "--signing-public-key", str(garbage)]
    assert agent_main(argv) == 2
    out = capsys.readouterr().out.strip()
    assert "\n" not in out and "not a PEM public key" in out


# -- the kernel sandbox ----------------------------------------------------------------------------


PROBE_SOURCE = r"""
#include <arpa/inet.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>
__attribute__((constructor)) static void probe(void) {
    struct sockaddr_un local;
    memset(&local, 0, sizeof local);
    local.sun_family = AF_UNIX;
    strncpy(local.sun_path, UNIX_PATH, sizeof local.sun_path - 1);
    int u = socket(AF_UNIX, SOCK_STREAM, 0);
    int unix_rc = u < 0 ? -1 : connect(u, (struct sockaddr *)&local, sizeof local);
    struct sockaddr_in addr;
    memset(&addr, 0, sizeof addr);
    addr.sin_family = AF_INET;
    addr.sin_port = htons(PORT);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int s = socket(AF_INET, SOCK_STREAM, 0);
    int rc = s < 0 ? -1 : connect(s, (struct sockaddr *)&addr, sizeof addr);
    FILE *f = fopen(REPORT, "w");
    if (f) {
        fprintf(f, "{\"uid\": %d, \"connected\": %s, \"token\": %s, \"unix\": %s}\n", (int)getuid(),
                rc == 0 ? "true" : "false", getenv("TUNEFARM_AGENT_TOKEN") ? "true" : "false",
                unix_rc == 0 ? "true" : "false");
        fclose(f);
    }
}
"""
"""A library that reports, when loaded, its user, whether it reached 127.0.0.1:PORT and
the unix socket UNIX_PATH (a host's database listens on one), and whether it sees the
agent's token."""


def _probe(runner: LocalRunner, tmp: Path, port: int, unix_path: Path) -> dict:
    report = tmp / f"report-{uuid.uuid4().hex[:6]}.json"
    library = tmp / f"probe-{uuid.uuid4().hex[:6]}.so"
    _shared_library(library, PROBE_SOURCE, PORT=str(port), REPORT=_c_string(str(report)),
                    UNIX_PATH=_c_string(str(unix_path)))  # fmt: skip
    # readable by nobody whatever this process's umask (an in-process `tunefarm` service
    # command of an earlier test sets 077)
    library.chmod(0o755)
    (tmp / "td.npz").write_bytes(_task_data())
    (tmp / "td.npz").chmod(0o644)
    inp = RunInput("probe", str(library), str(tmp / "td.npz"), 1, 1, verify=False, timing=TimingConfig(repeat=1),
                   timeout_secs=60.0)  # fmt: skip
    (result,) = runner.run([inp])
    assert result.error_kind is ErrorKind.RUN_ERROR  # it is no kernel: its constructor ran, then no "main"
    return json.loads(report.read_text())


@pytest.mark.skipif(os.geteuid() != 0, reason="the kernel process changes its user only when the agent runs as root")
def test_the_kernel_process_of_a_root_agent_runs_as_nobody_without_network(monkeypatch):
    _compiler()
    monkeypatch.setenv("TUNEFARM_AGENT_TOKEN", "tfa_" + "s" * 40)
    tmp = Path(tempfile.mkdtemp(prefix="tunefarm-sandbox-"))  # reachable by nobody
    tmp.chmod(0o1777)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    unix_path = tmp / "db.sock"  # like PostgreSQL's: reached through the file system, not the network
    local = socket.socket(socket.AF_UNIX)
    local.bind(str(unix_path))
    local.listen(8)
    unix_path.chmod(0o777)
    try:
        with LocalRunner(1) as plain:  # the control: the same probe, unconfined, sees it all
            assert _probe(plain, tmp, port, unix_path) == {"uid": 0, "connected": True, "token": True, "unix": True}
        with LocalRunner(1, sandbox=Sandbox()) as confined:
            confined.start()
            status = confined.sandbox_status
            assert status is not None and status.uid != 0 and status.own_network, status
            assert status.hidden_sockets >= 1, status
            assert "nobody" in status.describe() and "no network" in status.describe()
            assert _probe(confined, tmp, port, unix_path) == {"uid": status.uid, "connected": False, "token": False,
                                                               "unix": False}  # fmt: skip
    finally:
        listener.close()
        local.close()
        shutil.rmtree(tmp, ignore_errors=True)


# -- the operator's key pair -----------------------------------------------------------------


def test_the_operator_makes_the_farms_signing_key_pair(tmp_path, capsys):
    from services.protocol.signing import ArtifactVerifier, BadSignature
    from tunefarm_app.cli import main

    private, public = tmp_path / "keys" / "farm-signing.key", tmp_path / "keys" / "farm-signing.pub"
    argv = ["farm", "signing-key", "--private-key", str(private), "--public-key", str(public)]
    assert main(argv) == 0 and "made" in capsys.readouterr().out
    assert private.stat().st_mode & 0o777 == 0o600
    first = private.read_bytes()
    assert main(argv) == 0 and "kept" in capsys.readouterr().out  # run again: the same key
    assert private.read_bytes() == first
    sha = hashlib.sha256(b"a kernel").hexdigest()
    signature = ArtifactSigner.from_file(private).sign(SignedKind.KERNEL, 12, sha)
    verifier = ArtifactVerifier.from_file(public)
    verifier.verify(SignedKind.KERNEL, 12, sha, signature)
    for kind, bc_id, digest in ((SignedKind.KERNEL, 13, sha), (SignedKind.MODEL_LIBRARY, 12, sha),
                                (SignedKind.KERNEL, 12, hashlib.sha256(b"another").hexdigest())):  # fmt: skip
        with pytest.raises(BadSignature):  # bound to the file, its kind and its id
            verifier.verify(kind, bc_id, digest, signature)
    private.write_text("not a key")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "not a PEM private key" in err
