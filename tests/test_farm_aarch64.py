"""The farm tunes a real ONNX model for an aarch64 device class, measured by the real
agent running as an aarch64 program under qemu-user (`make aarch64-root`), against the
real PostgreSQL and Redis:

    farm up with an aarch64 class (a Cortex-A72 target) and the agent in the aarch64 root
    (qemu emulating a Cortex-A72) -> the agent registers: aarch64, its cores, NEON and no
    SVE or dot product, emulated -> upload a tiny ONNX model, a job of a few trials ->
    build workers cross-compile aarch64 kernels -> the agent leases them over gRPC, runs
    them, its outputs are verified -> the tuned model is cross-compiled, run by the agent
    (a model run) and its outputs match onnxruntime -> the artifact, loaded and run here
    under emulation, matches onnxruntime too.

Emulated timings are flagged (the records, the measurements' fingerprints, the job's
latency, its peers' and `measured_on`) and the class's shared cost model never learns them.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("onnxruntime")
pytest.importorskip("grpc")
pytest.importorskip("rq")

from aarch64_fixtures import (  # noqa: E402
    ELF_MACHINE_AARCH64,
    aarch64_root,  # noqa: F401 (fixture)
    elf_machine,
    emulated_env,
    emulated_python,
    require_cross_compiler,
)
from farm_fixtures import running_farm, team_client, wait_for_job  # noqa: E402
from onnx_models import tiny_onnx  # noqa: E402
from sqlalchemy import select  # noqa: E402

from services.db.models import CostModelVersion, DeviceClass, Measurement  # noqa: E402
from services.db.session import make_session_factory, transaction  # noqa: E402
from tunefarm.models.check import compare_outputs  # noqa: E402
from tunefarm.models.finish import extract_archive  # noqa: E402
from tunefarm.models.importer import random_inputs, run_onnxruntime  # noqa: E402
from tunefarm.records import MeasureRecord  # noqa: E402
from tunefarm_app.farm_local import LocalFarm  # noqa: E402

pytestmark = pytest.mark.slow

CLASS = "aarch64-cortex-a72-emulated"
TARGET = {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "cortex-a72", "mattr": ["+neon"], "num-cores": 2}
QEMU_CPU = "cortex-a72"  # the emulated CPU matches the class: NEON, no SVE, no dot product
TRIALS = 6
JOB_TIMEOUT = 300.0


@pytest.fixture(scope="module")
def farm(database_url, tmp_path_factory, aarch64_root):  # noqa: F811
    require_cross_compiler()
    with running_farm(
        state_dir=tmp_path_factory.mktemp("armfarm"),
        database_url=database_url,
        workers=1,
        device_class=CLASS,
        target=TARGET,
        agent_command=[*emulated_python(aarch64_root), "-m", "services.agent"],
        agent_env=emulated_env(aarch64_root, cpu=QEMU_CPU),
        extra_env={"TUNEFARM_COST_MODEL_WARMUP": "4", "TUNEFARM_POLL_INTERVAL_SECS": "0.1"},
    ) as running:
        yield running


@pytest.fixture(scope="module")
def client(farm: LocalFarm):
    with team_client(farm) as c:
        yield c


def test_the_emulated_agent_registered_as_an_aarch64_board(farm, client):
    (agent,) = [d for d in client.devices() if d["device_class"] == CLASS]
    caps = agent["capabilities"]
    assert caps["arch"] == "aarch64" and caps["emulated"] is True and caps["emulation"]
    assert caps["logical_cores"] == os.cpu_count()
    assert "asimd" in caps["isa_features"] and not {"sve", "asimddp"} & set(caps["isa_features"])
    assert json.loads(caps["target_json"])["mtriple"] == "aarch64-linux-gnu"


def test_a_model_is_tuned_for_the_aarch64_class_through_the_emulated_agent(
    farm, client, aarch64_root, tmp_path  # noqa: F811
):
    onnx_path = tiny_onnx(tmp_path / "tiny.onnx")
    model = client.upload_model(onnx_path, {"x": [1, 3, 8, 8]})
    job = client.create_job(model_id=model["id"], device_class=CLASS, trial_budget=TRIALS)
    job = wait_for_job(client, job["id"], timeout=JOB_TIMEOUT)
    assert job["state"] == "succeeded", job["error"]
    assert job["trials_used"] == TRIALS and all(t["best_secs"] for t in job["tasks"])
    assert all(t["best_emulated"] for t in job["tasks"])  # the bests are emulated times, and say so

    # the tuned model ran on the agent: outputs checked against onnxruntime, latency flagged
    result = job["result"]
    assert result["check"]["ok"] is True and result["check"]["reference"] == "onnxruntime"
    assert result["measured_on"]["emulated"] is True and result["measured_on"]["device_class"] == CLASS
    assert result["measured_on"]["agent"] == farm.env["TUNEFARM_AGENT_NAME"]
    assert result["latency"]["median"] > 0 and result["latency"]["emulated"] is True
    # the peers were timed by the same agent (the emulator's time too), or say why not
    # (this root's agent extra has no onnxruntime)
    ort = result["onnxruntime_latency"]
    assert (ort["emulated"] is True and ort["runs"] == result["latency"]["runs"]) if ort else (
        "not installed" in result["peer_notes"]["onnxruntime"]
    )

    # the artifact: an aarch64 library, which loads and matches onnxruntime under emulation
    out = tmp_path / "tuned"
    extract_archive(client.artifact(job["id"]), out)
    assert elf_machine(out / "model.so") == ELF_MACHINE_AARCH64
    report = json.loads((out / "report.json").read_text())
    assert report["models"][0]["measured_on"]["emulated"] is True
    assert all(t["emulated"] and t["verified"] for t in report["models"][0]["tasks"])
    feeds = random_inputs({"x": (1, 3, 8, 8)}, {"x": "float32"}, seed=11)
    np.savez(tmp_path / "inputs.npz", feeds["x"])
    code = (
        "import sys, numpy as np; from tunefarm.models.runtime import run_job; "
        "outs = run_job(sys.argv[1], sys.argv[2], 0, 1)[0]; np.savez(sys.argv[3], *outs)"
    )
    ran = subprocess.run(
        [*emulated_python(aarch64_root), "-c", code, str(out / "model.so"), str(tmp_path / "inputs.npz"),
         str(tmp_path / "outputs.npz")],
        env={**os.environ, **emulated_env(aarch64_root, cpu=QEMU_CPU)},
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-2000:]
    with np.load(tmp_path / "outputs.npz") as got:
        outputs = [got[f"arr_{i}"] for i in range(len(got.files))]
    assert all(e.ok for e in compare_outputs(outputs, run_onnxruntime(onnx_path.read_bytes(), feeds), input_kind="normal"))

    # the kernels were aarch64 libraries, run and verified by the emulated agent
    kernels = list((Path(farm.info["artifact_root"]) / "kernels").glob("*.so"))
    assert kernels and {elf_machine(k) for k in kernels} == {ELF_MACHINE_AARCH64}
    records = [MeasureRecord.from_json(line) for line in client.records(job["id"])]
    measured = [r for r in records if r.error_kind.value not in ("build_error", "build_timeout")]
    assert len(records) == TRIALS and measured
    assert all(r.emulated for r in measured) and any(r.verified for r in measured)
    assert all(r.verified for r in measured if r.is_valid)

    # emulated timings are flagged in Postgres and the class's cost model never learnt them
    from services.scheduler.shared_model import ClassModels

    sessions = make_session_factory(farm.config.database_url)
    try:
        with transaction(sessions) as s:
            class_id = s.scalar(select(DeviceClass.id).where(DeviceClass.name == CLASS))
            rows = s.execute(
                select(Measurement.fingerprint, Measurement.record).where(Measurement.device_class_id == class_id)
            ).all()
            versions = s.scalars(select(CostModelVersion).where(CostModelVersion.device_class_id == class_id)).all()
        native = [r for fp, r in rows if not r.get("emulated")]
        assert all(fp.get("emulated") is True for fp, r in rows if r.get("emulated"))
        assert len(rows) - len(native) == len(measured)
        assert all(v.trained_on <= len(native) for v in versions)  # build errors at most
        models = ClassModels(sessions, Path(farm.info["artifact_root"]), warmup=4, save_every=1000, catch_up_secs=60)
        shared = models.get(class_id)
        assert shared.seen_through > 0 and shared.model.num_samples == len(native)
    finally:
        sessions.kw["bind"].dispose()
