"""gRPC between agents and the lease service over TLS, against the real lease service on
a throw-away database: a CA, a server certificate and an agent's client certificate
are made for the run (the openssl command). An agent registers and leases over TLS; a
plaintext client, a client trusting another CA, and (with mutual TLS) an agent without
a client certificate are refused in the handshake; an agent told to use TLS never falls
back to plaintext; settings that cannot work are one line and exit status 2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from sqlalchemy import select

from services.agent.channel import open_channel
from services.agent.cli import main as agent_main
from services.agent.settings import AgentSettings
from services.db import tokens
from services.db.models import Agent, DeviceClass
from services.db.session import transaction
from services.db.states import TokenKind
from services.lease.cli import main as lease_main
from services.lease.server import LeaseServer, make_server
from services.lease.settings import LeaseServiceSettings
from services.protocol import wire
from services.protocol.errors import BadRequest
from services.protocol.generated import measurer_pb2 as pb
from services.protocol.generated import measurer_pb2_grpc as pb_grpc

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


@dataclass(frozen=True)
class Pki:
    ca: Path  # the farm's CA certificate
    server_cert: Path  # for 127.0.0.1 and localhost, signed by the CA
    server_key: Path
    agent_cert: Path  # a client certificate signed by the CA
    agent_key: Path
    other_ca: Path  # a CA that signed nothing here


def _openssl(*args: str | Path, cwd: Path) -> None:
    subprocess.run(["openssl", *map(str, args)], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(d: Path, name: str) -> tuple[Path, Path]:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "1", "-subj", f"/CN={name}",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)
    return d / f"{name}.pem", d / f"{name}.key"


def _signed(d: Path, name: str, ca: tuple[Path, Path], ext: str) -> tuple[Path, Path]:
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    (d / f"{name}.ext").write_text(ext)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", ca[0], "-CAkey", ca[1], "-CAcreateserial",
             "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext", cwd=d)
    return d / f"{name}.pem", d / f"{name}.key"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca = _ca(d, "farm-ca")
    server = _signed(d, "lease-service", ca, "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    agent = _signed(d, "agent", ca, "extendedKeyUsage=clientAuth\n")
    other = _ca(d, "other-ca")
    return Pki(ca[0], *server, *agent, other[0])


def _server(database_url: str, db_sessions, tmp_path: Path, **tls) -> Iterator[LeaseServer]:
    settings = LeaseServiceSettings(database_url=database_url, lease_bind="127.0.0.1:0",
                                    artifact_root=tmp_path, lease_wait_secs=0.2, **tls)
    server = make_server(settings, sessions=db_sessions)
    server.start()
    try:
        yield server
    finally:
        server.stop(grace=0)


@pytest.fixture(scope="module")
def tls_server(database_url, db_sessions, pki, tmp_path_factory) -> Iterator[LeaseServer]:
    yield from _server(database_url, db_sessions, tmp_path_factory.mktemp("a"),
                       tls_cert_file=pki.server_cert, tls_key_file=pki.server_key)


@pytest.fixture(scope="module")
def mtls_server(database_url, db_sessions, pki, tmp_path_factory) -> Iterator[LeaseServer]:
    yield from _server(database_url, db_sessions, tmp_path_factory.mktemp("b"), tls_cert_file=pki.server_cert,
                       tls_key_file=pki.server_key, tls_client_ca_file=pki.ca)


@pytest.fixture(scope="module")
def plain_server(database_url, db_sessions, tmp_path_factory) -> Iterator[LeaseServer]:
    yield from _server(database_url, db_sessions, tmp_path_factory.mktemp("c"))


@pytest.fixture
def ready_batch(db_sessions):
    """A device class with a ready batch (test_db's farm), and an agent token."""
    from test_db import make_farm

    farm = make_farm(db_sessions, batches=1, candidates=2, agents=0)
    with transaction(db_sessions) as s:
        _, token = tokens.issue_token(s, kind=TokenKind.AGENT, label="tls")
        class_name = s.get(DeviceClass, farm.device_class_id).name
    return farm, class_name, token


def _register_with_secret(channel: grpc.Channel, token: str, class_name: str, name: str) -> tuple[int, str]:
    stub = pb_grpc.AgentServiceStub(channel)
    caps = pb.Capabilities(arch=os.uname().machine, target_json=json.dumps({"kind": "llvm"}))
    request = pb.RegisterRequest(name=name, device_class=class_name, capabilities=caps)
    resp = stub.Register(request, metadata=wire.auth_metadata(token), timeout=10)
    return resp.agent_id, resp.agent_secret


def _register(channel: grpc.Channel, token: str, class_name: str, name: str) -> int:
    return _register_with_secret(channel, token, class_name, name)[0]


def _settings(**kw) -> AgentSettings:
    """An agent's settings for these tests, which never load a kernel."""
    return AgentSettings(accept_unsigned_code=True, **kw)


def _refused(channel: grpc.Channel, token: str, class_name: str, name: str) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        _register(channel, token, class_name, name)
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE, err.value.details()
    return err.value


def _registered(db_sessions, name: str) -> bool:
    with transaction(db_sessions) as s:
        return s.scalar(select(Agent.id).where(Agent.name == name)) is not None


def test_an_agent_registers_and_leases_over_tls(tls_server, pki, ready_batch, db_sessions):
    farm, class_name, token = ready_batch
    settings = _settings(server=tls_server.address, token=token, tls_ca=pki.ca)
    assert settings.uses_tls
    with open_channel(settings) as channel:
        agent_id, secret = _register_with_secret(channel, token, class_name, f"{class_name}-tls")
        stub = pb_grpc.AgentServiceStub(channel)
        metadata = wire.agent_metadata(token, secret)
        leased = stub.LeaseBatch(pb.LeaseBatchRequest(agent_id=agent_id), metadata=metadata, timeout=10)
    assert leased.batch.batch_id == farm.batch_ids[0]
    assert [c.batch_candidate_id for c in leased.batch.candidates] == farm.candidate_ids[farm.batch_ids[0]]


def test_plaintext_and_untrusted_clients_are_refused_in_the_handshake(tls_server, pki, ready_batch, db_sessions):
    _, class_name, token = ready_batch
    with grpc.insecure_channel(tls_server.address) as channel:
        _refused(channel, token, class_name, f"{class_name}-plain")
    other = _settings(server=tls_server.address, token=token, tls_ca=pki.other_ca)
    with open_channel(other) as channel:
        _refused(channel, token, class_name, f"{class_name}-other-ca")
    wrong_name = _settings(server=tls_server.address, token=token, tls_ca=pki.ca, tls_server_name="elsewhere.example")
    with open_channel(wrong_name) as channel:
        _refused(channel, token, class_name, f"{class_name}-wrong-name")
    assert not any(_registered(db_sessions, f"{class_name}-{n}") for n in ("plain", "other-ca", "wrong-name"))


def test_an_agent_told_to_use_tls_never_speaks_plaintext(plain_server, pki, ready_batch, db_sessions):
    _, class_name, token = ready_batch
    with open_channel(_settings(server=plain_server.address, token=token, tls_ca=pki.ca)) as channel:
        _refused(channel, token, class_name, f"{class_name}-tls-to-plain")
    assert not _registered(db_sessions, f"{class_name}-tls-to-plain")
    with grpc.insecure_channel(plain_server.address) as channel:  # the same server does answer plaintext
        assert _register(channel, token, class_name, f"{class_name}-plain-ok") > 0


def test_mutual_tls_wants_the_agents_certificate(mtls_server, pki, ready_batch, db_sessions):
    _, class_name, token = ready_batch
    without = _settings(server=mtls_server.address, token=token, tls_ca=pki.ca)
    with open_channel(without) as channel:
        _refused(channel, token, class_name, f"{class_name}-no-cert")
    with_cert = _settings(server=mtls_server.address, token=token, tls_ca=pki.ca,
                              tls_cert=pki.agent_cert, tls_key=pki.agent_key)
    with open_channel(with_cert) as channel:
        assert _register(channel, token, class_name, f"{class_name}-mtls") > 0
    assert not _registered(db_sessions, f"{class_name}-no-cert")


def test_tls_settings_that_cannot_work_are_one_line(pki, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TUNEFARM_TLS_CERT_FILE", raising=False)
    cases = [
        (["--bind", "127.0.0.1:0", "--tls-cert", str(pki.server_cert)], "both a certificate and its key"),
        (["--bind", "127.0.0.1:0", "--tls-client-ca", str(pki.ca)], "needs the server's certificate"),
        (["--bind", "127.0.0.1:0", "--tls-cert", str(tmp_path / "nope.pem"), "--tls-key", str(pki.server_key)],
         "cannot read"),
    ]
    for argv, words in cases:
        assert lease_main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and words in err, err
    with pytest.raises(BadRequest, match="--tls-key"):
        _settings(server="h:1", token="tfa_x", tls_cert=pki.agent_cert)
    monkeypatch.setenv("TUNEFARM_AGENT_TOKEN", "tfa_x")
    argv = ["--server", "127.0.0.1:1", "--tls-ca", str(tmp_path / "nope.pem"), "--accept-unsigned-code",
            "--work-dir", str(tmp_path / "agent")]  # fmt: skip
    assert agent_main(argv) == 2
    assert "cannot read the CA certificate" in capsys.readouterr().out
    assert LeaseServiceSettings(tls_cert_file="", tls_key_file="").tls is False  # `VAR=` in a compose file: unset
