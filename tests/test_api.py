"""The HTTP API against a real PostgreSQL (a throw-away database for the module): the
OpenAPI schema, authentication, uploads, jobs, records, devices, and every bad input
getting its clear JSON error while changing nothing stored."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("onnx")

from fastapi.testclient import TestClient  # noqa: E402
from onnx_models import tiny_onnx  # noqa: E402
from sqlalchemy import event, func, select, update  # noqa: E402

from services.api.app import create_app  # noqa: E402
from services.api.settings import ApiSettings  # noqa: E402
from services.db.device_classes import ensure_device_class  # noqa: E402
from services.db.models import Agent, Job, JobTask, Model, ModelTask, Token, WorkloadRow  # noqa: E402
from services.db.session import transaction  # noqa: E402
from services.db.states import AgentState  # noqa: E402
from services.db.teams import ensure_team  # noqa: E402
from services.db.tokens import issue_agent_token, issue_team_token  # noqa: E402
from tunefarm.records import MeasureRecord  # noqa: E402
from tunefarm_app.bench.farm_progress import seed_job  # noqa: E402

MAX_UPLOAD = 64 * 1024
CLASS = "test-cpu"
GPU_CLASS = "test-sm80"


def onnx_model(path: Path, *, op: str = "Relu", dynamic: bool = True) -> Path:
    return tiny_onnx(path, op=op, dynamic=dynamic)


@pytest.fixture(scope="module")
def farm(database_url, db_sessions, tmp_path_factory):
    root = tmp_path_factory.mktemp("artifacts")
    with transaction(db_sessions) as s:
        a, b = ensure_team(s, name="team-a"), ensure_team(s, name="team-b")
        tokens = {
            "a": issue_team_token(s, team_id=a.id),
            "b": issue_team_token(s, team_id=b.id),
            "agent": issue_agent_token(s),
        }
        ensure_device_class(s, name=CLASS, target={"kind": "llvm", "num-cores": 2})
        ensure_device_class(s, name=GPU_CLASS, target={"kind": "cuda", "arch": "sm_80"})
    settings = ApiSettings(database_url=database_url, api_allowed_hosts=["testserver"], artifact_root=root, max_upload_bytes=MAX_UPLOAD, token_cache_secs=0)
    with TestClient(create_app(settings)) as client:
        yield {"client": client, "tokens": tokens, "root": root, "sessions": db_sessions}


def auth(farm, who: str = "a") -> dict[str, str]:
    return {"Authorization": f"Bearer {farm['tokens'][who]}"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return onnx_model(tmp_path_factory.mktemp("models") / "tiny.onnx")


@pytest.fixture(scope="module")
def uploaded(farm, tiny) -> dict:
    r = farm["client"].post("/v1/models", headers=auth(farm), files={"file": ("tiny.onnx", tiny.read_bytes())},
                            data={"input_shapes": json.dumps({"x": [1, 3, 8, 8]})})
    assert r.status_code == 201, r.text
    return r.json()


def stored(farm) -> dict:
    """Everything a bad request must leave unchanged: rows and files."""
    root: Path = farm["root"]
    with transaction(farm["sessions"]) as s:
        rows = {m.__tablename__: s.scalar(select(func.count()).select_from(m))
                for m in (Model, ModelTask, WorkloadRow, Job, JobTask, Token)}
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    return {"rows": rows, "files": files}


def assert_error(response, status: int, code: str, *words: str) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert error["code"] == code
    for w in words:
        assert w in error["message"], error["message"]
    return error


# -- the schema ---------------------------------------------------------------------------------


def test_openapi_schema_is_complete(farm):
    schema = farm["client"].get("/openapi.json").json()
    components = schema["components"]["schemas"]
    assert "bearer" in json.dumps(schema["components"]["securitySchemes"]).lower()

    def refs(node):
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "$ref":
                    yield v
                else:
                    yield from refs(v)
        elif isinstance(node, list):
            for v in node:
                yield from refs(v)

    for ref in refs(schema):  # every reference resolves
        assert ref.startswith("#/components/schemas/") and ref.split("/")[-1] in components, ref
    operations = [(path, method, op) for path, item in schema["paths"].items() for method, op in item.items()]
    assert {p for p, _, _ in operations} >= {
        "/v1/models", "/v1/models/{model_id}", "/v1/jobs", "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/cancel",
        "/v1/jobs/{job_id}/artifact", "/v1/jobs/{job_id}/records", "/v1/devices", "/v1/device-classes", "/healthz",
    }
    for path, method, op in operations:
        success = [s for s in op["responses"] if s.startswith("2")]
        assert success, (path, method)
        content = op["responses"][success[0]]["content"]
        assert any(c.get("schema") for c in content.values()), (path, method)  # a typed body, not "any"
        json_schema = content.get("application/json", {}).get("schema", {})
        if json_schema:
            assert "$ref" in json_schema or json_schema.get("type") == "array", (path, method, json_schema)
        if path.startswith("/v1/"):
            assert op.get("security"), (path, method)
            for status in ("401", "403", "422"):
                assert op["responses"][status]["content"]["application/json"]["schema"]["$ref"].endswith("ErrorBody")
        assert op.get("summary") or op.get("description"), (path, method)
    assert schema["paths"]["/v1/models"]["post"]["responses"]["413"]
    assert schema["paths"]["/v1/jobs/{job_id}/cancel"]["post"]["responses"]["409"]
    assert "JobCreate" in components and "JobPublic" in components


def test_health_needs_no_token(farm):
    r = farm["client"].get("/healthz")
    assert r.status_code == 200 and r.json()["status"] == "ok"


# -- authentication -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "status", "code"),
    [
        (None, 401, "unauthorized"),
        ("Bearer", 401, "unauthorized"),
        ("Basic dXNlcjpwYXNz", 401, "unauthorized"),
        ("Bearer tft_not-a-real-token", 401, "unauthorized"),
        ("agent", 403, "forbidden"),
    ],
)
def test_missing_wrong_and_agent_tokens_are_refused(farm, header, status, code):
    before = stored(farm)
    headers = {} if header is None else {"Authorization": f"Bearer {farm['tokens']['agent']}" if header == "agent" else header}
    for method, path in (("GET", "/v1/jobs"), ("GET", "/v1/devices"), ("POST", "/v1/jobs")):
        r = farm["client"].request(method, path, headers=headers, json={"model_id": 1, "device_class": CLASS,
                                                                        "trial_budget": 5})
        error = assert_error(r, status, code)
        if status == 401:
            assert r.headers.get("www-authenticate") == "Bearer"
        if header == "agent":
            assert "agent token" in error["message"]
    assert stored(farm) == before


def test_a_revoked_token_is_refused(farm):
    with transaction(farm["sessions"]) as s:
        team = ensure_team(s, name="team-revoked")
        plain = issue_team_token(s, team_id=team.id)
    headers = {"Authorization": f"Bearer {plain}"}
    assert farm["client"].get("/v1/jobs", headers=headers).status_code == 200
    with transaction(farm["sessions"]) as s:
        s.execute(update(Token).where(Token.team_id == team.id).values(revoked_at=func.now()))
    assert_error(farm["client"].get("/v1/jobs", headers=headers), 401, "unauthorized", "revoked")


# -- models -------------------------------------------------------------------------------------


def test_upload_answers_with_the_task_table(farm, uploaded):
    m = uploaded
    assert m["name"] == "tiny" and m["input_shapes"] == {"x": [1, 3, 8, 8]}
    assert m["inputs"] == [{"name": "x", "shape": [1, 3, 8, 8], "dtype": "float32"}]
    assert m["outputs"][0]["shape"] == [1, 4, 8, 8]
    assert [t["position"] for t in m["tasks"]] == [0, 1, 2, 3]  # two convolutions, two transposes
    convs = [t for t in m["tasks"] if t["name"].startswith("fused_conv2d")]
    assert len(convs) == 2 and all(t["weight"] == 1 and t["flops"] > 0 for t in convs)
    assert [t["name"].split("(")[0] for t in m["tasks"] if t not in convs] == ["transpose", "transpose"]
    assert abs(sum(t["share"] for t in m["tasks"]) - 1) < 1e-6
    root: Path = farm["root"]
    assert (root / "models" / f"{m['onnx_sha256']}.onnx").is_file()
    assert not any((root / "tmp").iterdir())  # staging left empty
    again = farm["client"].get(f"/v1/models/{m['id']}", headers=auth(farm)).json()
    assert again == m
    assert_error(farm["client"].get(f"/v1/models/{m['id']}", headers=auth(farm, "b")), 404, "not_found")
    listing = farm["client"].get("/v1/models", headers=auth(farm)).json()
    assert [i["id"] for i in listing["items"]] == [m["id"]] and listing["next_cursor"] is None


def _upload(farm, data: bytes, shapes: str | None = '{"x": [1, 3, 8, 8]}', **kw):
    form = {} if shapes is None else {"input_shapes": shapes}
    return farm["client"].post("/v1/models", headers=auth(farm), files={"file": ("m.onnx", data)}, data=form, **kw)


def test_bad_uploads_get_clear_errors_and_store_nothing(farm, uploaded, tmp_path):
    before = stored(farm)
    bad_op = onnx_model(tmp_path / "bad.onnx", op="NotARealOp").read_bytes()
    tiny = onnx_model(tmp_path / "tiny.onnx").read_bytes()
    cases = [
        (_upload(farm, b"not an onnx model at all" * 10), 422, "invalid_model", ["not a valid ONNX model"]),
        (_upload(farm, tiny[: len(tiny) // 2]), 422, "invalid_model", ["ONNX"]),
        (_upload(farm, bad_op), 422, "invalid_model", ["NotARealOp", "act1"]),
        (_upload(farm, tiny, shapes=None), 422, "invalid_model", ["'x'", "dynamic"]),
        (_upload(farm, tiny, shapes='{"x": [1, 3, 9, 9]}'), 422, "invalid_model", ["contradicts"]),
        (_upload(farm, tiny, shapes="not json"), 422, "invalid_request", ["input_shapes"]),
        (_upload(farm, tiny, shapes='{"x": [1, -3]}'), 422, "invalid_request", ["positive"]),
        (_upload(farm, b""), 422, "invalid_model", ["empty"]),
        (_upload(farm, b"\0" * (MAX_UPLOAD + 1)), 413, "payload_too_large", [str(MAX_UPLOAD)]),
        (_upload(farm, b"\0" * (MAX_UPLOAD * 3)), 413, "payload_too_large", []),
    ]
    for response, status, code, words in cases:
        assert_error(response, status, code, *words)
    # a body streamed without a Content-Length is cut off as it passes the limit
    boundary = "tunefarmboundary"

    def chunks():
        yield (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"m.onnx\"\r\n"
               "Content-Type: application/octet-stream\r\n\r\n").encode()
        for _ in range(MAX_UPLOAD // 1024 * 4):
            yield b"\0" * 1024
        yield f"\r\n--{boundary}--\r\n".encode()

    r = farm["client"].post("/v1/models", headers={**auth(farm), "Content-Type": f"multipart/form-data; boundary={boundary}"},
                            content=chunks())
    assert_error(r, 413, "payload_too_large")
    assert stored(farm) == before


# -- jobs ---------------------------------------------------------------------------------------


def _job(farm, who: str = "a", **body):
    return farm["client"].post("/v1/jobs", headers=auth(farm, who), json=body)


def test_create_a_job(farm, uploaded):
    r = _job(farm, model_id=uploaded["id"], device_class=CLASS, trial_budget=40, latency_target_secs=0.001)
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["state"] == "queued" and job["trials_used"] == 0 and job["trial_budget"] == 40
    assert job["device_class"] == CLASS and job["model_name"] == "tiny" and job["latency_target_secs"] == 0.001
    assert [t["name"] for t in job["tasks"]] == [t["name"] for t in uploaded["tasks"]]
    assert all(t["key"].startswith(m["key"] + "@") for t, m in zip(job["tasks"], uploaded["tasks"]))
    # 40 trials, 4 tasks; convolutions also by Winograd unless the job says no
    assert job["config"] == {"strategy": "gradient", "seed": 1, "batch_size": 4, "algorithms": ["winograd"]}
    assert job["artifact"] == {"available": False, "sha256": None, "size": None}
    assert farm["client"].get(f"/v1/jobs/{job['id']}", headers=auth(farm)).json() == job
    plain = _job(farm, model_id=uploaded["id"], device_class=CLASS, trial_budget=40, winograd=False).json()
    assert plain["config"]["algorithms"] == []


def test_a_tasks_alternatives_are_shown_within_its_row(farm, uploaded):
    """Alternatives (job task rows the scheduler adds: a convolution's Winograd programs)
    are no tasks of the model: the task's row counts them once (trials together, the
    fastest best and whose) and lists each program, its own first."""
    from services.db import farm_tasks

    job = _job(farm, model_id=uploaded["id"], device_class=CLASS, trial_budget=40).json()
    conv = job["tasks"][1]
    with transaction(farm["sessions"]) as s:
        task_id = farm_tasks.job_task_id(s, job_id=job["id"], task_key=conv["key"])
        s.execute(update(JobTask).where(JobTask.id == task_id).values(trials=3, best_cost=2e-5, confirmed_cost=2e-5))
        for i, (m, trials, best) in enumerate([(2, 4, 1e-5), (4, 1, None)]):
            name = f"{conv['name']}+winograd{m}"
            fields = farm_tasks.WorkloadFields(key=f"{name}#{i:016x}", name=name, module_json="{}", flops=1.0,
                                               n_inputs=2, n_outputs=1, io_bytes=8)  # fmt: skip
            workload_id = farm_tasks.store_workload(s, workload=fields)
            alt = farm_tasks.add_alternative(s, of_job_task_id=task_id, workload_id=workload_id,
                                             task_key=f"{fields.key}@t")  # fmt: skip
            s.execute(update(JobTask).where(JobTask.id == alt).values(trials=trials, best_cost=best))
    body = farm["client"].get(f"/v1/jobs/{job['id']}", headers=auth(farm)).json()
    assert [t["position"] for t in body["tasks"]] == [0, 1, 2, 3]  # the model's tasks only
    row = body["tasks"][1]
    assert row["trials"] == 8 and row["best_secs"] == 1e-5 and row["algorithm"] == "winograd2"
    assert row["confirmed_best_secs"] == 2e-5 and not row["best_confirmed"]
    assert [(a["algorithm"], a["position"], a["trials"], a["best_secs"]) for a in row["alternatives"]] == [
        ("direct", 1, 3, 2e-5), ("winograd2", 4, 4, 1e-5), ("winograd4", 5, 1, None)
    ]
    assert all(not t["alternatives"] and t["algorithm"] == "direct" for t in body["tasks"] if t is not row)

    client = farm["client"]  # the dashboard's job page: a row per program below the task's
    client.cookies.clear()
    assert client.post("/ui/login", data={"token": farm["tokens"]["a"]}, headers={"Origin": "http://testserver"},
                       follow_redirects=False).status_code == 303  # fmt: skip
    try:
        page = client.get(f"/ui/jobs/{job['id']}").text
    finally:
        client.cookies.clear()
    assert page.count('<tr class="task"') == 4 and page.count('<tr class="alternative"') == 3
    assert 'data-position="4" data-algorithm="winograd2"' in page and "task-algorithm" in page


def test_a_job_on_a_cuda_class_has_its_tasks_keyed_for_the_gpu(farm, uploaded):
    """A model's tasks are the same on every class; a CUDA class's job keys them for its
    target (its measurements and bests are the GPU's, never the CPU's)."""
    r = _job(farm, model_id=uploaded["id"], device_class=GPU_CLASS, trial_budget=10)
    assert r.status_code == 201, r.text
    job = r.json()
    cpu = _job(farm, model_id=uploaded["id"], device_class=CLASS, trial_budget=10).json()
    try:
        assert job["device_class"] == GPU_CLASS and job["state"] == "queued"
        assert [t["name"] for t in job["tasks"]] == [t["name"] for t in uploaded["tasks"]]
        gpu_suffixes = {t["key"].rsplit("@", 1)[1] for t in job["tasks"]}
        assert len(gpu_suffixes) == 1 and gpu_suffixes != {t["key"].rsplit("@", 1)[1] for t in cpu["tasks"]}
    finally:
        for j in (job, cpu):  # (queued jobs count against the team's quota)
            farm["client"].post(f"/v1/jobs/{j['id']}/cancel", headers=auth(farm))


@pytest.mark.parametrize(
    ("body", "status", "code", "words"),
    [
        ({"device_class": "no-such-class", "trial_budget": 10}, 422, "invalid_request", ["no-such-class", CLASS]),
        ({"device_class": CLASS, "trial_budget": -5}, 422, "invalid_request", ["trial_budget"]),
        ({"device_class": CLASS, "trial_budget": 0}, 422, "invalid_request", ["trial_budget"]),
        ({"device_class": CLASS, "trial_budget": 10**9}, 422, "invalid_request", ["100000"]),
        ({"device_class": CLASS, "trial_budget": "lots"}, 422, "invalid_request", ["trial_budget"]),
        ({"device_class": CLASS, "trial_budget": 10, "latency_target_secs": -1}, 422, "invalid_request", ["latency"]),
        ({"device_class": CLASS, "trial_budget": 10, "strategy": "greedy"}, 422, "invalid_request", ["strategy"]),
        ({"device_class": CLASS, "trial_budget": 10, "seed": 0}, 422, "invalid_request", ["seed"]),
        ({"device_class": CLASS, "trial_budget": 10, "surprise": 1}, 422, "invalid_request", ["surprise"]),
        ({"device_class": CLASS}, 422, "invalid_request", ["trial_budget"]),
    ],
)
def test_bad_jobs_get_clear_errors_and_store_nothing(farm, uploaded, body, status, code, words):
    before = stored(farm)
    assert_error(_job(farm, model_id=uploaded["id"], **body), status, code, *words)
    assert stored(farm) == before


def test_another_teams_ids_are_not_found(farm, uploaded):
    before = stored(farm)
    assert_error(_job(farm, "b", model_id=uploaded["id"], device_class=CLASS, trial_budget=10), 404, "not_found")
    assert_error(_job(farm, model_id=10**9, device_class=CLASS, trial_budget=10), 404, "not_found")
    assert stored(farm) == before
    job = _job(farm, model_id=uploaded["id"], device_class=CLASS, trial_budget=10).json()
    c = farm["client"]
    for method, path in (("GET", ""), ("POST", "/cancel"), ("GET", "/artifact"), ("GET", "/records")):
        r = c.request(method, f"/v1/jobs/{job['id']}{path}", headers=auth(farm, "b"))
        assert_error(r, 404, "not_found", f"job {job['id']}")
        missing = c.request(method, f"/v1/jobs/{10**9}{path}", headers=auth(farm))
        assert_error(missing, 404, "not_found")
    assert c.get(f"/v1/jobs/{job['id']}", headers=auth(farm)).json()["state"] == "queued"  # b cancelled nothing
    assert_error(c.get("/v1/jobs/abc", headers=auth(farm)), 422, "invalid_request")


def test_cancel_a_queued_job_and_the_conflicts(farm, uploaded):
    c = farm["client"]
    job = _job(farm, model_id=uploaded["id"], device_class=CLASS, trial_budget=10).json()
    assert_error(c.get(f"/v1/jobs/{job['id']}/artifact", headers=auth(farm)), 409, "conflict", "queued")
    r = c.post(f"/v1/jobs/{job['id']}/cancel", headers=auth(farm))
    assert r.status_code == 200 and r.json()["state"] == "cancelled" and r.json()["cancel_requested"]
    assert r.json()["finished_at"] is not None
    assert_error(c.post(f"/v1/jobs/{job['id']}/cancel", headers=auth(farm)), 409, "conflict", "already cancelled")


def test_jobs_are_paginated_newest_first(farm, uploaded):
    c = farm["client"]
    with transaction(farm["sessions"]) as s:
        team = ensure_team(s, name="team-pages")
        token = issue_team_token(s, team_id=team.id)
    headers = {"Authorization": f"Bearer {token}"}
    model = c.post("/v1/models", headers=headers, files={"file": ("p.onnx", onnx_model(Path(farm["root"]) / "p.onnx",
                   dynamic=False).read_bytes())}).json()
    ids = [c.post("/v1/jobs", headers=headers, json={"model_id": model["id"], "device_class": CLASS,
                                                     "trial_budget": 4}).json()["id"] for _ in range(5)]
    seen, cursor = [], None
    while True:
        page = c.get("/v1/jobs", headers=headers, params={"limit": 2, **({"cursor": cursor} if cursor else {})}).json()
        seen += [j["id"] for j in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == sorted(ids, reverse=True)
    assert_error(c.get("/v1/jobs", headers=headers, params={"limit": 0}), 422, "invalid_request", "limit")


# -- progress, records, devices ---------------------------------------------------------------


def _statements_of(farm, path: str, token: str) -> list[str]:
    engine = farm["client"].app.state.sessions.kw["bind"]
    seen: list[str] = []

    def note(conn, cursor, statement, parameters, context, executemany):
        seen.append(statement)

    event.listen(engine, "before_cursor_execute", note)
    try:
        r = farm["client"].get(path, headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 200, r.text
    finally:
        event.remove(engine, "before_cursor_execute", note)
    return seen


def test_progress_reads_precomputed_rows_only(farm):
    small = seed_job(farm["sessions"], measurements=10)
    large = seed_job(farm["sessions"], measurements=3000)
    farm["client"].app.state.token_cache.ttl = 60  # as in production: the token is checked once
    try:
        for job in (small, large):  # warm the token cache
            _statements_of(farm, f"/v1/jobs/{job.job_id}", job.team_token)
        few = _statements_of(farm, f"/v1/jobs/{small.job_id}", small.team_token)
        many = _statements_of(farm, f"/v1/jobs/{large.job_id}", large.team_token)
    finally:
        farm["client"].app.state.token_cache.ttl = 0
    assert len(few) == len(many) == 1  # one statement, whatever the number of measurements
    assert "measurements" not in many[0]
    # batches only through the job's open ones (bounded by its fair share; ix_batches_open_by_job)
    assert many[0].count("FROM batches") == 1 and "batches.job_id = jobs.id AND batches.state IN" in many[0]
    body = farm["client"].get(f"/v1/jobs/{large.job_id}", headers={"Authorization": f"Bearer {large.team_token}"}).json()
    assert body["trials_used"] == 3000 and sum(t["trials"] for t in body["tasks"]) == 3000
    assert len(body["curve"]) <= 60 and all(t["best_secs"] for t in body["tasks"])


def test_records_stream_as_a_records_file(farm):
    job = seed_job(farm["sessions"], measurements=1200)
    r = farm["client"].get(f"/v1/jobs/{job.job_id}/records", headers={"Authorization": f"Bearer {job.team_token}"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
    lines = r.text.splitlines()
    assert len(lines) == 1200
    records = [MeasureRecord.from_json(line) for line in lines]
    assert records[0].to_json() == lines[0]  # the records file format, byte for byte
    assert len({r.candidate.key for r in records}) == 1200


def test_devices_list_agents_and_classes(farm):
    with transaction(farm["sessions"]) as s:
        dc = ensure_device_class(s, name=CLASS, target={})
        s.add(Agent(device_class_id=dc.id, name="board-1", state=AgentState.BUSY, capabilities={"cores": 4},
                    measurements_done=7, errors_by_kind={"run_timeout": 2}, last_heartbeat_at=func.now()))
    c = farm["client"]
    devices = c.get("/v1/devices", headers=auth(farm)).json()
    board = next(d for d in devices if d["name"] == "board-1")
    assert board["device_class"] == CLASS and board["state"] == "busy" and board["measurements_done"] == 7
    assert board["errors_by_kind"] == {"run_timeout": 2} and board["last_heartbeat_at"]
    classes = {c["name"]: c for c in c.get("/v1/device-classes", headers=auth(farm)).json()}
    assert classes[CLASS]["agents_online"] >= 1


def test_an_agent_silent_past_the_freshness_window_is_offline_whatever_its_row_says(farm):
    """An agent killed while no lease service ran (farm down, then another farm up on the
    same database) keeps `idle` in its row: it is shown offline and counted out of its
    class's agents online (TUNEFARM_AGENT_FRESH_SECS, 60 s by default)."""
    with transaction(farm["sessions"]) as s:
        dc = ensure_device_class(s, name="stale-class", target={"kind": "llvm", "num-cores": 2})
        s.add(Agent(device_class_id=dc.id, name="gone-board", state=AgentState.IDLE, capabilities={},
                    last_heartbeat_at=func.now() - timedelta(minutes=10)))
    c = farm["client"]
    board = next(d for d in c.get("/v1/devices", headers=auth(farm)).json() if d["name"] == "gone-board")
    assert board["state"] == "offline"
    classes = {c["name"]: c for c in c.get("/v1/device-classes", headers=auth(farm)).json()}
    assert classes["stale-class"]["agents_online"] == 0


