"""Processes and ports of this machine, as `farm up` and `farm down` see them: whether a
pid is alive and still the process started under it, signalling a process group, picking
a free port, whether a port listens or a URL answers, the tail of a log.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any


def log_tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def with_free_port(bind: str) -> str:
    host, _, port = bind.rpartition(":")
    if port not in ("", "0"):
        return bind
    with socket.socket() as s:
        s.bind((host or "127.0.0.1", 0))
        return f"{host or '127.0.0.1'}:{s.getsockname()[1]}"


def connect_address(bind: str) -> str:
    host, _, port = bind.rpartition(":")
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = "127.0.0.1"
    return f"{host}:{port}"


def http_ok(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except Exception:
        return False


def port_open(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not reaped) is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def started_at(pid: int) -> str | None:
    """When the process `pid` started, in clock ticks after boot (/proc/PID/stat's 22nd
    field); None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def is_ours(process: dict[str, Any]) -> bool:
    """Whether a process of farm.json still runs (not a later process with its pid): its
    start time is the one recorded (a farm.json without one: it runs a tunefarm command)."""
    pid = process["pid"]
    if process.get("started"):
        return started_at(pid) == process["started"]
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"tunefarm" in f.read()
    except OSError:
        return False


def signal_group(pid: int, sig: int) -> None:
    """Signal the process group led by `pid` (every process `farm up` started leads one)."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
