"""deploy/docker-compose.yml cannot run here (no Docker engine): its structure is checked
instead, and that it runs the processes `tunefarm farm up` starts, with settings the
processes actually read."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "deploy" / "docker-compose.yml"

LONG_RUNNING = {"postgres", "redis", "api", "lease-service", "scheduler", "worker", "agent"}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _command(service: dict) -> str:
    cmd = service.get("command", [])
    return " ".join(cmd) if isinstance(cmd, list) else str(cmd)


def test_compose_runs_what_farm_up_starts(compose):
    from tunefarm_app.farm_local import FarmConfig, LocalFarm

    services = compose["services"]
    assert LONG_RUNNING | {"setup"} == set(services)
    farm = LocalFarm(FarmConfig(state_dir=Path("/nonexistent"), database_url="postgresql://x/y", redis_url="redis://x"))
    farm.info = {"device_class": "c"}
    started = {re.sub(r"-\d+$", "", name) for name in farm.commands()}  # worker-1, worker-2 -> worker
    containers = {name for name in services if name in LONG_RUNNING} - {"postgres", "redis"}
    assert started == containers
    for name in containers:
        command = _command(services[name])
        subcommand = "worker" if name == "worker" else name
        assert re.search(rf"(^|tunefarm ){re.escape(subcommand)}\b", command), (name, command)
    assert services["worker"]["deploy"]["replicas"] == 2  # farm up starts two workers
    setup = _command(services["setup"])
    for step in ("tunefarm db upgrade", "tunefarm farm device-class", "tunefarm farm team", "tunefarm farm agent-token"):
        assert step in setup


def test_every_service_has_a_health_check_volumes_and_dependencies(compose):
    services = compose["services"]
    for name in LONG_RUNNING:
        check = services[name].get("healthcheck")
        assert check and check["test"], name
    assert services["setup"]["restart"] == "no"
    assert "pgdata:/var/lib/postgresql/data" in services["postgres"]["volumes"]
    shared = {"api", "lease-service", "scheduler", "worker"}
    for name in shared:  # the artifact root every server-side process shares
        assert "artifacts:/artifacts" in services[name]["volumes"], name
        assert services[name]["environment"]["TUNEFARM_ARTIFACT_ROOT"] == "/artifacts"
        assert services[name]["depends_on"]["setup"]["condition"] == "service_completed_successfully"
    assert "volumes" not in services["agent"] or all("artifacts" not in v for v in services["agent"]["volumes"])
    assert set(compose["volumes"]) >= {"pgdata", "artifacts"}
    assert services["agent"]["depends_on"]["lease-service"]["condition"] == "service_healthy"


def test_secrets_have_no_defaults_and_settings_exist(compose):
    text = COMPOSE.read_text()
    for secret in ("POSTGRES_PASSWORD", "TUNEFARM_TEAM_TOKEN", "TUNEFARM_AGENT_TOKEN"):
        assert re.search(rf"\$\{{{secret}:\?", text), secret  # ${X:?...}: compose refuses to start without it
        assert not re.search(rf"\$\{{{secret}:-", text), secret
    from services.api.settings import ApiSettings
    from services.lease.settings import LeaseServiceSettings
    from services.scheduler.settings import SchedulerSettings
    from services.worker.settings import WorkerSettings

    known = {f"TUNEFARM_{f.upper()}" for cls in (ApiSettings, LeaseServiceSettings, SchedulerSettings, WorkerSettings)
             for f in cls.model_fields}
    from dataclasses import fields

    from services.agent.settings import AgentSettings, env_name

    known |= {env_name(f.name) for f in fields(AgentSettings)}  # the agent's (AgentSettings.from_env)
    known |= {"TUNEFARM_DEVICE_CLASS", "TUNEFARM_TEAM", "TUNEFARM_TEAM_TOKEN"}  # read by the compose commands
    for name, service in compose["services"].items():
        for var in service.get("environment", {}):
            if var.startswith("TUNEFARM_"):
                assert var in known, (name, var)
