"""The whole farm, every process on loopback, against the real PostgreSQL and Redis:
`farm up` (api, lease service, scheduler, two RQ build workers, one CPU agent) in a
throw-away database with its own Redis queue prefix; then, over REST:

- the whole path: upload a tiny ONNX model -> job -> scheduler -> RQ -> worker -> lease
  -> agent -> Postgres -> progress -> an artifact whose output matches onnxruntime, its
  latency and onnxruntime's measured side by side by the agent (a model run), none by
  the scheduler, though the class is of the scheduler host's own architecture;
- a model's 3x3 convolutions are tuned beside their Winograd alternatives, and the tuned
  model takes the fastest confirmed program of each;
- a second job on the same device class starts from the shared cost model (its first
  batch is ranked by a trained model);
- the scheduler killed (SIGKILL) in the middle of a job and started again: the job
  finishes and no measurement is repeated;
- a running job cancelled over REST stops, its open batches given up;
- a team token on the agent service is refused.

The tests share one farm and run in order (about two minutes on 2 cores).
"""

from __future__ import annotations

import json
import signal
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("onnxruntime")
pytest.importorskip("grpc")
pytest.importorskip("rq")

from farm_fixtures import running_farm, team_client, wait_for_job  # noqa: E402
from onnx_models import tiny_onnx  # noqa: E402
from sqlalchemy import func, select  # noqa: E402

from services.db.models import BatchCandidate, CostModelVersion, Measurement  # noqa: E402
from services.db.session import transaction  # noqa: E402
from tunefarm.models.check import compare_outputs  # noqa: E402
from tunefarm.models.finish import extract_archive  # noqa: E402
from tunefarm.models.importer import random_inputs, run_onnxruntime  # noqa: E402
from tunefarm.models.runtime import run_model  # noqa: E402
from tunefarm.records import MeasureRecord  # noqa: E402
from tunefarm_app.cli import main as cli  # noqa: E402
from tunefarm_app.farm_client import FarmClient  # noqa: E402
from tunefarm_app.farm_local import LocalFarm, read_state  # noqa: E402

pytestmark = pytest.mark.slow

JOB_TIMEOUT = 240.0


@pytest.fixture(scope="module")
def farm(database_url, tmp_path_factory):
    with running_farm(
        state_dir=tmp_path_factory.mktemp("farm"),
        database_url=database_url,
        workers=2,
        extra_env={
            "TUNEFARM_COST_MODEL_WARMUP": "8",  # the tiny jobs' few measurements train the shared model
            "TUNEFARM_POLL_INTERVAL_SECS": "0.1",
        },
    ) as running:
        yield running


@pytest.fixture(scope="module")
def client(farm: LocalFarm):
    with team_client(farm) as c:
        yield c


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return tiny_onnx(tmp_path_factory.mktemp("model") / "tiny.onnx")


def wait_for(client: FarmClient, job_id: int, done=lambda j: j["state"] in ("succeeded", "failed", "cancelled"),
             timeout: float = JOB_TIMEOUT) -> dict:
    return wait_for_job(client, job_id, done, timeout)


def measured_twice(sessions_url: str, job_id: int) -> list[str]:
    from services.db.session import make_session_factory

    sessions = make_session_factory(sessions_url)
    try:
        with transaction(sessions) as s:
            keys = s.execute(
                select(Measurement.job_task_id, Measurement.candidate_key).where(Measurement.job_id == job_id)
            ).all()
    finally:
        sessions.kw["bind"].dispose()
    counts = Counter(keys)
    return [k for (_, k), n in counts.items() if n > 1]


def batch_timings(database_url: str, job_id: int) -> list[dict]:
    """How the job's batches asked agents to time their kernels (`TimingConfig` as stored)."""
    from services.db.models import Batch
    from services.db.session import make_session_factory

    sessions = make_session_factory(database_url)
    try:
        with transaction(sessions) as s:
            return list(s.scalars(select(Batch.timing).where(Batch.job_id == job_id)))
    finally:
        sessions.kw["bind"].dispose()


