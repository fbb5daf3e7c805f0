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
SECRETS = ("POSTGRES_PASSWORD", "TUNEFARM_REDIS_PASSWORD", "TUNEFARM_TEAM_TOKEN", "TUNEFARM_AGENT_TOKEN",
           "TUNEFARM_METRICS_TOKEN")


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
        assert services[name].get("restart") in ("unless-stopped", "always", "on-failure"), name  # comes back
    assert services["setup"]["restart"] == "no"  # a one-shot job: migrations, class, team, tokens, signing key
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
    for secret in SECRETS:
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


def _interpolated(text: str) -> str:
    """`text` as compose sees it with every required variable X set to `value-of-X`."""
    return re.sub(r"\$\{(\w+):\?[^}]*\}", lambda m: f"value-of-{m.group(1)}", text)


def _networks(service: dict) -> set[str]:
    return set(service.get("networks", ["default"]))


def test_redis_wants_its_password_and_the_agent_cannot_reach_it(compose):
    from redis.connection import parse_url

    services = compose["services"]
    redis = services["redis"]
    assert redis["environment"]["REDIS_PASSWORD"] == "${TUNEFARM_REDIS_PASSWORD:?set TUNEFARM_REDIS_PASSWORD}"
    command = _command(redis)
    assert "requirepass" in command and "redis-server -" in command  # the password from stdin, not argv
    assert "--requirepass" not in command
    assert "REDISCLI_AUTH" in " ".join(redis["healthcheck"]["test"])  # the health check authenticates
    users = {name for name, service in services.items() if "TUNEFARM_REDIS_URL" in service.get("environment", {})}
    assert users == {"setup", "api", "lease-service", "scheduler", "worker"}
    for name in users:
        url = _interpolated(services[name]["environment"]["TUNEFARM_REDIS_URL"])
        assert parse_url(url)["password"] == "value-of-TUNEFARM_REDIS_PASSWORD", name

    assert compose["networks"]["backend"]["internal"] is True
    assert _networks(redis) == _networks(services["postgres"]) == {"backend"}
    agent = services["agent"]
    assert "backend" not in _networks(agent) and _networks(agent) & _networks(services["lease-service"])
    assert not [v for v in agent["environment"] if v in ("TUNEFARM_REDIS_URL", "TUNEFARM_DATABASE_URL")]
    for name in users:  # whoever needs Redis or the database is on the backend network
        assert "backend" in _networks(services[name]), name
    for name, service in services.items():  # nothing published sits on the internal network alone
        if service.get("ports"):
            assert _networks(service) - {"backend"}, name


def test_metrics_want_a_token_and_no_secret_is_on_a_command_line(compose):
    services = compose["services"]
    assert services["api"]["environment"]["TUNEFARM_METRICS_TOKEN"] == "${TUNEFARM_METRICS_TOKEN:?set TUNEFARM_METRICS_TOKEN}"
    for name, service in services.items():
        command = _command(service)
        for secret in SECRETS:
            for match in re.finditer(rf"\$\$\{{?{secret}\}}?", command):  # a secret the shell expands...
                before = command[: match.start()].rsplit("|", 1)[0].rsplit("&&", 1)[-1]
                assert before.strip().startswith("printf"), (name, secret)  # ...only into printf's pipe
        assert "--value " not in command and "--token " not in command, name


def test_the_env_example_names_every_required_secret():
    required = set(re.findall(r"\$\{(\w+):\?", COMPOSE.read_text()))
    example = ROOT / "deploy" / "farm.env.example"
    names = {line.split("=", 1)[0] for line in example.read_text().splitlines() if re.match(r"\w+=", line)}
    assert required == set(SECRETS) and required <= names
