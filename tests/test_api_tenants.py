"""One team against the others on the HTTP API (real PostgreSQL, a throw-away database for
the module): a hostile upload cannot change what another team's upload stores, a model
that would make the importer allocate gigabytes is refused by its shape, the importers
are shared fairly, the token is checked before the body is read, and a team's jobs and
trials are capped."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
onnx = pytest.importorskip("onnx")

from fastapi.testclient import TestClient  # noqa: E402
from onnx_models import tiny_onnx  # noqa: E402
from sqlalchemy import select  # noqa: E402

from services.api.app import create_app  # noqa: E402
from services.api.settings import ApiSettings  # noqa: E402
from services.db.device_classes import ensure_device_class  # noqa: E402
from services.db.models import Job, Model, Team  # noqa: E402
from services.db.session import transaction  # noqa: E402
from services.db.teams import ensure_team  # noqa: E402
from services.db.tokens import issue_team_token  # noqa: E402

SHAPES = json.dumps({"x": [1, 3, 8, 8]})


CLASS = "tenants-cpu"
MAX_JOBS, MAX_TRIALS = 3, 1000


@pytest.fixture(scope="module")
def teams(db_sessions) -> dict[str, str]:
    with transaction(db_sessions) as s:
        ensure_device_class(s, name=CLASS, target={"kind": "llvm", "num-cores": 2})
        return {who: issue_team_token(s, team_id=ensure_team(s, name=f"tenants-{who}").id)
                for who in ("a", "b", "c")}


@pytest.fixture(scope="module")
def api(database_url, tmp_path_factory):
    settings = ApiSettings(database_url=database_url, api_allowed_hosts=["testserver"], artifact_root=tmp_path_factory.mktemp("artifacts"),
                           token_cache_secs=0, team_max_active_jobs=MAX_JOBS, team_max_active_trials=MAX_TRIALS)
    with TestClient(create_app(settings)) as client:
        yield client, settings


def auth(teams, who: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {teams[who]}"}


def model_bytes(tmp_path: Path, *, op: str = "Relu", doc: str = "") -> bytes:
    """tiny.onnx (static shapes); `doc` makes the bytes of otherwise equal models differ."""
    model = onnx.load(str(tiny_onnx(tmp_path / f"{op}.onnx", op=op, dynamic=False)))
    model.doc_string = doc
    return model.SerializeToString()


# -- finding 5: an upload's external data part overwriting the staged model ---------------------


@pytest.mark.parametrize("part", ["./model.onnx", "model.onnx/", ".//model.onnx", "model.onnx"])
def test_an_external_data_part_cannot_replace_another_teams_stored_model(api, teams, db_sessions, tmp_path, part):
    """Team A uploads a model with an `external_data` part that names the staged model
    file (its bytes: another model); team B then uploads A's model, byte for byte. The
    file stored under the model's content address must hold exactly that model."""
    client, settings = api
    real = model_bytes(tmp_path, doc=part)  # this case's own model: a content address of its own
    other = model_bytes(tmp_path, op="Sigmoid", doc=f"other {part}")
    r = client.post("/v1/models", headers=auth(teams, "a"), data={"input_shapes": SHAPES},
                    files=[("file", ("real.onnx", real)), ("external_data", (part, other))])
    if r.status_code == 201:  # taken in, and as the model that was uploaded
        assert r.json()["onnx_sha256"] == hashlib.sha256(real).hexdigest()
    else:
        assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_request", r.text
    b = client.post("/v1/models", headers=auth(teams, "b"), data={"input_shapes": SHAPES},
                    files={"file": ("real.onnx", real)})
    assert b.status_code == 201, b.text
    assert b.json()["onnx_sha256"] == hashlib.sha256(real).hexdigest()
    with transaction(db_sessions) as s:
        rows = s.execute(select(Model.onnx_path, Model.onnx_sha256, Model.onnx_size)).all()
    for path, sha256, size in rows:  # every stored file is what its address says
        data = (settings.artifact_root / path).read_bytes()
        assert (hashlib.sha256(data).hexdigest(), len(data)) == (sha256, size), path
    assert (settings.artifact_root / "models" / f"{hashlib.sha256(real).hexdigest()}.onnx").read_bytes() == real


# -- finding 6: a few bytes declaring gigabytes; one importer for every team --------------------


def huge_input_model() -> bytes:
    """A Relu on a 32768 x 32768 float input: 64 bytes of ONNX, 4 GiB as a tensor."""
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1 << 15, 1 << 15])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="")
    model.ir_version = 8
    return model.SerializeToString()