def child_pids(pid: int) -> list[int]:
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]


def loads_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def agent_timings(database_url: str, job_id: int) -> dict[str, list[float]]:
    """The samples the agent reported for the job's timed model run: the model's and each
    peer's, as stored by the lease service."""
    from services.db.models import ModelRun
    from services.db.session import make_session_factory

    sessions = make_session_factory(database_url)
    try:
        with transaction(sessions) as s:
            run = s.scalars(
                select(ModelRun).where(ModelRun.job_id == job_id, ModelRun.peer_latencies.is_not(None))
            ).one()
            peers = {p: v["latency_samples"] for p, v in run.peer_latencies.items() if "latency_samples" in v}
            return {"model": run.result["latency_samples"], **peers}
    finally:
        sessions.kw["bind"].dispose()


def test_farm_up_wrote_farm_json(farm):
    info = read_state(farm.config.state_dir)
    for key in ("api_url", "grpc_address", "team_token", "agent_token"):
        assert info[key]
    assert info["team_token"].startswith("tft_") and info["agent_token"].startswith("tfa_")
    assert set(info["processes"]) == {"redis", "api", "lease-service", "scheduler", "worker-1", "worker-2", "agent"}
    assert oct((farm.config.state_dir / "farm.json").stat().st_mode & 0o777) == "0o600"


def test_the_clients_find_the_farm_by_its_state_dir(farm, monkeypatch, capsys):
    """Nothing copied by hand: TUNEFARM_STATE_DIR (the line `farm up` prints) gives the
    team's commands the API and the token, and the operator's the database."""
    from tunefarm_app.cli import main

    for var in ("TUNEFARM_TOKEN", "TUNEFARM_SERVER", "TUNEFARM_DATABASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TUNEFARM_STATE_DIR", str(farm.config.state_dir))
    assert main(["devices"]) == 0
    assert f"class      {farm.info['device_class']}" in capsys.readouterr().out
    assert main(["farm", "token", "list", "--kind", "agent"]) == 0
    assert "agents" in capsys.readouterr().out


