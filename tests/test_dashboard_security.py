"""The dashboard's login against other sites (real PostgreSQL, in process): a form post
from another origin is refused and changes nothing, the cookie holds a server-side
session id (never the team token) that logging out ends, and every response carries the
security headers. tests/test_dashboard.py drives the same in a real browser."""

from __future__ import annotations

import hashlib
from datetime import timedelta

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("jinja2")

from fastapi.testclient import TestClient  # noqa: E402
from sqlalchemy import func, select, update  # noqa: E402

from services.api.app import create_app  # noqa: E402
from services.api.routers.dashboard import COOKIE  # noqa: E402
from services.api.settings import ApiSettings  # noqa: E402
from services.db.models import DashboardSession, Token  # noqa: E402
from services.db.session import transaction  # noqa: E402
from services.db.teams import ensure_team  # noqa: E402
from services.db.tokens import issue_team_token  # noqa: E402

OWN = "http://testserver"
EVIL = "https://evil.example"
SECURITY_HEADERS = ("content-security-policy", "x-frame-options", "x-content-type-options", "referrer-policy")


@pytest.fixture(scope="module")
def client(database_url, tmp_path_factory):
    settings = ApiSettings(database_url=database_url, artifact_root=tmp_path_factory.mktemp("artifacts"),
                           token_cache_secs=0, ui_trusted_origins=["https://farm.example"],
                           api_allowed_hosts=["testserver"], api_docs=True)
    with TestClient(create_app(settings), follow_redirects=False) as c:
        yield c


@pytest.fixture
def token(db_sessions) -> str:
    with transaction(db_sessions) as s:
        team = ensure_team(s, name="dashboard-security")
        return issue_team_token(s, team_id=team.id)


def sessions_stored(db_sessions) -> int:
    with transaction(db_sessions) as s:
        return s.scalar(select(func.count()).select_from(DashboardSession))


def login(client, token: str, **headers) -> object:
    client.cookies.clear()
    return client.post("/ui/login", data={"token": token}, headers=headers)


@pytest.mark.parametrize(
    "headers",
    [{"Origin": EVIL}, {"Origin": "null"}, {"Referer": f"{EVIL}/page"}, {}, {"Origin": EVIL, "Referer": f"{OWN}/ui"}],
    ids=["origin", "null-origin", "referer", "neither", "origin-wins"],
)
def test_a_cross_site_login_is_refused_and_opens_no_session(client, token, db_sessions, headers):
    before = sessions_stored(db_sessions)
    r = login(client, token, **headers)
    assert r.status_code == 403, r.text
    assert "refused" in r.text and COOKIE not in r.headers.get("set-cookie", "")
    assert sessions_stored(db_sessions) == before


@pytest.mark.parametrize("headers", [{"Origin": OWN}, {"Referer": f"{OWN}/ui/login"}, {"Origin": "https://farm.example"}])
def test_a_login_from_this_site_opens_a_session_whose_cookie_is_not_the_token(client, token, db_sessions, headers):
    r = login(client, token, **headers)
    assert r.status_code == 303 and r.headers["location"] == "/ui/jobs", r.text
    session_id = client.cookies[COOKIE]
    assert token not in session_id and session_id not in token
    set_cookie = r.headers["set-cookie"].lower()
    assert "httponly" in set_cookie and "samesite=strict" in set_cookie and "path=/ui" in set_cookie
    assert "secure" not in set_cookie  # plain http here
    with transaction(db_sessions) as s:
        hashes = set(s.scalars(select(DashboardSession.session_hash)))
    assert hashlib.sha256(session_id.encode()).hexdigest() in hashes  # stored as its hash only
    assert session_id not in hashes
    assert client.get("/ui/jobs").status_code == 200


def test_logging_out_ends_the_session_and_a_copied_cookie_with_it(client, token, db_sessions):
    login(client, token, Origin=OWN)
    session_id = client.cookies[COOKIE]
    assert client.get("/ui/jobs").status_code == 200
    refused = client.post("/ui/logout", headers={"Origin": EVIL})  # another site cannot log us out
    assert refused.status_code == 403 and client.get("/ui/jobs").status_code == 200
    r = client.post("/ui/logout", headers={"Origin": OWN})
    assert r.status_code == 303 and r.headers["location"] == "/ui/login"
    client.cookies.clear()
    client.cookies.set(COOKIE, session_id, path="/ui")  # the cookie, kept by someone
    again = client.get("/ui/jobs")
    assert again.status_code == 303 and again.headers["location"] == "/ui/login"
    with transaction(db_sessions) as s:
        left = s.scalar(select(func.count()).where(
            DashboardSession.session_hash == hashlib.sha256(session_id.encode()).hexdigest()))
    assert left == 0


def test_revoking_the_token_ends_its_sessions(client, token, db_sessions):
    login(client, token, Origin=OWN)
    assert client.get("/ui/jobs").status_code == 200
    with transaction(db_sessions) as s:
        s.execute(update(Token).where(Token.token_hash == hashlib.sha256(token.encode()).hexdigest())
                  .values(revoked_at=func.now()))
    assert client.get("/ui/jobs").status_code == 303


def test_an_expired_session_is_over(client, token, db_sessions):
    login(client, token, Origin=OWN)
    session_hash = hashlib.sha256(client.cookies[COOKIE].encode()).hexdigest()
    assert client.get("/ui/jobs").status_code == 200
    with transaction(db_sessions) as s:
        s.execute(update(DashboardSession).where(DashboardSession.session_hash == session_hash)
                  .values(expires_at=func.now() - timedelta(seconds=1)))
    assert client.get("/ui/jobs").status_code == 303
    login(client, token, Origin=OWN)  # a new login clears the expired rows out
    with transaction(db_sessions) as s:
        assert s.scalar(select(func.count()).where(DashboardSession.session_hash == session_hash)) == 0


def test_the_cookie_is_secure_over_https(database_url, tmp_path, token):
    settings = ApiSettings(database_url=database_url, api_allowed_hosts=["testserver"], artifact_root=tmp_path, token_cache_secs=0)
    with TestClient(create_app(settings), base_url="https://testserver", follow_redirects=False) as c:
        r = c.post("/ui/login", data={"token": token}, headers={"Origin": "https://testserver"})
        assert r.status_code == 303 and "secure" in r.headers["set-cookie"].lower()


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("GET", "/healthz", 200), ("GET", "/v1/jobs", 401), ("GET", "/ui/login", 200), ("GET", "/ui/jobs", 303),
     ("GET", "/openapi.json", 200), ("GET", "/nowhere", 404), ("POST", "/ui/login", 403), ("GET", "/docs", 200)],
)
def test_every_response_carries_the_security_headers(client, method, path, status):
    client.cookies.clear()
    r = client.request(method, path)
    assert r.status_code == status
    for name in SECURITY_HEADERS:
        assert r.headers.get(name), (path, name)
    assert r.headers["x-frame-options"] == "DENY" and r.headers["x-content-type-options"] == "nosniff"
    assert "frame-ancestors 'none'" in r.headers["content-security-policy"]
    if path.startswith("/ui"):
        assert "script-src" not in r.headers["content-security-policy"]  # default-src 'none': no script at all
        assert r.headers["referrer-policy"] == "same-origin"
