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

from services.api import admin  # noqa: E402
from services.api.app import create_app  # noqa: E402
from services.api.settings import ApiSettings  # noqa: E402
from services.db.models import Model  # noqa: E402
from services.db.session import transaction  # noqa: E402

SHAPES = json.dumps({"x": [1, 3, 8, 8]})


@pytest.fixture(scope="module")
def teams(db_sessions) -> dict[str, str]:
    with transaction(db_sessions) as s:
        return {who: admin.issue_team_token(s, team_id=admin.ensure_team(s, name=f"tenants-{who}").id)
                for who in ("a", "b")}


@pytest.fixture(scope="module")
def api(database_url, tmp_path_factory):
    settings = ApiSettings(database_url=database_url, artifact_root=tmp_path_factory.mktemp("artifacts"),
                           token_cache_secs=0)
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