def test_the_whole_path(farm, client, tiny, tmp_path, capsys):
    info = farm.info
    model = client.upload_model(tiny, {"x": [1, 3, 8, 8]})
    assert len(model["tasks"]) == 4  # two convolutions, and the input to NHWC and back
    # the model's own tasks: its convolutions' Winograd alternatives are the next test's
    job = client.create_job(model_id=model["id"], device_class=info["device_class"], trial_budget=8, winograd=False)
    seen_running = wait_for(client, job["id"], lambda j: j["trials_used"] > 0 or j["state"] != "queued")
    assert seen_running["state"] in ("running", "finishing", "succeeded")
    job = wait_for(client, job["id"])
    assert job["state"] == "succeeded", job["error"]
    assert job["trials_used"] == 8 and sum(t["trials"] for t in job["tasks"]) == 8
    assert all(t["best_secs"] and t["best_secs"] > 0 for t in job["tasks"])
    assert job["est_latency_secs"] and job["est_latency_start_secs"] >= job["est_latency_secs"] * 0.999
    assert job["curve"] and job["curve"][-1]["trials"] == 8
    assert job["artifact"]["available"] and job["result"]["check"]["ok"]

    # the archive: the same files as `tunefarm tune --out`, and a model matching onnxruntime
    out = tmp_path / "tuned"
    files = extract_archive(client.artifact(job["id"]), out)
    assert {f.name for f in files} == {"model.so", "manifest.json", "records.jsonl", "report.json", "reference.onnx"}
    feeds = random_inputs({"x": (1, 3, 8, 8)}, {"x": "float32"}, seed=7)
    got = run_model(out, feeds, repeat=0).outputs
    want = run_onnxruntime(tiny.read_bytes(), feeds)
    assert all(e.ok for e in compare_outputs(got, want, input_kind="normal"))
    report = json.loads((out / "report.json").read_text())
    assert report["trials"] == 8 and report["models"][0]["check"]["ok"]
    assert {t["schedule"] for t in report["models"][0]["tasks"]} == {"tuned"}

    # the records: the records file format, one line per measurement, no candidate twice
    lines = list(client.records(job["id"]))
    assert len(lines) == 8 == len((out / "records.jsonl").read_text().splitlines())
    records = [MeasureRecord.from_json(line) for line in lines]
    assert len({(r.task, r.candidate.key) for r in records}) == 8
    assert measured_twice(farm.config.database_url, job["id"]) == []
    # timed as the scheduler's settings say (TEST_FARM_ENV: two repeats of at least 5 ms)
    timings = batch_timings(farm.config.database_url, job["id"])
    assert timings and {(t["repeat"], t["min_repeat_ms"]) for t in timings} == {(2, 5.0)}
    assert all(len(r.costs) <= 2 for r in records) and any(len(r.costs) == 2 for r in records)

    devices = client.devices()
    agent = next(d for d in devices if d["device_class"] == info["device_class"])
    assert agent["measurements_done"] >= 8 and agent["state"] in ("idle", "busy")

    # the headline is the agent's measurement, onnxruntime's beside it on the same agent
    result = job["result"]
    assert result["measured_on"]["agent"] == agent["name"] and result["measured_on"]["emulated"] is False
    timed = agent_timings(farm.config.database_url, job["id"])
    assert result["latency"]["runs"] == len(timed["model"])
    assert result["latency"]["median"] == pytest.approx(np.median(timed["model"]))
    ort = result["onnxruntime_latency"]
    assert ort["runs"] == len(timed["onnxruntime"]) == len(timed["model"])
    assert ort["median"] == pytest.approx(np.median(timed["onnxruntime"]))
    assert ort["threads"] == result["latency"]["threads"] and len(ort["round_medians"]) == len(result["latency"]["round_medians"])
    assert report["models"][0]["onnxruntime_latency"] == ort
    scheduler_log = Path(farm.processes["scheduler"].log).read_text()
    assert f"job {job['id']}: tiny: timed on {agent['name']}: p50" in scheduler_log
    # the API's model importer runs TVM's code only: it did not load torch (tvm_ffi imports
    # it whenever it is installed; `WITHOUT_TORCH`)
    importers = child_pids(farm.processes["api"].pid)
    assert importers and not any(loads_torch(pid) for pid in importers)
    # nor did the scheduler, which ran the job's search with TVM (`block_imports`)
    assert not loads_torch(farm.processes["scheduler"].pid)
    assert f"job {job['id']}: tiny: building the tuned model" not in scheduler_log  # finish_model: the scheduler timing it

    # the same through the command line
    token_file = tmp_path / "team-token"
    token_file.write_text(info["team_token"] + "\n")
    argv = ["--server", info["api_url"], "--token-file", str(token_file)]
    assert cli(["status", str(job["id"]), *argv]) == 0
    assert "succeeded" in capsys.readouterr().out
    assert cli(["fetch", str(job["id"]), "--out", str(tmp_path / "cli"), *argv]) == 0
    assert (tmp_path / "cli" / "model.so").is_file()
    assert cli(["cancel", str(job["id"]), *argv]) == 2  # finished: a one-line error
    assert "already succeeded" in capsys.readouterr().err
    assert cli(["report", str(tmp_path / "cli"), "--html"]) == 0  # the farm's report reads like tune's
    assert "matches onnxruntime" in capsys.readouterr().out
    assert 'class="curve"' in (tmp_path / "cli" / "report.html").read_text()