def test_a_job_says_when_no_live_agent_serves_its_class(farm):
    job = seed_job(farm["sessions"], measurements=4)
    headers = {"Authorization": f"Bearer {job.team_token}"}
    body = farm["client"].get(f"/v1/jobs/{job.job_id}", headers=headers).json()
    assert body["state"] == "running"
    c = body["device_class"]
    assert body["waiting"] == f"waiting: no agent of class {c} is online (start one: tunefarm agent --device-class {c})"
    with transaction(farm["sessions"]) as s:
        dc_id = s.scalar(select(Job.device_class_id).where(Job.id == job.job_id))
        s.add(Agent(device_class_id=dc_id, name=f"stale-{job.job_id}", state=AgentState.IDLE, capabilities={},
                    last_heartbeat_at=func.now() - timedelta(minutes=10)))
    assert farm["client"].get(f"/v1/jobs/{job.job_id}", headers=headers).json()["waiting"]  # a stale one serves nothing
    with transaction(farm["sessions"]) as s:
        s.add(Agent(device_class_id=dc_id, name=f"live-{job.job_id}", state=AgentState.BUSY, capabilities={},
                    last_heartbeat_at=func.now()))
    assert farm["client"].get(f"/v1/jobs/{job.job_id}", headers=headers).json()["waiting"] is None


