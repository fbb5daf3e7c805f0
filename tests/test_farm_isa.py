"""Two x86 ISA device classes tuned side by side on one machine, against the real
PostgreSQL and Redis:

    farm up with an AVX2 class (`haswell`) and an extra SSE4.2 class (`x86-64-v2`), each
    with its own build worker and agent on this CPU (which runs both ISAs' code) -> a job
    on each class at the same time -> both finish; each class's kernels and tuned model
    are built for its own ISA (VEX-encoded AVX instructions in the haswell code only, by
    objdump); each class's cost model learnt its own measurements only;
    an agent for a class whose ISA this CPU lacks is refused, naming the extensions;
    a third class with no model of its own starts from its nearest class's model, and its
    job's status says which.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("onnxruntime")
pytest.importorskip("grpc")
pytest.importorskip("rq")

from farm_fixtures import running_farm, team_client, wait_for_job  # noqa: E402
from onnx_models import tiny_onnx  # noqa: E402
from sqlalchemy import select  # noqa: E402

from services.db.models import Batch, BatchCandidate, CostModelVersion, DeviceClass, Measurement  # noqa: E402
from services.db.session import make_session_factory, transaction  # noqa: E402
from tunefarm import isa  # noqa: E402
from tunefarm.models.finish import extract_archive  # noqa: E402
from tunefarm_app.farm_local import LocalFarm  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not isa.runs_on_host({"kind": "llvm", "mcpu": "haswell"}), reason="needs an AVX2 x86 host"),
]

AVX2, SSE42 = "x86-haswell", "x86-64-v2"
TARGETS = {
    AVX2: {"kind": "llvm", "mcpu": "haswell", "num-cores": 1},
    SSE42: {"kind": "llvm", "mcpu": "x86-64-v2", "num-cores": 1},
}
TRIALS = 6
JOB_TIMEOUT = 600.0  # generous: the machine is shared; a healthy run takes well under a minute
VEX = re.compile(r"^\s*[0-9a-f]+:\s+v\w+\s.*%[xy]mm", re.MULTILINE)  # an AVX (VEX-encoded) vector instruction


@pytest.fixture(scope="module")
def farm(database_url, tmp_path_factory):
    with running_farm(
        state_dir=tmp_path_factory.mktemp("isafarm"),
        database_url=database_url,
        workers=1,
        device_class=AVX2,
        target=TARGETS[AVX2],
        extra_classes={SSE42: TARGETS[SSE42]},
        extra_env={"TUNEFARM_COST_MODEL_WARMUP": "4", "TUNEFARM_POLL_INTERVAL_SECS": "0.1"},
    ) as running:
        yield running


@pytest.fixture(scope="module")
def client(farm: LocalFarm):
    with team_client(farm) as c:
        yield c


@pytest.fixture(scope="module")
def sessions(farm: LocalFarm):
    factory = make_session_factory(farm.config.database_url)
    yield factory
    factory.kw["bind"].dispose()


def vex_instructions(library: Path) -> int:
    dump = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(library)], capture_output=True, text=True,
                          check=True, timeout=60)  # fmt: skip
    return len(VEX.findall(dump.stdout))


def class_id(sessions, name: str) -> int:
    with transaction(sessions) as s:
        return s.scalar(select(DeviceClass.id).where(DeviceClass.name == name))


def latest_version(sessions, name: str, timeout: float = 30.0) -> CostModelVersion:
    """The class's newest saved cost model (the scheduler saves one right after a job ends)."""
    deadline = time.monotonic() + timeout
    while True:
        with transaction(sessions) as s:
            version = s.scalars(
                select(CostModelVersion)
                .join(DeviceClass, DeviceClass.id == CostModelVersion.device_class_id)
                .where(DeviceClass.name == name)
                .order_by(CostModelVersion.version.desc())
            ).first()
            if version is not None:
                s.expunge(version)
                return version
        assert time.monotonic() < deadline, f"no cost model version of {name}"
        time.sleep(0.5)


