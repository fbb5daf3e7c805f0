"""The farm tunes a model for a CUDA device class (sm_90) on a machine without a GPU,
every process on loopback against the real PostgreSQL and Redis (`farm up`):

    upload an ONNX model of a convolution, a matmul, layer norm and softmax -> a job on
    the CUDA class (no 422) -> its tasks searched with the GPU sketch rules -> the build
    workers build `.cuda.tar` kernels (nvcc, sm_90 fatbins) -> the class's agent (the
    real agent claiming an H100, `claimed_gpu_agent.py`) leases and fetches them, and its
    runner fails each (no GPU here): run errors -> the search ends with no valid kernel
    and the model is built with TVM's default GPU schedules (`model.cuda.tar`, an sm_90
    fatbin) -> the agent is gone before the model check: the job succeeds unchecked and
    says why, without waiting out TUNEFARM_MODEL_RUN_WAIT_SECS.

Then the model check with the agent back: it fetches the `.cuda.tar` model library (its
name and signature accepted), its runner fails it (no GPU), and the failure names the
agent's GPU.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("onnxruntime")
pytest.importorskip("grpc")
pytest.importorskip("rq")

from claimed_gpu_agent import CLAIMED  # noqa: E402
from farm_fixtures import running_farm, team_client, wait_for_job  # noqa: E402
from onnx_models import gpu_mix_onnx  # noqa: E402
from sqlalchemy import select  # noqa: E402

from services.db.models import DeviceClass, ModelRun  # noqa: E402
from services.db.session import make_session_factory, transaction  # noqa: E402
from services.db.states import ModelRunState  # noqa: E402
from tunefarm import cuda  # noqa: E402
from tunefarm.models.build import CUDA_LIBRARY_NAME, LIBRARY_NAME  # noqa: E402
from tunefarm.models.finish import extract_archive  # noqa: E402
from tunefarm.records import ErrorKind, MeasureRecord  # noqa: E402
from tunefarm_app.farm_local import LocalFarm  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(cuda.nvcc_path() is None, reason="nvcc (the CUDA toolkit) is not installed"),
]

CLASS = "cuda-sm_90-test"
TARGET = {"kind": "cuda", "arch": "sm_90", "max_threads_per_block": 1024, "thread_warp_size": 32}
TRIALS = 12  # two candidates per task
FRESH_SECS = 3.0  # an agent silent this long is gone (and the model check stops waiting for one)
FATBIN_MAGIC = bytes.fromhex("50ed55ba")  # 0xBA55ED50, little-endian
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def farm(database_url, tmp_path_factory):
    with running_farm(
        state_dir=tmp_path_factory.mktemp("cudafarm"),
        database_url=database_url,
        workers=1,
        device_class=CLASS,
        target=TARGET,
        agent_command=[sys.executable, str(ROOT / "tests" / "claimed_gpu_agent.py")],
        extra_env={
            "TUNEFARM_POLL_INTERVAL_SECS": "0.1",
            "TUNEFARM_AGENT_FRESH_SECS": str(FRESH_SECS),
            "TUNEFARM_HEARTBEAT_INTERVAL_SECS": "0.5",
            "TUNEFARM_CONFIRM_WAIT_SECS": "5",
        },
    ) as running:
        yield running


@pytest.fixture(scope="module")
def client(farm: LocalFarm):
    with team_client(farm) as c:
        yield c


def fatbin_archs(fatbin: bytes, tmp_path: Path) -> str:
    """What the fatbin says of its architectures: cuobjdump's ELF list when the toolkit
    has it, else the fatbin itself (its embedded names)."""
    assert fatbin[:4] == FATBIN_MAGIC
    tool = shutil.which("cuobjdump")
    if tool is None:
        return fatbin.decode("latin-1")
    path = tmp_path / "kernel.fatbin"
    path.write_bytes(fatbin)
    listed = subprocess.run([tool, "--list-elf", str(path)], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    return listed.stdout


@pytest.fixture(scope="module")
def cuda_job(farm, client, tmp_path_factory) -> dict:
    """A job on the CUDA class, its agent killed once the search is over: the model
    check finds no agent of the class."""
    (agent,) = [d for d in client.devices() if d["device_class"] == CLASS]
    assert agent["capabilities"]["gpu_name"] == CLAIMED["gpu_name"]
    assert json.loads(agent["capabilities"]["target_json"])["arch"] == "sm_90"
    onnx_path = gpu_mix_onnx(tmp_path_factory.mktemp("model") / "mix.onnx")
    model = client.upload_model(onnx_path, {"x": [1, 3, 8, 8]})
    job = client.create_job(model_id=model["id"], device_class=CLASS, trial_budget=TRIALS)
    names = {t["name"].split("(")[0] for t in job["tasks"]}
    assert {"fused_conv2d_relu", "matmul", "layer_norm", "softmax"} <= names
    # once the candidates are measured (the lease service counts them before the job
    # finishes), the agent dies: the model is built within seconds, and queued for nobody
    job = wait_for_job(
        client, job["id"], lambda j: j["trials_used"] >= TRIALS or j["state"] not in ("queued", "running")
    )
    farm.stop("agent", sig=signal.SIGKILL)
    return wait_for_job(client, job["id"], timeout=180.0)


def test_a_model_is_tuned_for_a_cuda_class_without_a_gpu_and_built_with_default_schedules(
    farm, client, cuda_job, tmp_path
):
    job = cuda_job
    assert job["state"] == "succeeded", job["error"]
    # the search: every candidate was built for sm_90 and failed on the agent (no GPU here)
    records = [MeasureRecord.from_json(line) for line in client.records(job["id"])]
    assert records and all(not r.is_valid for r in records)
    run_errors = [r for r in records if r.error_kind is ErrorKind.RUN_ERROR]
    assert run_errors and all("no CUDA GPU" in r.error_msg for r in run_errors)
    kernels = list((Path(farm.info["artifact_root"]) / "kernels").rglob(f"*{cuda.CUDA_KERNEL_SUFFIX}"))
    assert kernels and all(cuda.read_manifest(k)["arch"] == "sm_90" for k in kernels)

    # the tuned model: every task on TVM's default GPU schedule, unchecked, and why
    result = job["result"]
    assert result["tuned_tasks"] == 0 and result["tasks"] == len(job["tasks"])
    assert result["check"]["ok"] is None
    assert f"no agent of {CLASS} is online" in result["check"]["problem"]
    assert result["latency"] is None and result["measured_on"]["device_class"] == CLASS

    # the artifact: model.cuda.tar with an sm_90 fatbin, and its manifest says so
    out = tmp_path / "tuned"
    extract_archive(client.artifact(job["id"]), out)
    assert (out / CUDA_LIBRARY_NAME).is_file() and not (out / LIBRARY_NAME).exists()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["library"] == CUDA_LIBRARY_NAME and manifest["target"]["arch"] == "sm_90"
    with tarfile.open(out / CUDA_LIBRARY_NAME) as tar:
        assert sorted(tar.getnames()) == ["kernel.cu", "kernel.fatbin", "kernel.so", "manifest.json"]
        fatbin = tar.extractfile("kernel.fatbin").read()
    assert "sm_90" in fatbin_archs(fatbin, tmp_path)
    report = json.loads((out / "report.json").read_text())
    assert all(t["schedule"].startswith("default") for t in report["models"][0]["tasks"])

    # the run nobody took is not left for an agent that comes later
    sessions = make_session_factory(farm.config.database_url)
    try:
        with transaction(sessions) as s:
            runs = s.scalars(select(ModelRun).where(ModelRun.job_id == job["id"])).all()
            assert runs and all(r.state is ModelRunState.FAILED for r in runs)
    finally:
        sessions.kw["bind"].dispose()


def test_the_gpu_agent_fetches_the_cuda_model_library_and_its_failure_names_the_gpu(farm, cuda_job, tmp_path):
    """The model check's other half: the agent takes the `.cuda.tar` library (its name
    and the farm's signature accepted), its runner tries to load it on the GPU it claims,
    and the job's failure names the agent and the GPU."""
    from services.protocol.signing import ArtifactSigner
    from services.scheduler.exceptions import JobFailed
    from services.scheduler.model_check import DeviceRun, check_on_device
    from tunefarm.models.build import build_model_library
    from tunefarm.models.finish import load_model
    from tunefarm_app.farm_local import SIGNING_DIR, SIGNING_KEY

    job_id = cuda_job["id"]  # (a model run belongs to a job)
    m = load_model(gpu_mix_onnx(tmp_path / "mix.onnx"), {"x": [1, 3, 8, 8]}, name="mix")
    built = build_model_library(
        m.tasks.fused_mod,
        tmp_path / "tuned",
        target=TARGET,
        inputs=m.imported.inputs,
        outputs=m.imported.outputs,
    )
    assert built.library.name == CUDA_LIBRARY_NAME
    farm.start("agent")
    sessions = make_session_factory(farm.config.database_url)
    try:
        with transaction(sessions) as s:
            class_id = s.scalar(select(DeviceClass.id).where(DeviceClass.name == CLASS))
        where = DeviceRun(
            sessions, Path(farm.info["artifact_root"]), job_id=job_id, device_class_id=class_id, device_class=CLASS,
            wait_secs=120.0, stop=threading.Event(), repeat=5, warmup=1, poll_secs=0.1, no_agent_secs=60.0,
            signer=ArtifactSigner.from_file(farm.config.state_dir / SIGNING_DIR / SIGNING_KEY),
        )  # fmt: skip
        t0 = time.monotonic()
        with pytest.raises(JobFailed) as failed:
            check_on_device(m, built.directory, where)
        message = str(failed.value)
        assert f"did not run on {farm.agent_name()} ({CLAIMED['gpu_name']})" in message
        assert "no CUDA GPU" in message, message  # the runner got as far as the GPU
        assert time.monotonic() - t0 < 120.0
        assert not built.library.exists()  # a model that did not run is not kept
    finally:
        sessions.kw["bind"].dispose()
