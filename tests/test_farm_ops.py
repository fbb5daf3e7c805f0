"""What an operator meets running farms: `farm up` again on a database an earlier farm
used (issue 26).

- a second `farm up` from another state dir of the same name, and again from the same
  state dir, on the same database: each start's agent registers and stays (it was
  refused the earlier agent's name, and `farm up` took the earlier agent's row for its
  own and said nothing);
- an agent that exits during `farm up` fails it with the agent's one-line reason;
- an agent stopped with SIGTERM says so, goes offline at once and exits 0;
- an agent naming a device class that does not exist stops, naming those that do.
"""

from __future__ import annotations

import shutil
import time
import uuid

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("grpc")

from farm_fixtures import service_unavailable  # noqa: E402
from sqlalchemy import select  # noqa: E402

from services.db.models import Agent, Token  # noqa: E402
from services.db.session import make_session_factory, transaction  # noqa: E402
from services.db.tokens import hash_token  # noqa: E402
from tunefarm.errors import UsageError  # noqa: E402
from tunefarm_app.farm_local import FarmConfig, LocalFarm, agent_base_name, down, up  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _redis_server():
    if shutil.which("redis-server") is None:
        service_unavailable("farm up starts its own Redis: redis-server is not installed")


def config(state_dir, database_url, **kw) -> FarmConfig:
    return FarmConfig(state_dir=state_dir, database_url=database_url, workers=1,
                      queue_prefix=f"tfops{uuid.uuid4().hex[:8]}", **kw)  # fmt: skip


def assert_serving(farm: LocalFarm, timeout: float = 90.0) -> None:
    """The farm's agent registered with this start's token, and still runs (`up` returns
    once it registered; an agent refused its name exits right after registering)."""
    sessions = make_session_factory(farm.config.database_url)
    try:
        with transaction(sessions) as s:
            token_id = s.scalar(select(Token.id).where(Token.token_hash == hash_token(farm.info["agent_token"])))
        deadline = time.monotonic() + timeout
        while True:
            assert farm.alive("agent"), open(farm.processes["agent"].log).read()[-2000:]
            with transaction(sessions) as s:
                row = s.scalars(select(Agent).where(Agent.name == farm.agent_name())).one_or_none()
                if row is not None and row.token_id == token_id and row.state.value in ("idle", "busy"):
                    break
            assert time.monotonic() < deadline, "the agent did not register"
            time.sleep(0.5)
        time.sleep(2.0)
        assert farm.alive("agent"), open(farm.processes["agent"].log).read()[-2000:]
    finally:
        sessions.kw["bind"].dispose()


def agent_state(farm: LocalFarm) -> str:
    sessions = make_session_factory(farm.config.database_url)
    try:
        with transaction(sessions) as s:
            return s.scalar(select(Agent.state).where(Agent.name == farm.agent_name())).value
    finally:
        sessions.kw["bind"].dispose()


def stopped_cleanly(farm: LocalFarm) -> None:
    """SIGTERM to the agent: it says so, goes offline at once (not idle for the
    freshness window), and exits 0."""
    process = farm._popen["agent"]
    farm.stop("agent", grace=15.0)
    log = open(farm.processes["agent"].log).read()
    assert process.returncode == 0, log[-2000:]
    assert "stopping (SIGTERM): giving back the leases it holds and going offline" in log, log[-2000:]
    assert "offline; it held no lease" in log, log[-2000:]
    assert agent_state(farm) == "offline"


def test_farm_up_again_on_the_same_database_gets_an_agent_that_serves(database_url, tmp_path):
    a, b = tmp_path / "a" / "farm", tmp_path / "b" / "farm"
    assert agent_base_name(a) != agent_base_name(b) and agent_base_name(a) == agent_base_name(a)
    first = up(config(a, database_url), log=lambda msg: None)
    try:
        assert_serving(first)
        stopped_cleanly(first)
    finally:
        down(a, grace=5.0)
    second = up(config(b, database_url), log=lambda msg: None)  # another dir named farm
    try:
        assert_serving(second)
    finally:
        down(b, grace=5.0)
    assert agent_state(second) == "offline"  # farm down stops the agents first: they go offline at once
    again = up(config(b, database_url), log=lambda msg: None)  # the same dir: a new token, the same name
    try:
        assert again.agent_name() == second.agent_name()
        assert_serving(again)
    finally:
        down(b, grace=5.0)


def test_farm_up_fails_with_the_reason_its_agent_exited(database_url, tmp_path):
    cfg = config(tmp_path / "farm", database_url, agent_env={"TUNEFARM_AGENT_TOKEN": "tfa_" + "x" * 43})
    with pytest.raises(UsageError) as failed:
        up(cfg, log=lambda msg: None)
    message = str(failed.value)
    assert "\n" not in message and message.startswith("agent exited during start-up: Unauthenticated: "), message
    assert message.endswith(f"(log: {tmp_path / 'farm' / 'logs' / 'agent.log'})"), message


def test_an_agent_naming_a_class_that_does_not_exist_stops_and_says_which_exist(database_url, tmp_path):
    """A typo in --device-class: the class is not created (device classes are the
    operators'), and the agent stops at once with the classes that exist, instead of
    retrying for ever."""
    cfg = config(tmp_path / "farm", database_url, device_class="ops-class",
                 agent_env={"TUNEFARM_AGENT_DEVICE_CLASS": "ops-clas"})  # fmt: skip
    with pytest.raises(UsageError) as failed:
        up(cfg, log=lambda msg: None)
    message = str(failed.value)
    assert "\n" not in message, message
    assert message.startswith("agent exited during start-up: NotFound: device class 'ops-clas' does not exist "
                              "(existing classes: "), message
    assert "ops-class" in message and "tunefarm farm device-class ops-clas" in message, message