def huge_constant_model(tmp_path: Path) -> bytes:
    """tiny.onnx plus y + ConstantOfShape([32768, 32768]): every input small."""
    from onnx import TensorProto, helper, numpy_helper

    model = onnx.load(str(tiny_onnx(tmp_path / "c.onnx", dynamic=False)))
    shape = numpy_helper.from_array(__import__("numpy").array([1 << 15, 1 << 15], "int64"), "big_shape")
    model.graph.initializer.append(shape)
    model.graph.node.append(helper.make_node("ConstantOfShape", ["big_shape"], ["big"], name="fill",
                                             value=helper.make_tensor("v", TensorProto.FLOAT, [1], [0.0])))
    model.graph.node.append(helper.make_node("Add", ["y", "big"], ["z"], name="add_big"))
    model.graph.output[0].name = "z"
    return model.SerializeToString()


def address_space_limit(pid: int) -> int | None:
    """The soft RLIMIT_AS of a process, from /proc (None: unlimited)."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max address space"):
            soft = line.split()[3]
            return None if soft == "unlimited" else int(soft)
    raise AssertionError("no address space line")


@pytest.mark.parametrize("case", ["static input", "given input shape", "computed constant"])
def test_a_few_bytes_declaring_a_huge_tensor_are_refused_by_shape(api, teams, tmp_path, case):
    client, settings = api
    data, shapes, named = {
        "static input": (huge_input_model(), "{}", "input 'x'"),
        "given input shape": (tiny_onnx(tmp_path / "n.onnx").read_bytes(), '{"x": [10000000, 3, 8, 8]}', "input 'x'"),
        "computed constant": (huge_constant_model(tmp_path), "{}", "'big'"),
    }[case]
    if case == "static input":
        assert len(data) < 100
    r = client.post("/v1/models", headers=auth(teams, "a"), data={"input_shapes": shapes},
                    files={"file": ("huge.onnx", data)})
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_model"
    assert named in error["message"] and f"{settings.max_tensor_elements:,}" in error["message"], error
    # The importer that said so is alive, its address space capped.
    pids = [w.pid for w in client.app.state.intake.workers if w.pid is not None]
    assert pids
    for pid in pids:
        assert address_space_limit(pid) == settings.intake_memory_limit_bytes


def test_many_tensors_each_under_the_cap_are_refused_together():
    """Forty Relus on a 4 Mi-element input: every value is under the per-tensor cap, all
    of them together are not (the importer would hold gigabytes)."""
    from onnx import TensorProto, helper

    from tunefarm.errors import ModelError
    from tunefarm.models.tensor_limits import check_tensor_elements

    n = 1 << 22
    nodes = [helper.make_node("Relu", [f"v{i}"], [f"v{i + 1}"]) for i in range(40)]
    graph = helper.make_graph(nodes, "", [helper.make_tensor_value_info("v0", TensorProto.FLOAT, [n])],
                              [helper.make_tensor_value_info("v40", TensorProto.FLOAT, None)])  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    check_tensor_elements(model, {"v0": [n]}, max_elements=n)  # each is within its cap
    with pytest.raises(ModelError, match="in all"):
        check_tensor_elements(model, {"v0": [n]}, max_elements=n, max_total=16 * n)
    check_tensor_elements(model, {"v0": [n]}, max_elements=n, max_total=41 * n)


def reserve(n: int) -> int:
    """Map `n` bytes of anonymous memory (never touched) and let them go: run in an importer."""
    import mmap

    mmap.mmap(-1, n).close()
    return n


def test_an_isolated_worker_with_a_memory_limit_cannot_map_past_it():
    from tunefarm.isolation import CallStatus, IsolatedWorker

    limit = 3 << 30
    with IsolatedWorker(memory_limit_bytes=limit, name="capped") as worker:
        small = worker.call(f"{__name__}:reserve", 1 << 20, timeout=60)
        assert small.ok and address_space_limit(worker.pid) == limit
        over = worker.call(f"{__name__}:reserve", 2 * limit, timeout=60)
        assert over.status is CallStatus.RAISED and "Cannot allocate memory" in over.message, over
        assert worker.call(f"{__name__}:reserve", 1 << 20, timeout=60).ok  # still alive


def test_the_importers_run_without_the_apis_secrets(monkeypatch):
    """An upload is untrusted input to its importer: the importer process does not inherit
    the API's database URL, tokens or passwords, only what the pool gives it."""
    from services.api.intake_pool import IMPORTER_ENV, IntakePool

    monkeypatch.setenv("TUNEFARM_DATABASE_URL", "postgresql://farm:hunter2@db/farm")
    monkeypatch.setenv("SOME_API_TOKEN", "tfa_secret")
    pool = IntakePool(size=1, per_team=1, wait_secs=1.0, memory_limit_bytes=None, preload=[])
    try:
        (worker,) = pool.workers
        seen = worker.call("os:getenv", "TUNEFARM_DATABASE_URL", timeout=60.0)
        assert seen.ok and seen.value is None
        assert worker.call("os:getenv", "SOME_API_TOKEN", timeout=60.0).value is None
        name, value = next(iter(IMPORTER_ENV.items()))
        assert worker.call("os:getenv", name, timeout=60.0).value == value
        assert worker.call("os:getenv", "PATH", timeout=60.0).value  # not an empty environment
    finally:
        pool.close()