def test_one_machine_serves_both_classes(farm, client):
    agents = {d["device_class"]: d for d in client.devices()}
    assert set(agents) == {AVX2, SSE42}
    assert agents[SSE42]["name"] == farm.agent_name(SSE42) and agents[AVX2]["name"] == farm.agent_name()
    assert "avx2" in agents[AVX2]["capabilities"]["isa_features"]  # the same CPU, reported by both
    assert agents[AVX2]["capabilities"]["isa_features"] == agents[SSE42]["capabilities"]["isa_features"]


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump (binutils)")
def test_two_isa_classes_tune_side_by_side_each_for_its_own_isa(farm, client, sessions, tmp_path):
    from tunefarm.search.cost_model import XGBCostModel

    onnx_path = tiny_onnx(tmp_path / "tiny.onnx")
    model = client.upload_model(onnx_path, {"x": [1, 3, 8, 8]})
    # the model's own tasks (Winograd alternatives, tuned through the farm in test_farm_e2e, add nothing here)
    jobs = {c: client.create_job(model_id=model["id"], device_class=c, trial_budget=TRIALS, winograd=False)
            for c in TARGETS}  # fmt: skip
    done = {c: wait_for_job(client, j["id"], timeout=JOB_TIMEOUT) for c, j in jobs.items()}
    for job in done.values():
        assert job["state"] == "succeeded", job["error"]
        assert job["trials_used"] == TRIALS and job["result"]["check"]["ok"] is True
        assert job["cost_model"]["transferred_from"] is None  # both classes started fresh, side by side

    root = Path(farm.info["artifact_root"])
    for name, job in done.items():
        cid = class_id(sessions, name)
        with transaction(sessions) as s:
            kernels = s.scalars(
                select(BatchCandidate.artifact_path)
                .join(Batch, Batch.id == BatchCandidate.batch_id)
                .where(Batch.device_class_id == cid, BatchCandidate.artifact_path.is_not(None))
            ).all()
            measured = s.execute(
                select(Measurement.record, Measurement.agent_id).where(Measurement.device_class_id == cid)
            ).all()
        assert kernels and len(measured) == TRIALS
        assert {record["target"]["mcpu"] for record, _ in measured} == {TARGETS[name]["mcpu"]}
        assert len({agent for _, agent in measured}) == 1  # its own agent measured them
        vex = [vex_instructions(root / k) for k in kernels]
        out = tmp_path / name
        extract_archive(client.artifact(job["id"]), out)
        if name == AVX2:  # AVX2 code: every kernel and the model use VEX-encoded vector instructions
            assert all(vex) and vex_instructions(out / "model.so") > 0
        else:  # SSE4.2 code: none
            assert not any(vex) and vex_instructions(out / "model.so") == 0

        # its cost model learnt its own measurements, and nothing else
        version = latest_version(sessions, name)
        assert version.transferred_from_id is None
        learnt = XGBCostModel.load(root / version.path)
        assert learnt.num_prior == 0 and learnt.num_samples == len(measured)


def test_an_agent_is_refused_a_class_whose_isa_this_cpu_lacks(farm, sessions, tmp_path):
    from services.db import device_classes

    flags = isa.host_flags()
    candidates = [{"kind": "llvm", "mcpu": cpu} for cpu in ("skylake-avx512", "sapphirerapids", "znver5")]
    # no x86 CPU has both Intel's AMX (sapphirerapids) and AMD's SSE4a (znver5)
    target = next((t for t in candidates if isa.missing_extensions(isa.target_isa(t), flags)), None)
    assert target is not None, f"this CPU ({sorted(flags)[:8]}...) claims every candidate ISA"
    missing = isa.missing_extensions(isa.target_isa(target), flags)
    with transaction(sessions) as s:
        device_classes.ensure_device_class(s, name="x86-too-new", target=target, description="")
    ran = subprocess.run(
        [sys.executable, "-m", "tunefarm_app.cli", "agent", "--device-class", "x86-too-new", "--name", "refused",
         "--work-dir", str(tmp_path / "agent")],
        env={**os.environ, **farm.env}, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert ran.returncode == 2, ran.stdout[-2000:] + ran.stderr[-2000:]
    assert f"builds code using {', '.join(missing)}" in ran.stdout and "lacks" in ran.stdout


def test_a_new_class_starts_from_its_nearest_classs_model(farm, client, sessions, tmp_path):
    from services.db import device_classes

    source = latest_version(sessions, AVX2)
    with transaction(sessions) as s:  # AVX2 too: nearer to haswell than to x86-64-v2
        device_classes.ensure_device_class(s, name="x86-64-v3", target={"kind": "llvm", "mcpu": "x86-64-v3", "num-cores": 1})
    model = client.upload_model(tiny_onnx(tmp_path / "tiny.onnx"), {"x": [1, 3, 8, 8]}, name="tiny-v3")
    job = client.create_job(model_id=model["id"], device_class="x86-64-v3", trial_budget=TRIALS, winograd=False)
    started = wait_for_job(client, job["id"], lambda j: j["cost_model"]["version_id"] is not None, timeout=240)
    client.cancel(job["id"])  # the class has no agent here: its status is what this test reads
    assert started["cost_model"]["version_id"] == source.id
    assert started["cost_model"]["transferred_from"] == {"device_class": AVX2, "version": source.version}
    assert started["cost_model"]["device_class"] == AVX2
    log = Path(farm.processes["scheduler"].log)
    assert f"starts from class {AVX2}'s cost model version {source.version}" in log.read_text()
    # the same workloads were tuned on the AVX2 class: their best programs seed the searches
    deadline = time.monotonic() + 30
    while f"programs of class {AVX2} seed the tasks' searches" not in log.read_text():
        assert time.monotonic() < deadline, "the job did not start from the nearest class's programs"
        time.sleep(0.2)
