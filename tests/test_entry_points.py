"""The agent's and the lease service's command lines, by every name they go by: the
packages' own (`python -m services.agent`, `python -m services.lease`), the `tunefarm`
command's, and the old module paths kept one release as shims (services/measurer/)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

AGENT = ("-m services.agent", "-m services.measurer.agent", "-m tunefarm_app.cli agent")
LEASE_SERVICE = ("-m services.lease", "-m services.measurer.lease_service", "-m tunefarm_app.cli lease-service")


def _run(command: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TUNEFARM_")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, *command.split(), *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=env)  # fmt: skip


@pytest.mark.parametrize("command", AGENT)
def test_every_name_of_the_agent_runs_its_command_line(command):
    out = _run(command, "--device-class", "c")
    assert out.returncode == 2, out.stderr[-2000:]
    assert (out.stdout + out.stderr).strip() == "tunefarm agent: error: no server: set TUNEFARM_AGENT_SERVER or pass --server"


@pytest.mark.parametrize("command", LEASE_SERVICE)
def test_every_name_of_the_lease_service_runs_its_command_line(command):
    out = _run(command, "--tls-cert", "/nonexistent/cert.pem")
    assert out.returncode == 2, out.stderr[-2000:]
    assert (out.stdout + out.stderr).strip() == (
        "tunefarm lease-service: error: TLS needs both a certificate and its key "
        "(TUNEFARM_TLS_CERT_FILE, TUNEFARM_TLS_KEY_FILE)"
    )