def test_another_teams_upload_does_not_wait_behind_a_teams_import(api, teams, db_sessions, tmp_path):
    """Team A has an upload being imported (it holds an importer); team B's upload is
    taken in meanwhile, and team A's second upload is refused at once (429)."""
    client, _ = api
    pool = client.app.state.intake
    with transaction(db_sessions) as s:
        team_a = s.scalar(select(Team.id).where(Team.name == "tenants-a"))
    real = model_bytes(tmp_path, doc="pool")
    with pool.admit(team_a), pool.importer():
        assert pool.in_progress(team_a) == 1
        again = client.post("/v1/models", headers=auth(teams, "a"), data={"input_shapes": SHAPES},
                            files={"file": ("m.onnx", real)})
        assert again.status_code == 429, again.text
        assert again.json()["error"]["code"] == "too_many_requests" and again.headers["retry-after"]
        assert "being imported" in again.json()["error"]["message"]
        b = client.post("/v1/models", headers=auth(teams, "b"), data={"input_shapes": SHAPES},
                        files={"file": ("m.onnx", real)})
        assert b.status_code == 201, b.text
    assert pool.in_progress(team_a) == 0
    r = client.post("/v1/models", headers=auth(teams, "a"), data={"input_shapes": SHAPES},
                    files={"file": ("m.onnx", real)})
    assert r.status_code == 201, r.text


# -- finding 6: quotas ------------------------------------------------------------------------


def upload(client, teams, who: str, data: bytes) -> int:
    r = client.post("/v1/models", headers=auth(teams, who), data={"input_shapes": SHAPES},
                    files={"file": ("m.onnx", data)})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def test_a_team_is_held_to_its_quota_of_jobs_and_trials(api, teams, db_sessions, tmp_path):
    client, _ = api
    model_a = upload(client, teams, "a", model_bytes(tmp_path, doc="quota"))
    model_b = upload(client, teams, "b", model_bytes(tmp_path, doc="quota"))

    def job(who: str, model_id: int, trials: int):
        return client.post("/v1/jobs", headers=auth(teams, who),
                           json={"model_id": model_id, "device_class": CLASS, "trial_budget": trials})

    def jobs_stored() -> int:
        with transaction(db_sessions) as s:
            return len(s.scalars(select(Job.id)).all())

    started = [job("a", model_a, 300) for _ in range(MAX_JOBS)]
    assert [r.status_code for r in started] == [201] * MAX_JOBS
    before = jobs_stored()
    over = job("a", model_a, 10)
    assert over.status_code == 429 and over.json()["error"]["code"] == "quota_exceeded", over.text
    assert f"{MAX_JOBS} jobs queued or running" in over.json()["error"]["message"]
    other = job("b", model_b, MAX_TRIALS)  # another team's quota is its own
    assert other.status_code == 201, other.text
    assert client.post(f"/v1/jobs/{started[0].json()['id']}/cancel", headers=auth(teams, "a")).status_code == 200
    too_many_trials = job("a", model_a, MAX_TRIALS - 2 * 300 + 1)
    assert too_many_trials.status_code == 429, too_many_trials.text
    message = too_many_trials.json()["error"]["message"]
    assert "600" in message and f"({MAX_TRIALS} trials)" in message, message
    assert jobs_stored() == before + 1  # the refused jobs stored nothing
    assert job("a", model_a, MAX_TRIALS - 2 * 300).status_code == 201


def test_jobs_created_at_once_are_counted_one_after_the_other(api, teams, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    client, _ = api
    model_c = upload(client, teams, "c", model_bytes(tmp_path, doc="race"))
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: client.post(
            "/v1/jobs", headers=auth(teams, "c"), json={"model_id": model_c, "device_class": CLASS, "trial_budget": 5}
        ).status_code, range(8)))
    assert sorted(answers) == [201] * MAX_JOBS + [429] * (8 - MAX_JOBS)
