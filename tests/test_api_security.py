"""The HTTP API under attack, against a real PostgreSQL (a throw-away database for the
module): request bodies over the limit are refused while they stream in (chunked, with a
lying Content-Length, over a real socket) without the rest being read; ONNX external
data naming files outside the upload is refused, naming the tensor and the location,
while a model uploaded with its external data files (as `tunefarm submit` sends it) is
taken in and kept self-contained."""

from __future__ import annotations

import asyncio
import json
import select
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from services.api.app import create_app  # noqa: E402
from services.api.limits import LINGER_BYTES  # noqa: E402
from services.api.settings import ApiSettings  # noqa: E402
from services.db.session import transaction  # noqa: E402
from services.db.teams import ensure_team  # noqa: E402
from services.db.tokens import issue_agent_token, issue_team_token  # noqa: E402

MAX_UPLOAD = 64 * 1024
CHUNK = 16 * 1024
BOUNDARY = "tunefarmboundary"
MULTIPART_HEAD = (
    f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"m.onnx\"\r\n"
    "Content-Type: application/octet-stream\r\n\r\n"
).encode()


@pytest.fixture(scope="module")
def settings(database_url, tmp_path_factory) -> ApiSettings:
    return ApiSettings(
        database_url=database_url,
        artifact_root=tmp_path_factory.mktemp("artifacts"),
        max_upload_bytes=MAX_UPLOAD,
        multipart_overhead_bytes=1024,
        token_cache_secs=0,
        api_allowed_hosts=["127.0.0.1", "testserver", "api"],  # the names the tests reach it by
    )


@pytest.fixture(scope="module")
def team_token(db_sessions) -> str:
    with transaction(db_sessions) as s:
        team = ensure_team(s, name="team-attack")
        return issue_team_token(s, team_id=team.id)


def _limit(settings: ApiSettings) -> int:
    return settings.max_upload_bytes + settings.multipart_overhead_bytes


def _assert_413(status: int, body: bytes) -> None:
    assert status == 413, body[:300]
    assert json.loads(body)["error"]["code"] == "payload_too_large"


# -- streaming in process: how much of the body the application asked for ----------------------


class CountingBody:
    """A request body of `total` bytes that counts how much of it was consumed."""

    def __init__(self, total: int):
        self.total = total
        self.consumed = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield MULTIPART_HEAD
        while self.consumed < self.total:
            self.consumed += CHUNK
            yield b"\0" * CHUNK


def _post_in_process(
    settings: ApiSettings, token: str | None, body: CountingBody, headers: dict[str, str]
) -> httpx.Response:
    async def go() -> httpx.Response:
        app = create_app(settings)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
                return await client.post(
                    "/v1/models",
                    content=body,
                    headers={
                        **({"Authorization": f"Bearer {token}"} if token else {}),
                        "Content-Type": f"multipart/form-data; boundary={BOUNDARY}",
                        **headers,
                    },
                )

    return asyncio.run(go())


def test_a_chunked_body_over_the_limit_is_cut_off_as_it_streams(settings, team_token):
    body = CountingBody(total=256 * MAX_UPLOAD)  # 16 MiB offered, no Content-Length: chunked
    r = _post_in_process(settings, team_token, body, {})
    _assert_413(r.status_code, r.content)
    assert r.headers["connection"] == "close"
    # Read up to the limit, then at most the lingering close's bytes; never the rest.
    assert body.consumed <= _limit(settings) + LINGER_BYTES + 2 * CHUNK < body.total


@pytest.mark.parametrize("declared", ["100", str(10**12)])
def test_a_lying_content_length_does_not_get_a_body_past_the_limit(settings, team_token, declared):
    """Declared small, sent large: cut off at the limit all the same. Declared huge:
    refused before any of the body is read (the linger then drains a bounded amount)."""
    body = CountingBody(total=256 * MAX_UPLOAD)
    r = _post_in_process(settings, team_token, body, {"Content-Length": declared})
    _assert_413(r.status_code, r.content)
    assert body.consumed <= _limit(settings) + LINGER_BYTES + 2 * CHUNK < body.total