def test_a_models_convolutions_are_tuned_beside_their_winograd_alternatives(farm, client, tmp_path):
    """On a CPU class each 3x3 convolution task is also tuned by Winograd F(2,3) and F(4,3):
    job task rows of their own (alternatives of the task, after the model's), shown within
    their task's row; the tuned model takes each task's fastest confirmed program and
    passes its check; the report says which."""
    pytest.importorskip("torch")
    from services.db.models import JobTask
    from services.db.session import make_session_factory
    from tunefarm.models import examples

    onnx_path = examples.export_example("conv_bn_relu", tmp_path / "cbr.onnx")
    model = client.upload_model(onnx_path, {"x": [1, 3, 16, 16]}, name="cbr")
    assert len(model["tasks"]) == 4  # the model's tasks only: two convolutions and the transposes
    # 8 rounds of 2 (rounds_with_alternatives(16, 4 + 4)): each task and each alternative warms up once
    job = client.create_job(model_id=model["id"], device_class=farm.info["device_class"], trial_budget=16, seed=4)
    job = wait_for(client, job["id"])
    assert job["state"] == "succeeded", job["error"]
    assert job["result"]["check"]["ok"] and job["trials_used"] == 16 == sum(t["trials"] for t in job["tasks"])
    convs = [t for t in job["tasks"] if t["alternatives"]]
    assert len(job["tasks"]) == 4 and len(convs) == 2
    for t in convs:
        assert [a["algorithm"] for a in t["alternatives"]] == ["direct", "winograd2", "winograd4"]
        assert t["alternatives"][0]["position"] == t["position"] and all(a["trials"] > 0 for a in t["alternatives"])
        assert t["trials"] == sum(a["trials"] for a in t["alternatives"])
        best = min(a["best_secs"] for a in t["alternatives"] if a["best_secs"] is not None)
        assert t["best_secs"] == best and t["algorithm"] in ("direct", "winograd2", "winograd4")

    out = tmp_path / "tuned"
    extract_archive(client.artifact(job["id"]), out)
    report = json.loads((out / "report.json").read_text())
    assert report["algorithms"] == ["winograd"]
    rows = report["models"][0]["tasks"]
    assert len(rows) == 4 and report["models"][0]["check"]["ok"]
    for row in (r for r in rows if r["alternatives"]):
        assert [a["algorithm"] for a in row["alternatives"]] == ["direct", "winograd2", "winograd4"]
        (chosen,) = [a for a in row["alternatives"] if a["chosen"]]  # the fastest confirmed program
        assert chosen["algorithm"] == row["algorithm"] and chosen["best_seconds"] == row["best_seconds"]
    assert sum(1 for r in rows if r["alternatives"]) == 2
    assert {r["algorithm"] for r in rows if not r["alternatives"]} == {"direct"}

    sessions = make_session_factory(farm.config.database_url)
    try:
        with transaction(sessions) as s:
            alternatives = s.scalars(
                select(JobTask.position).where(JobTask.job_id == job["id"], JobTask.alternative_of.is_not(None))
            ).all()
    finally:
        sessions.kw["bind"].dispose()
    assert sorted(alternatives) == [4, 5, 6, 7]  # after the model's tasks
    log = Path(farm.processes["scheduler"].log).read_text()
    assert f"job {job['id']}: 4 tasks of cbr on {farm.info['device_class']} and 4 Winograd alternatives" in log


def test_a_second_job_starts_from_the_shared_model(farm, client, tiny):
    from services.db.session import make_session_factory

    info = farm.info
    model = client.upload_model(tiny, {"x": [1, 3, 8, 8]}, name="tiny-again")
    # the model's own tasks (4 rounds of 2): what this job shows is where its search starts
    job = client.create_job(model_id=model["id"], device_class=info["device_class"], trial_budget=8, seed=2,
                            winograd=False)  # fmt: skip
    job = wait_for(client, job["id"])
    assert job["state"] == "succeeded", job["error"]
    cm = job["cost_model"]
    assert cm["version_id"] is not None and cm["trained_on"] >= 8  # started from the version job 1 left
    assert cm["trained_on_at_first_batch"] and cm["trained_on_at_first_batch"] >= 8  # ranked by a trained model
    sessions = make_session_factory(farm.config.database_url)
    deadline = time.monotonic() + 30  # the scheduler saves a version right after a job ends
    try:
        while True:
            with transaction(sessions) as s:
                versions = s.scalars(select(CostModelVersion.version).order_by(CostModelVersion.version)).all()
            if len(versions) >= 2 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    finally:
        sessions.kw["bind"].dispose()
    assert versions[:2] == [1, 2]  # one more version after each job


