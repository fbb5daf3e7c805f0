"""`GET /metrics` against a farm in a known state (real PostgreSQL and Redis): every value
the exposition reports is checked against what the farm's functions wrote, and the
optional metrics token is enforced."""

from __future__ import annotations

import uuid

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from farm_state import seed_farm  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from services.api.app import create_app  # noqa: E402
from services.api.settings import ApiSettings  # noqa: E402
from services.common.queues import BUILD_JOB, build_queue_name  # noqa: E402
from services.worker.settings import WorkerSettings  # noqa: E402


@pytest.fixture(scope="module")
def scraped(database_url, db_sessions, redis_conn, tmp_path_factory):
    import rq

    state = seed_farm(db_sessions)
    prefix = f"tfmetrics{uuid.uuid4().hex[:8]}"
    queue = rq.Queue(build_queue_name(state.device_class, prefix), connection=redis_conn)
    for i in range(3):  # three builds waiting
        queue.enqueue_call(BUILD_JOB, args=(i,), job_id=f"{prefix}-{i}")
    settings = ApiSettings(database_url=database_url, api_allowed_hosts=["testserver"], artifact_root=tmp_path_factory.mktemp("art"),
                           redis_url=WorkerSettings().redis_url, queue_prefix=prefix, lease_secs=30,
                           token_cache_secs=0)
    try:
        with TestClient(create_app(settings)) as client:
            response = client.get("/metrics")
            yield state, response
    finally:
        for key in redis_conn.scan_iter(f"*{prefix}*"):
            redis_conn.delete(key)


def samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_report_the_farm_state(scraped):
    state, response = scraped
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    got = samples(response.text)
    dc = ("device_class", state.device_class)

    def value(name, **labels):
        return got[(name, tuple(sorted({**dict([dc]), **labels}.items())))]

    assert value("tunefarm_build_queue_depth") == 3
    assert got[("tunefarm_redis_up", ())] == 1
    assert value("tunefarm_batches", state="ready") == state.queued_batches
    assert value("tunefarm_batches", state="proposed") == state.proposed_batches
    assert value("tunefarm_batches", state="leased") == 0
    assert value("tunefarm_leases_active") == 0
    assert value("tunefarm_agents", state="idle") == 2
    assert value("tunefarm_agents_alive") == 1  # the silent one last heartbeat an hour ago
    assert value("tunefarm_measurements_total") == state.measured_by_alive == 7
    errors = {}
    for per_task in state.errors_by_task:
        for kind, n in per_task.items():
            errors[kind] = errors.get(kind, 0) + n
    assert errors == {"run_error": 2, "run_timeout": 1}
    for kind, n in errors.items():
        assert value("tunefarm_measurement_errors_total", kind=kind) == n
    assert got[("tunefarm_jobs", (("state", "running"),))] >= 1
    assert got[("tunefarm_jobs", (("state", "queued"),))] >= 1


def test_metrics_without_redis_still_report_the_database(database_url, db_sessions, tmp_path):
    state = seed_farm(db_sessions)
    settings = ApiSettings(database_url=database_url, api_allowed_hosts=["testserver"], artifact_root=tmp_path, redis_url="redis://127.0.0.1:1/0")
    with TestClient(create_app(settings)) as client:
        got = samples(client.get("/metrics").text)
    assert got[("tunefarm_redis_up", ())] == 0
    assert got[("tunefarm_agents_alive", (("device_class", state.device_class),))] == 1
    assert not any(name == "tunefarm_build_queue_depth" for name, _ in got)


def test_metrics_token_is_enforced_when_set(database_url, tmp_path):
    settings = ApiSettings(database_url=database_url, api_allowed_hosts=["testserver"], artifact_root=tmp_path, metrics_token="s3cret",
                           redis_url="redis://127.0.0.1:1/0")
    with TestClient(create_app(settings)) as client:
        for header in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
            r = client.get("/metrics", headers=header)
            assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized", r.text
        assert client.get("/metrics", headers={"Authorization": "Bearer s3cret"}).status_code == 200


def test_a_non_ascii_metrics_token_is_a_401_not_a_500(database_url, tmp_path):
    settings = ApiSettings(database_url=database_url, api_allowed_hosts=["testserver"], artifact_root=tmp_path, metrics_token="s3cret-\u00e9t\u00e9",
                           redis_url="redis://127.0.0.1:1/0")
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        for given in ("Bearer \u00e9t\u00e9".encode("latin-1"), "Bearer s3cret-\u00e9t\u00e9".encode()[:-1] + b"\xff",
                      b"Bearer \xc3\xa9\xe2\x82\xac"):
            r = client.get("/metrics", headers=[(b"authorization", given)])
            assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized", (given, r.text)
        # the right token, sent as its UTF-8 bytes, is let in
        r = client.get("/metrics", headers=[(b"authorization", "Bearer s3cret-\u00e9t\u00e9".encode())])
        assert r.status_code == 200, r.text


def test_metrics_is_in_the_openapi_schema_as_text(database_url, tmp_path):
    with TestClient(create_app(ApiSettings(database_url=database_url, api_allowed_hosts=["testserver"], artifact_root=tmp_path))) as client:
        schema = client.get("/openapi.json").json()
    op = schema["paths"]["/metrics"]["get"]
    assert op["responses"]["200"]["content"]["text/plain"]["schema"] == {"type": "string"}
    assert "401" in op["responses"]
    assert not any(p.startswith("/ui") for p in schema["paths"])  # the dashboard's pages are not API