@pytest.mark.parametrize("who", ["no token", "unknown token", "agent token"])
@pytest.mark.parametrize("declared", [False, True])
def test_an_unauthenticated_upload_is_refused_before_its_body_is_read(settings, db_sessions, who, declared):
    """A body well within the upload limit, from someone without a team token: refused
    from the headers, the body left unread but for the lingering close's bytes (before,
    the whole form was read and spooled, then the token checked)."""
    big = settings.model_copy(update={"max_upload_bytes": 64 * 1024 * 1024})
    offered = 24 * 1024 * 1024
    with transaction(db_sessions) as s:
        agent = issue_agent_token(s)
    token = {"no token": None, "unknown token": "tft_" + "x" * 43, "agent token": agent}[who]
    body = CountingBody(total=offered)
    headers = {"Content-Length": str(len(MULTIPART_HEAD) + offered)} if declared else {}
    r = _post_in_process(big, token, body, headers)
    status, code = (403, "forbidden") if who == "agent token" else (401, "unauthorized")
    assert r.status_code == status and r.json()["error"]["code"] == code, r.text
    assert r.headers["connection"] == "close"
    assert body.consumed <= LINGER_BYTES + 2 * CHUNK < offered


# -- over a real socket: the server stops reading ----------------------------------------------


@pytest.fixture(scope="module")
def served(settings) -> Iterator[int]:
    """The API on a loopback port (uvicorn in a thread); its port."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(settings), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    yield sock.getsockname()[1]
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


def _send_until_answered(port: int, head: bytes, frames: Iterator[bytes], offered: int) -> tuple[int, bytes]:
    """Send `head` then `frames` until the server answers and closes (or `offered` bytes
    went out); (bytes of body the socket took, the answer)."""
    conn = socket.create_connection(("127.0.0.1", port), timeout=10)
    conn.sendall(head)
    conn.setblocking(False)
    sent, answer, closed = 0, b"", False
    deadline = time.monotonic() + 30
    pending = b""
    while not closed and time.monotonic() < deadline:
        want_write = sent < offered
        readable, writable, _ = select.select([conn], [conn] if want_write else [], [], 1.0)
        if readable:
            try:
                data = conn.recv(65536)
            except ConnectionResetError:
                data = b""
            answer += data
            closed = not data
        if writable and not closed:
            pending = pending or next(frames)
            try:
                n = conn.send(pending)
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                continue
            except BlockingIOError:
                continue
            sent += n
            pending = pending[n:]
    conn.close()
    return sent, answer


def test_over_a_socket_the_server_stops_reading_a_chunked_body(served, settings, team_token):
    offered = 1024 * MAX_UPLOAD  # 64 MiB

    def frames() -> Iterator[bytes]:
        yield b"%x\r\n%s\r\n" % (len(MULTIPART_HEAD), MULTIPART_HEAD)
        while True:
            yield b"%x\r\n%s\r\n" % (CHUNK, b"\0" * CHUNK)

    head = (
        f"POST /v1/models HTTP/1.1\r\nHost: api\r\nAuthorization: Bearer {team_token}\r\n"
        f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\nTransfer-Encoding: chunked\r\n\r\n"
    ).encode()
    sent, answer = _send_until_answered(served, head, frames(), offered)
    status_line, _, rest = answer.partition(b"\r\n")
    headers, _, body = rest.partition(b"\r\n\r\n")
    _assert_413(int(status_line.split()[1]), body)
    assert b"connection: close" in headers.lower()
    # The server closed the connection: what the socket took is the limit, the linger
    # and the kernel's buffers, a fraction of what was offered.
    assert sent < offered // 4, sent


# -- host names (DNS rebinding) and the schema browsers -----------------------------------------


def _default_client(settings: ApiSettings, **changes):
    from fastapi.testclient import TestClient

    fresh = settings.model_copy(update={"api_allowed_hosts": None, **changes})  # the default: this machine's names
    return TestClient(create_app(fresh), base_url="http://localhost:8000")


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example", "[::2]:8000", "a:b"])
def test_a_request_naming_another_host_is_a_400_with_a_json_body(settings, host):
    with _default_client(settings) as client:
        r = client.get("/healthz", headers={"Host": host})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "invalid_host" and "TUNEFARM_API_ALLOWED_HOSTS" in r.json()["error"]["message"]
        assert r.headers["x-frame-options"] == "DENY"  # the security headers are on a refusal too
        r = client.post("/v1/models", headers={"Host": host}, content=b"x" * 1000)  # refused before auth or body
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host"
        for own in ("localhost", "localhost:8000", "127.0.0.1:8000", "[::1]:8000", "LOCALHOST"):
            assert client.get("/healthz", headers={"Host": own}).status_code == 200, own


def test_the_host_names_the_api_answers_to_are_a_setting(settings):
    assert ApiSettings(api_bind="farm.lan:8000").allowed_hosts() == ["localhost", "127.0.0.1", "::1", "farm.lan"]
    assert ApiSettings(api_bind="0.0.0.0:8000").allowed_hosts() == ["localhost", "127.0.0.1", "::1"]  # names none
    assert ApiSettings(api_allowed_hosts="farm.example, *.farm.example").allowed_hosts() == ["farm.example",
                                                                                          "*.farm.example"]  # fmt: skip
    with pytest.raises(ValueError, match="no host name or pattern"):
        ApiSettings(api_allowed_hosts="farm.*")
    with _default_client(settings, api_allowed_hosts=["*.farm.example"]) as client:
        assert client.get("/healthz", headers={"Host": "eu.farm.example"}).status_code == 200
        assert client.get("/healthz", headers={"Host": "localhost"}).status_code == 400  # only what is listed
    with _default_client(settings, api_allowed_hosts=["*"]) as client:
        assert client.get("/healthz", headers={"Host": "evil.example"}).status_code == 200


def test_over_a_socket_a_rebound_host_name_is_refused(served):
    answer = httpx.get(f"http://127.0.0.1:{served}/healthz", headers={"Host": "evil.example"}, timeout=10)
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid_host"
    assert httpx.get(f"http://127.0.0.1:{served}/healthz", timeout=10).status_code == 200


def test_the_schema_browsers_that_load_cdn_scripts_are_off_unless_asked_for(settings):
    with _default_client(settings) as client:
        assert client.get("/docs").status_code == 404 and client.get("/redoc").status_code == 404
        assert client.get("/openapi.json").status_code == 200  # the schema itself loads nothing
    with _default_client(settings, api_docs=True) as client:
        assert client.get("/docs").status_code == 200 and client.get("/redoc").status_code == 200


# -- ONNX external data ------------------------------------------------------------------------


def _stored_files(settings: ApiSettings) -> list[str]:
    root = settings.artifact_root
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _upload(port: int, token: str, model: Path, extra: list | None = None) -> httpx.Response:
    files = [("file", ("model.onnx", model.read_bytes()))] + (extra or [])
    return httpx.post(
        f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {token}"},
        files=files, data={"input_shapes": json.dumps({"x": [1, 3, 8, 8]})}, timeout=600,
    )


def test_a_model_with_its_external_data_is_taken_in_and_kept_self_contained(served, settings, team_token, tmp_path):
    onnx = pytest.importorskip("onnx")
    from test_onnx_external_data import with_external_data

    from tunefarm.models.external_data import external_tensors
    from tunefarm_app.farm_client import ClientSettings, FarmClient

    path = with_external_data(tmp_path / "m", location="weights/tiny.bin")
    client_settings = ClientSettings.load(server=f"http://127.0.0.1:{served}", token=team_token)
    with FarmClient(client_settings) as client:  # what `tunefarm submit` does: the side files go along
        model = client.upload_model(path, {"x": [1, 3, 8, 8]})
    assert [t["position"] for t in model["tasks"]] == [0, 1, 2, 3]
    kept = onnx.load(str(settings.artifact_root / "models" / f"{model['onnx_sha256']}.onnx"), load_external_data=False)
    assert not list(external_tensors(kept)) and {t.name for t in kept.graph.initializer} == {"w1", "w2"}
    assert not any("tiny.bin" in f for f in _stored_files(settings))


@pytest.mark.parametrize("location", ["../../etc/passwd", "/etc/passwd", "weights/../../../etc/passwd"])
def test_external_data_outside_the_upload_is_refused_naming_tensor_and_location(
    served, settings, team_token, tmp_path, location
):
    pytest.importorskip("onnx")
    from test_onnx_external_data import relocated, with_external_data

    path = relocated(with_external_data(tmp_path / "m"), location)
    before = _stored_files(settings)
    r = _upload(served, team_token, path, [("external_data", ("tiny.onnx.data", (tmp_path / "m" / "tiny.onnx.data").read_bytes()))])
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_model"
    assert "'w1'" in error["message"] and repr(location) in error["message"], error["message"]
    assert "root:" not in r.text  # nothing of /etc/passwd
    assert _stored_files(settings) == before


def test_bad_external_data_parts_get_clear_errors(served, settings, team_token, tmp_path):
    pytest.importorskip("onnx")
    from test_onnx_external_data import with_external_data

    path = with_external_data(tmp_path / "m")
    data = (tmp_path / "m" / "tiny.onnx.data").read_bytes()
    before = _stored_files(settings)
    missing = _upload(served, team_token, path)
    assert missing.status_code == 422 and "'tiny.onnx.data'" in missing.json()["error"]["message"]
    assert "external_data part" in missing.json()["error"]["message"]
    for name, words in (("../tiny.onnx.data", "'..'"), ("/abs/tiny.onnx.data", "absolute"), ("./", "not a file name")):
        r = _upload(served, team_token, path, [("external_data", (name, data))])
        assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_request", r.text
        assert words in r.json()["error"]["message"]
    for second in ("tiny.onnx.data", "./tiny.onnx.data", "tiny.onnx.data/"):  # one file, however spelled
        twice = _upload(served, team_token, path, [("external_data", ("tiny.onnx.data", data)),
                                                   ("external_data", (second, data))])
        assert twice.status_code == 422 and "twice" in twice.json()["error"]["message"], twice.text
    assert _stored_files(settings) == before


# -- revoking tokens ----------------------------------------------------------------------------


def test_a_revoked_team_token_is_refused_at_once_though_the_api_trusts_tokens_for_an_hour(
    settings, database_url, db_sessions, capsys
):
    from fastapi.testclient import TestClient

    from tunefarm_app.cli import main

    with transaction(db_sessions) as s:
        team = ensure_team(s, name="team-revoked-at-once")
        plain = issue_team_token(s, team_id=team.id, label="laptop")
        kept = issue_team_token(s, team_id=team.id, label="ci")
    with TestClient(create_app(settings.model_copy(update={"token_cache_secs": 3600}))) as client:
        assert client.app.state.token_cache.listener.wait_connected(10)
        headers = {"Authorization": f"Bearer {plain}"}
        assert client.get("/v1/jobs", headers=headers).status_code == 200  # trusted for an hour from now
        assert main(["farm", "token", "revoke", plain[:12], "--database-url", database_url]) == 0
        assert capsys.readouterr().out.startswith("revoked    token ")
        deadline = time.monotonic() + 10  # the notification's way: milliseconds, not the cache's hour
        while (r := client.get("/v1/jobs", headers=headers)).status_code == 200:
            assert time.monotonic() < deadline, "a revoked token was still accepted"
            time.sleep(0.05)
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
        assert "revoked" in r.json()["error"]["message"]
        assert client.get("/v1/jobs", headers={"Authorization": f"Bearer {kept}"}).status_code == 200
    assert main(["farm", "token", "list", "--team", "team-revoked-at-once", "--database-url", database_url]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert len(listed) == 2
    assert "laptop" in listed[0] and "revoked" in listed[0] and plain[:12] in listed[0]
    assert "ci" in listed[1] and "active" in listed[1]
    for ref, words in (("tft_", "tokens"), ("nonsense", "not a token id"), ("999999", "no token")):
        assert main(["farm", "token", "revoke", ref, "--database-url", database_url]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and words in err, err


# -- fuzzing from the OpenAPI schema -----------------------------------------------------------

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, Phase  # noqa: E402
from hypothesis import settings as hypothesis_settings  # noqa: E402

FUZZ_EXAMPLES = 20
"""Examples per operation: the whole run stays within a few seconds."""


@pytest.fixture(scope="module")
def fuzzed_team(db_sessions) -> str:
    """A team with a model and a running job (ids the fuzzer's small integers meet); its token."""
    from tunefarm_app.bench.farm_progress import seed_job

    return seed_job(db_sessions, measurements=4, tasks=2, curve_points=3).team_token


@pytest.fixture(scope="module")
def api_schema(served):
    return schemathesis.openapi.from_url(f"http://127.0.0.1:{served}/openapi.json")


fuzz_schema = schemathesis.pytest.from_fixture("api_schema")


@fuzz_schema.parametrize()
@hypothesis_settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)
def test_fuzzing_every_operation_from_the_schema_gets_no_server_error(case, fuzzed_team):
    """Every operation, with generated valid and invalid inputs and the team's token: no
    5xx, and every response conforms to the schema (status, content type, headers, body).
    Not checked: that a schema-valid request is accepted (an empty file is a valid
    `file` and not a model; a job names a model and a class that must exist), and that
    a query parameter the operation does not have is refused (it is ignored)."""
    case.call_and_validate(
        headers={"Authorization": f"Bearer {fuzzed_team}"},
        timeout=60,
        excluded_checks=[schemathesis.checks.positive_data_acceptance, schemathesis.checks.negative_data_rejection],
    )
