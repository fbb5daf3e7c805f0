"""A farm job in reduced precision (`JobCreate.precision`), against a real PostgreSQL: on a
CUDA class with tensor cores the model is imported again in float16 and the job tunes
the converted model's tasks (tensor-core-form matmuls), its config naming the precision
and the converted fused module, which the scheduler's job loads; a float32 job's config
is as it was; float16 on a CPU class (or a GPU without tensor cores) is a 422 naming the
option, storing nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("onnx")

from fastapi.testclient import TestClient  # noqa: E402
from onnx_models import matmul_mlp_onnx  # noqa: E402
from sqlalchemy import func, select  # noqa: E402

from services.api.app import create_app  # noqa: E402
from services.api.settings import ApiSettings  # noqa: E402
from services.db.device_classes import ensure_device_class  # noqa: E402
from services.db.models import Job, JobTask, WorkloadRow  # noqa: E402
from services.db.session import transaction  # noqa: E402
from services.db.teams import ensure_team  # noqa: E402
from services.db.tokens import issue_team_token  # noqa: E402

CPU_CLASS = "p-cpu"
GPU_CLASS = "p-sm80"
OLD_GPU_CLASS = "p-sm61"


@pytest.fixture(scope="module")
def farm(database_url, db_sessions, tmp_path_factory):
    root = tmp_path_factory.mktemp("artifacts")
    with transaction(db_sessions) as s:
        token = issue_team_token(s, team_id=ensure_team(s, name="team-p").id)
        ensure_device_class(s, name=CPU_CLASS, target={"kind": "llvm", "num-cores": 2})
        ensure_device_class(s, name=GPU_CLASS, target={"kind": "cuda", "arch": "sm_80"})
        ensure_device_class(s, name=OLD_GPU_CLASS, target={"kind": "cuda", "arch": "sm_61"})
    settings = ApiSettings(database_url=database_url, api_allowed_hosts=["testserver"], artifact_root=root,
                           max_upload_bytes=1 << 20, token_cache_secs=0)  # fmt: skip
    with TestClient(create_app(settings)) as client:
        yield {"client": client, "headers": {"Authorization": f"Bearer {token}"}, "root": root, "sessions": db_sessions}


@pytest.fixture(scope="module")
def uploaded(farm, tmp_path_factory) -> dict:
    path = matmul_mlp_onnx(tmp_path_factory.mktemp("models") / "mlp.onnx")
    r = farm["client"].post("/v1/models", headers=farm["headers"], files={"file": ("mlp.onnx", path.read_bytes())},
                            data={"input_shapes": json.dumps({})})  # fmt: skip
    assert r.status_code == 201, r.text
    return r.json()


def _job(farm, **body):
    return farm["client"].post("/v1/jobs", headers=farm["headers"], json=body)


def _counts(farm) -> tuple:
    root: Path = farm["root"]
    with transaction(farm["sessions"]) as s:
        rows = tuple(s.scalar(select(func.count()).select_from(m)) for m in (Job, JobTask, WorkloadRow))
    return rows, sorted(str(p) for p in root.rglob("*") if p.is_file())


@pytest.mark.parametrize(
    ("device_class", "words"),
    [(CPU_CLASS, ["precision fp16 needs a CUDA target", CPU_CLASS]), (OLD_GPU_CLASS, ["tensor cores", "sm_61"])],
)
def test_fp16_on_a_class_without_tensor_cores_is_refused_naming_the_option(farm, uploaded, device_class, words):
    before = _counts(farm)
    r = _job(farm, model_id=uploaded["id"], device_class=device_class, trial_budget=8, precision="fp16")
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_request" and all(w in error["message"] for w in words), error["message"]
    assert _counts(farm) == before
    r = _job(farm, model_id=uploaded["id"], device_class=GPU_CLASS, trial_budget=8, precision="bf16")
    assert r.status_code == 422 and "precision" in r.text


def test_an_fp16_job_tunes_the_converted_models_tasks_and_the_scheduler_loads_them(farm, uploaded):
    from services.db import job_store
    from services.scheduler.farm_job import FarmJob, RunnerContext
    from tunefarm.gpu import GpuLimits
    from tunefarm.search.space.dag import analyse
    from tunefarm.search.space.tensor_core import tensor_core_form

    plain = _job(farm, model_id=uploaded["id"], device_class=GPU_CLASS, trial_budget=8)
    assert plain.status_code == 201, plain.text
    assert "precision" not in plain.json()["config"] and "fused_path" not in plain.json()["config"]
    r = _job(farm, model_id=uploaded["id"], device_class=GPU_CLASS, trial_budget=8, precision="fp16")
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["config"]["precision"] == "fp16" and job["config"]["fused_path"].endswith(".fused.json")
    names = [t["name"] for t in job["tasks"]]
    assert len(names) == len(uploaded["tasks"]) + 1 and names[0] == "cast(32x64)"  # the input cast down to float16
    assert not {t["key"] for t in job["tasks"]} & {t["key"] for t in plain.json()["tasks"]}

    # The scheduler's job loads the float16 module from the config, its tasks the job's.
    with transaction(farm["sessions"]) as s:
        setup = job_store.claim_job(s, job_id=job["id"])
    ctx = RunnerContext(sessions=farm["sessions"], artifact_root=farm["root"], measurer_factory=None,
                        check_tuned_model=False, log=lambda msg: None)  # fmt: skip
    runner = FarmJob(ctx, setup, shared=None)
    assert runner.precision() == "fp16"
    model = runner.load_model()
    assert model.tasks.precision == "fp16"
    keys = {t["key"].rsplit("@", 1)[0] for t in job["tasks"]}
    assert {t.key for t in model.tasks.tasks} == keys
    gpu = GpuLimits.of({"kind": "cuda", "arch": "sm_80"})
    in_form = [t.name for t in model.tasks.tasks
               if any(tensor_core_form(d, b, gpu) for d in [analyse(t.workload.mod["main"])] for b in d.blocks)]
    assert len(in_form) == 2  # both dense layers
    for j in (job, plain.json()):  # (queued and running jobs count against the team's quota)
        farm["client"].post(f"/v1/jobs/{j['id']}/cancel", headers=farm["headers"])