def test_a_job_says_which_batch_has_waited_too_long_and_for_what(farm):
    """A build no worker takes (none runs for the class) or a built batch no agent takes
    is named in the job's `waiting` once it has waited TUNEFARM_BATCH_STALL_SECS, and
    counted in /metrics; one that has not waited that long is not."""
    from services.db.models import Batch
    from services.db.states import BatchState

    job = seed_job(farm["sessions"], measurements=4)
    headers = {"Authorization": f"Bearer {job.team_token}"}
    with transaction(farm["sessions"]) as s:
        row = s.get(Job, job.job_id)
        task = s.scalars(select(JobTask).where(JobTask.job_id == job.job_id)).first()
        s.add(Agent(device_class_id=row.device_class_id, name=f"live-stall-{job.job_id}", state=AgentState.IDLE,
                    capabilities={}, last_heartbeat_at=func.now()))
        batch = Batch(job_id=job.job_id, job_task_id=task.id, workload_id=task.workload_id,
                      device_class_id=row.device_class_id, timing={}, build_timeout_secs=60.0, run_timeout_secs=30.0,
                      created_at=func.now() - timedelta(minutes=30))
        s.add(batch)
        s.flush()
        batch_id = batch.id

    def waiting() -> str | None:
        return farm["client"].get(f"/v1/jobs/{job.job_id}", headers=headers).json()["waiting"]

    def stalled(phase: str) -> float:
        text = farm["client"].get("/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("tunefarm_batches_stalled{") and f'waiting_for="{phase}"' in line)

    assert f"batch {batch_id} has waited 30 min for its build" in waiting() and "tunefarm worker" in waiting()
    assert stalled("build") >= 1
    with transaction(farm["sessions"]) as s:
        s.execute(update(Batch).where(Batch.id == batch_id)
                  .values(state=BatchState.READY, ready_at=func.now() - timedelta(minutes=20)))  # fmt: skip
    assert f"batch {batch_id} has been ready for 20 min and no agent" in waiting()
    assert stalled("agent") >= 1
    with transaction(farm["sessions"]) as s:
        s.execute(update(Batch).where(Batch.id == batch_id).values(ready_at=func.now()))
    assert waiting() is None


def test_unknown_routes_and_methods_answer_json(farm):
    assert_error(farm["client"].get("/v2/nothing"), 404, "not_found")
    assert_error(farm["client"].delete("/v1/jobs", headers=auth(farm)), 405, "method_not_allowed")
