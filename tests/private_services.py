"""A Redis and a PostgreSQL of the test's own, for tests that kill or restart them (the
machine's shared servers are never touched).

- `PrivateRedis`: `redis-server` on a free loopback port with a password of its own and
  no persistence (`--save "" --appendonly no`): `kill()` then `start()` is a Redis that
  lost all its data. With `tls=True` it speaks TLS only (a CA and a certificate for
  127.0.0.1 made with the openssl command) and its `url` is `rediss://...` naming the CA.
- `PrivatePostgres`: a cluster made with `initdb` in a temporary directory, run with
  `pg_ctl` on a free port (trust authentication, user postgres, fsync off);
  `restart()` is an immediate shutdown (every connection dropped, crash recovery) and a
  start. As root the binaries run as the `postgres` user (initdb refuses root).

Both raise `ServiceMissing` when their binaries are not installed.
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

PG_BIN = Path(os.environ.get("TUNEFARM_TEST_PG_BIN", "/usr/lib/postgresql/15/bin"))


class ServiceMissing(RuntimeError):
    """The server's binaries are not installed here."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, timeout: float, alive) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"the server on port {port} exited while starting")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on port {port} after {timeout:.0f} s")


class PrivateRedis:
    def __init__(self, directory: Path, *, tls: bool = False):
        binary = shutil.which("redis-server")
        if binary is None:
            raise ServiceMissing("redis-server is not installed")
        if tls and shutil.which("openssl") is None:
            raise ServiceMissing("the openssl command is not installed (for a TLS Redis)")
        self.binary = binary
        self.directory = directory
        self.port = free_port()
        self.password = secrets.token_urlsafe(24)
        self.tls = tls
        self.proc: subprocess.Popen[bytes] | None = None
        if tls:
            _make_certificates(directory)

    @property
    def url(self) -> str:
        if self.tls:
            return f"rediss://:{self.password}@127.0.0.1:{self.port}/0?ssl_ca_certs={self.directory / 'ca.pem'}"
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    def _listen(self) -> list[str]:
        if not self.tls:
            return ["--port", str(self.port)]
        d = self.directory
        return ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(d / "redis.pem"),
                "--tls-key-file", str(d / "redis.key"), "--tls-ca-cert-file", str(d / "ca.pem"),
                "--tls-auth-clients", "no"]  # fmt: skip

    def start(self) -> None:
        log = open(self.directory / "redis.log", "ab")  # noqa: SIM115 (the server keeps it)
        self.proc = subprocess.Popen(
            [self.binary, *self._listen(), "--bind", "127.0.0.1", "--requirepass", self.password, "--save", "",
             "--appendonly", "no", "--dir", str(self.directory)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        log.close()
        _wait_port(self.port, 30, lambda: self.proc is not None and self.proc.poll() is None)

    def kill(self) -> None:
        """SIGKILL: the server and every key in it are gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self.proc = None


def _make_certificates(d: Path) -> None:
    """ca.pem, and redis.pem/redis.key for 127.0.0.1 signed by it."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *ec, "-days", "2", "-keyout", "ca.key", "-out", "ca.pem", "-subj", "/CN=test CA",
            "-addext", "basicConstraints=critical,CA:TRUE")  # fmt: skip
    openssl("req", *ec, "-keyout", "redis.key", "-out", "redis.csr", "-subj", "/CN=127.0.0.1")
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl("x509", "-req", "-in", "redis.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-days", "2",
            "-extfile", "san.ext", "-out", "redis.pem")  # fmt: skip


class PrivatePostgres:
    def __init__(self, directory: Path):
        if not (PG_BIN / "initdb").is_file():
            raise ServiceMissing(f"PostgreSQL's initdb is not in {PG_BIN}")
        self.directory = directory
        self.data = directory / "data"
        self.port = free_port()
        self._as_postgres = os.geteuid() == 0
        if self._as_postgres:
            owner = pwd.getpwnam("postgres")
            os.chown(directory, owner.pw_uid, owner.pw_gid)

    @property
    def url(self) -> str:
        return f"postgresql+psycopg2://postgres@127.0.0.1:{self.port}/tunefarm"

    def _run(self, *argv: str) -> None:
        command = [str(PG_BIN / argv[0]), *argv[1:]]
        if self._as_postgres:
            command = ["runuser", "-u", "postgres", "--", *command]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=120)

    def _options(self) -> str:
        return f"-p {self.port} -k {self.directory} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"

    def init(self) -> None:
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-sync")

    def start(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-o", self._options(), "-l", str(self.directory / "log"), "-w", "start")

    def stop(self) -> None:
        """An immediate shutdown: every session is dropped at once, as in a crash."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def restart(self) -> None:
        self.stop()
        self.start()

    def remove(self) -> None:
        try:
            self.stop()
        except subprocess.CalledProcessError:
            pass  # not running
        shutil.rmtree(self.directory, ignore_errors=True)


def private_directory(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix))
