"""The Redis of a farm that `farm up` starts: its own, or one it is given.

Whoever can talk to the farm's Redis can write into its build queues (the workers run
nothing but build jobs, `services.worker.build_job`, yet a stranger could still empty,
flood or reorder them). So a farm's Redis always wants a password:

- by default `farm up` starts its own `redis-server` as one of the farm's processes,
  bound to loopback on a free port, with a generated password (`requirepass`) and no
  persistence (the scheduler enqueues again the builds a restarted Redis lost). Its
  configuration, password included, is `D/redis/redis.conf` (mode 0600, in a 0700
  directory), never the command line; the URL with the password is in `D/farm.json`
  (0600) and the environment of the farm's processes;
- given `--redis-url` (or TUNEFARM_REDIS_URL), that Redis is used if the URL carries a
  password (`redis://:PASSWORD@HOST:PORT/0`, or `rediss://...` for TLS, e.g.
  `?ssl_ca_certs=/path/ca.pem`); one without is refused unless the operator says
  `--redis-without-password`.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tunefarm.errors import UsageError

REDIS_PROCESS = "redis"
"""The name of the farm's own Redis among its processes (and of its log)."""

REDIS_DIR = "redis"
"""Its directory in the state dir: redis.conf (0600) and nothing else (no persistence)."""

READY_TIMEOUT_SECS = 30.0
"""How long `farm up` waits for its own Redis to answer."""


@dataclass(frozen=True)
class OwnRedis:
    """A `redis-server` for one farm: loopback, a port, a password."""

    directory: Path
    port: int
    password: str

    @classmethod
    def create(cls, state_dir: Path) -> OwnRedis:
        """A fresh password and a free port; the configuration file written (0600)."""
        directory = (state_dir / REDIS_DIR).resolve()
        directory.mkdir(mode=0o700, exist_ok=True)
        os.chmod(directory, 0o700)
        own = cls(directory, _free_port(), secrets.token_urlsafe(32))
        own.write_config()
        return own

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    @property
    def config_file(self) -> Path:
        return self.directory / "redis.conf"

    def write_config(self) -> None:
        # Whoever learns the password can still not wipe or stop the queues, reconfigure
        # the server (CONFIG SET dir/dbfilename writes files) or read every key at once.
        disabled = [f'rename-command {c} ""' for c in DISABLED_COMMANDS]
        lines = [
            "bind 127.0.0.1",
            f"port {self.port}",
            "protected-mode yes",
            f"requirepass {self.password}",
            'save ""',
            "appendonly no",
            f'dir "{self.directory}"',
            "daemonize no",
            *disabled,
        ]
        fd = os.open(self.config_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")

    def command(self) -> list[str]:
        binary = shutil.which("redis-server")
        if binary is None:
            raise UsageError(
                "farm up starts its own Redis and needs redis-server on the PATH; "
                "or give it one: --redis-url redis://:PASSWORD@HOST:PORT/0"
            )
        return [binary, str(self.config_file)]


DISABLED_COMMANDS = ("FLUSHALL", "FLUSHDB", "CONFIG", "SHUTDOWN", "DEBUG", "MODULE", "REPLICAOF", "SLAVEOF",
                     "MIGRATE", "SAVE", "BGSAVE", "BGREWRITEAOF")  # fmt: skip
"""Administration commands farm up's own Redis does not have (`rename-command X ""`): RQ
and the farm use none of them; `farm down` stops Redis with a signal."""


def has_password(url: str) -> bool:
    """Whether a Redis URL carries a password (`UsageError` for one that is not a URL)."""
    from redis.connection import parse_url

    try:
        return bool(parse_url(url).get("password"))
    except ValueError as exc:
        raise UsageError(f"--redis-url: {exc}") from None


def check_given(url: str, *, without_password: bool) -> None:
    """`UsageError` unless a given Redis answers, and has a password or may go without."""
    import redis

    if not has_password(url) and not without_password:
        raise UsageError(
            f"the Redis at {redact(url)} has no password in its URL: anyone who reaches it can write into the "
            "farm's build queues; give redis://:PASSWORD@HOST:PORT/0 (rediss:// for TLS), leave --redis-url out "
            "for a Redis of the farm's own, or pass --redis-without-password"
        )
    try:
        redis.Redis.from_url(url, socket_connect_timeout=5).ping()
    except Exception as exc:
        raise UsageError(f"cannot reach Redis at {redact(url)}: {exc}") from None


def wait_ready(url: str, alive: Callable[[], bool], log_tail: Callable[[], str],
               timeout: float = READY_TIMEOUT_SECS) -> None:
    """Until the farm's own Redis answers (with its password); `UsageError` with its log
    if it exits first or does not answer in time."""
    import redis

    deadline = time.monotonic() + timeout
    client = redis.Redis.from_url(url, socket_connect_timeout=1)
    try:
        while True:
            if not alive():
                raise UsageError(f"redis exited during start-up:\n{log_tail()}")
            try:
                client.ping()
                return
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline:
                    raise UsageError(f"redis did not answer within {timeout:.0f} s:\n{log_tail()}") from None
                time.sleep(0.1)
    finally:
        client.close()


def redact(url: str) -> str:
    """The URL with its password, if any, replaced by ***."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if not parts.password:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