def test_the_scheduler_restarts_in_the_middle_of_a_job(farm, client, tiny):
    info = farm.info
    model = client.upload_model(tiny, {"x": [1, 3, 8, 8]}, name="tiny-restart")
    # the model's own tasks (Winograd alternatives, slow to build, are the test above's)
    job = client.create_job(model_id=model["id"], device_class=info["device_class"], trial_budget=12, seed=3,
                            winograd=False)  # fmt: skip
    mid = wait_for(client, job["id"], lambda j: j["trials_used"] >= 4 or j["state"] not in ("queued", "running"))
    assert mid["state"] == "running" and mid["trials_used"] < 12, mid
    farm.stop("scheduler", sig=signal.SIGKILL)
    stopped_at = client.job(job["id"])["trials_used"]
    farm.start("scheduler")
    job = wait_for(client, job["id"])
    assert job["state"] == "succeeded", job["error"]
    assert job["trials_used"] == 12 and stopped_at < 12
    assert measured_twice(farm.config.database_url, job["id"]) == []
    from services.db.session import make_session_factory

    sessions = make_session_factory(farm.config.database_url)
    try:
        with transaction(sessions) as s:
            n = s.scalar(select(func.count()).select_from(Measurement).where(Measurement.job_id == job["id"]))
            proposed = s.scalar(
                select(func.count(func.distinct(BatchCandidate.candidate_key)))
                .join(Measurement, Measurement.batch_candidate_id == BatchCandidate.id)
                .where(Measurement.job_id == job["id"])
            )
    finally:
        sessions.kw["bind"].dispose()
    assert n == proposed == 12
    log = Path(farm.processes["scheduler"].log).read_text()
    assert f"job {job['id']}: resuming" in log


def test_a_running_job_is_cancelled(farm, client, tiny):
    from services.db.models import Batch
    from services.db.session import make_session_factory
    from services.db.states import BatchState

    model = client.upload_model(tiny, {"x": [1, 3, 8, 8]}, name="tiny-cancel")
    # far more than it can do before the cancel lands; small batches, so that the build a
    # worker is doing when it is cancelled (finished before farm down stops it) is short
    job = client.create_job(model_id=model["id"], device_class=farm.info["device_class"], trial_budget=100)
    wait_for(client, job["id"], lambda j: j["state"] == "running", timeout=240)
    asked = client.cancel(job["id"])
    assert asked["cancel_requested"] and asked["state"] in ("running", "cancelled")
    job = wait_for(client, job["id"], timeout=240)
    assert job["state"] == "cancelled" and job["finished_at"] and job["trials_used"] < 100
    sessions = make_session_factory(farm.config.database_url)
    try:
        with transaction(sessions) as s:
            states = set(s.scalars(select(Batch.state).where(Batch.job_id == job["id"])))
    finally:
        sessions.kw["bind"].dispose()
    assert states <= {BatchState.DONE, BatchState.FAILED}  # nothing left for the workers and agents


def test_a_team_token_is_refused_by_the_agent_service(farm):
    import grpc

    from services.protocol.generated import measurer_pb2 as pb
    from services.protocol.generated import measurer_pb2_grpc as pb_grpc

    with grpc.insecure_channel(farm.info["grpc_address"]) as channel:
        stub = pb_grpc.AgentServiceStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            stub.Heartbeat(pb.HeartbeatRequest(agent_id=1), metadata=[("authorization", f"Bearer {farm.info['team_token']}")],
                           timeout=10)
    assert raised.value.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
