"""The farm's command line without a farm: one-line errors (exit 2), flags handed to the
processes, the client's reading of the API's errors."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("httpx")

import httpx  # noqa: E402

from tunefarm.errors import UsageError  # noqa: E402
from tunefarm_app.cli import main  # noqa: E402
from tunefarm_app.farm_client import ClientSettings, FarmClient, FarmError  # noqa: E402


def one_line_error(capsys, *words: str) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("tunefarm: error:"), err
    for w in words:
        assert w in err, err
    return err


@pytest.mark.parametrize(
    ("argv", "status", "words"),
    [
        (["status", "1"], 2, ["no team token", "TUNEFARM_TOKEN"]),
        (["status", "1", "--token-file", "{token}", "--server", "http://127.0.0.1:1"], 3, ["cannot reach the farm"]),
        (["status", "1", "--token-file", "{token}", "--server", "127.0.0.1:1"], 3, ["cannot reach the farm"]),
        (["status", "1", "--token-file", "{missing}"], 2, ["cannot read the team token file", "missing"]),
        (["status", "1", "--token-file", "{empty}"], 2, ["the team token file", "is empty"]),
        (["submit", "m.onnx", "--device-class", "c", "--trials", "0", "--token-file", "{token}"], 2, ["--trials"]),
        (["submit", "missing.onnx", "--device-class", "c", "--trials", "5", "--token-file", "{token}",
          "--server", "http://127.0.0.1:1"], 2, ["no such model file"]),
        (["submit", "m.onnx", "--device-class", "c", "--trials", "5", "--latency-target", "-1",
          "--token-file", "{token}"], 2, ["--latency-target"]),
        (["fetch", "1", "--token-file", "{token}"], 2, ["--out"]),
    ],
)
def test_client_commands_fail_in_one_line(argv, status, words, capsys, monkeypatch, tmp_path):
    """Exit 2: the command is wrong; exit 3: the farm does not answer (try again later)."""
    monkeypatch.delenv("TUNEFARM_TOKEN", raising=False)
    monkeypatch.delenv("TUNEFARM_SERVER", raising=False)
    monkeypatch.delenv("TUNEFARM_STATE_DIR", raising=False)
    (tmp_path / "token").write_text("tft_x\n")
    (tmp_path / "empty").write_text("\n")
    files = {name: str(tmp_path / name) for name in ("token", "missing", "empty")}
    assert main([a.format(**files) for a in argv]) == status
    one_line_error(capsys, *words)


def test_the_farm_refusing_a_request_is_exit_2_and_failing_it_exit_1(monkeypatch, capsys):
    from tunefarm_app import farm_commands

    answers = {"/v1/jobs/7": (404, "job 7 not found"), "/v1/jobs/8": (500, "the database is away")}

    def answer(request: httpx.Request) -> httpx.Response:
        code, message = answers[request.url.path]
        return httpx.Response(code, json={"error": {"code": "x", "message": message}})

    settings = ClientSettings.load(server="farm.example:8000", token="tft_secret")
    monkeypatch.setattr(farm_commands, "_client", lambda args: FarmClient(settings, transport=httpx.MockTransport(answer)))
    assert main(["status", "7"]) == 2
    one_line_error(capsys, "job 7 not found (HTTP 404)")
    assert main(["status", "8"]) == 1
    one_line_error(capsys, "the database is away (HTTP 500)")


def test_farm_down_without_a_farm(tmp_path, capsys, monkeypatch):
    assert main(["farm", "down", "--state-dir", str(tmp_path)]) == 2
    one_line_error(capsys, "no farm", "farm up")
    monkeypatch.delenv("TUNEFARM_STATE_DIR", raising=False)
    for command in ("down", "status"):
        assert main(["farm", command]) == 2
        one_line_error(capsys, "which farm?", "TUNEFARM_STATE_DIR")
    monkeypatch.setenv("TUNEFARM_STATE_DIR", str(tmp_path))  # the variable names the farm, as --state-dir does
    assert main(["farm", "status"]) == 2
    one_line_error(capsys, "no farm", str(tmp_path))


def test_farm_down_stops_the_agents_first_and_the_farms_redis_last():
    """The agents go offline while the lease service answers; the build workers shut
    down warm while their Redis is there (stopped together, a worker blocked on Redis
    lost it first and retried it until it was killed after the grace period)."""
    from tunefarm_app.farm_local import stopping_order

    names = ["redis", "api", "lease-service", "scheduler", "worker-1", "worker-2", "agent", "agent-haswell"]
    assert stopping_order(names) == [
        ["agent", "agent-haswell"], ["api", "lease-service", "scheduler", "worker-1", "worker-2"], ["redis"]]
    assert stopping_order(["api", "worker-1", "agent"]) == [["agent"], ["api", "worker-1"]]  # a Redis not the farm's


def test_process_commands_take_their_own_flags(capsys):
    with pytest.raises(SystemExit) as done:
        main(["worker", "--help"])
    assert done.value.code == 0
    assert "--device-class" in capsys.readouterr().out


def test_a_service_refuses_a_bad_setting_in_one_line_naming_it():
    """A scheduler started with a bad TUNEFARM_ value stops at once (exit 2), naming the
    variable, its value and what is wrong (a process of its own: the scheduler blocks
    imports of torch in the process it runs in)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TUNEFARM_TIMING_REPEAT": "0"}
    done = subprocess.run([sys.executable, "-m", "tunefarm_app.cli", "scheduler"], env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr == ("tunefarm: error: scheduler: TUNEFARM_TIMING_REPEAT='0': "
                           "Input should be greater than or equal to 1\n")  # fmt: skip


def test_the_client_reports_the_apis_error_message():
    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/jobs/7":
            return httpx.Response(404, json={"error": {"code": "not_found", "message": "job 7 not found"}})
        assert request.headers["authorization"] == "Bearer tft_secret"
        return httpx.Response(200, json={"items": [], "next_cursor": None})

    settings = ClientSettings.load(server="farm.example:8000", token="tft_secret")
    assert settings.server == "http://farm.example:8000"
    with FarmClient(settings, transport=httpx.MockTransport(answer)) as client:
        assert client.jobs() == {"items": [], "next_cursor": None}
        with pytest.raises(FarmError, match=r"^job 7 not found \(HTTP 404\)$"):
            client.job(7)


def test_settings_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("TUNEFARM_SERVER", "http://api:8000")
    monkeypatch.setenv("TUNEFARM_TOKEN", "tft_env")
    s = ClientSettings.load()
    assert (s.server, s.token) == ("http://api:8000", "tft_env")
    s = ClientSettings.load(token="tft_flag")  # a flag wins
    assert s.token == "tft_flag"
    assert json.loads(s.model_dump_json())["server"] == "http://api:8000"


def _no_farm_variables(monkeypatch) -> None:
    for var in ("TUNEFARM_TOKEN", "TUNEFARM_SERVER", "TUNEFARM_STATE_DIR", "TUNEFARM_DATABASE_URL"):
        monkeypatch.delenv(var, raising=False)


def _farm_json(tmp_path, **info) -> str:
    state = tmp_path / "farm"
    state.mkdir()
    (state / "farm.json").write_text(json.dumps(info))
    return str(state)


def test_a_farm_started_here_is_found_by_its_state_dir(monkeypatch, tmp_path):
    """`farm up` prints `export TUNEFARM_STATE_DIR=...`: the clients take the API's URL
    and the team token from that farm.json; a flag or a variable still wins."""
    _no_farm_variables(monkeypatch)
    state = _farm_json(tmp_path, api_url="http://127.0.0.1:41234", team_token="tft_farm")
    s = ClientSettings.load(state_dir=state)
    assert (s.server, s.token) == ("http://127.0.0.1:41234", "tft_farm")
    monkeypatch.setenv("TUNEFARM_STATE_DIR", state)
    assert ClientSettings.load().token == "tft_farm"
    monkeypatch.setenv("TUNEFARM_SERVER", "http://api:8000")
    s = ClientSettings.load(token="tft_flag")
    assert (s.server, s.token) == ("http://api:8000", "tft_flag")


def test_a_state_dir_without_a_farm_is_one_line(monkeypatch, tmp_path, capsys):
    _no_farm_variables(monkeypatch)
    assert main(["status", "1", "--state-dir", str(tmp_path)]) == 2
    one_line_error(capsys, "no farm in", "farm up")


def test_operator_commands_never_guess_a_database(monkeypatch, tmp_path, capsys, database_url):
    """Without --database-url, --state-dir or their variables a token or class would land in
    some default database that serves no farm: refused, naming the ways to say which."""
    _no_farm_variables(monkeypatch)
    assert main(["farm", "token", "list"]) == 2
    one_line_error(capsys, "which farm?", "--state-dir", "--database-url")
    state = _farm_json(tmp_path, database_url=database_url)
    assert main(["farm", "team", "state-dir-team", "--state-dir", state]) == 0
    assert capsys.readouterr().out.startswith("tft_")
    monkeypatch.setenv("TUNEFARM_STATE_DIR", state)
    assert main(["farm", "token", "list", "--team", "state-dir-team"]) == 0
    assert "team state-dir-team" in capsys.readouterr().out


def _job(state: str, trials: int, waiting: str | None) -> dict:
    return {"id": 7, "state": state, "model_id": 1, "model_name": "m", "device_class": "c1", "trials_used": trials,
            "trial_budget": 64, "est_latency_secs": None, "est_latency_start_secs": None, "tasks": [],
            "started_at": None, "finished_at": None, "waiting": waiting, "cancel_requested": False, "error": None,
            "cost_model": {"trained_on_at_first_batch": None}, "result": None, "artifact": {"available": False}}


def test_following_a_job_says_while_no_agent_serves_its_class(capsys):
    """`submit --follow` / `status --follow` on a job no live agent serves: not "running
    0/64" for ever without a word, but the API's `waiting` line, once, and a line when an
    agent is back; `status` prints it too."""
    import io

    from tunefarm_app.farm_commands import _print_job
    from tunefarm_app.progress import JobProgressView

    waiting = "waiting: no agent of class c1 is online (start one: tunefarm agent --device-class c1)"
    answers = iter([_job("running", 0, waiting), _job("running", 0, waiting), _job("running", 0, None),
                    _job("running", 8, None), _job("succeeded", 64, None)])

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=next(answers))

    out = io.StringIO()
    view = JobProgressView(out, force_terminal=False)
    settings = ClientSettings.load(server="farm.example:8000", token="tft_secret")
    with FarmClient(settings, transport=httpx.MockTransport(answer)) as client:
        final = client.follow(7, view.update, sleep=lambda secs: None)
    assert final["state"] == "succeeded"
    text = out.getvalue()
    assert text.count(waiting) == 1, text
    assert text.index(waiting) < text.index("class c1 has an agent online again"), text
    _print_job(_job("running", 0, waiting))
    assert "waiting    no agent of class c1 is online" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("server", "words"),
    [
        ("http://127.0.0.1:50051", ["is a URL", "--server 127.0.0.1:50051"]),
        ("grpc://farm.example:50051/", ["is a URL", "--server farm.example:50051"]),
        ("https://farm.example:50051", ["is a URL", "--server farm.example:50051 with --tls"]),
    ],
)
def test_an_agent_refuses_a_url_for_its_server_at_once(server, words, capsys, monkeypatch, tmp_path):
    """`--server http://host:port` made the agent retry for ever ("Misformatted domain
    name"): it is one line and exit 2 at start-up, before anything is dialled."""
    from services.agent.cli import main as agent_main

    monkeypatch.setenv("TUNEFARM_AGENT_TOKEN", "tfa_" + "x" * 43)
    argv = ["--server", server, "--accept-unsigned-code", "--work-dir", str(tmp_path)]
    assert agent_main(argv) == 2
    out = capsys.readouterr().out.strip()
    assert out.count("\n") == 0 and out.startswith("tunefarm agent: error: --server"), out
    for w in words:
        assert w in out, out


def test_an_agent_takes_host_port_and_grpc_targets():
    from services.agent.settings import AgentSettings

    for server in ("127.0.0.1:50051", "localhost:50051", "dns:///127.0.0.1:50051", "unix:/tmp/lease.sock"):
        assert AgentSettings(server=server, token="tfa_x", accept_unsigned_code=True).server == server


def _mock_farm(monkeypatch, routes: dict) -> list[str]:
    """The client commands talk to `routes` (path -> JSON); returns the requests made."""
    from tunefarm_app import farm_commands

    seen: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.method} {request.url.path}")
        return httpx.Response(200, json=routes[request.url.path])

    settings = ClientSettings.load(server="farm.example:8000", token="tft_secret")
    monkeypatch.setattr(farm_commands, "_client", lambda args: FarmClient(settings, transport=httpx.MockTransport(answer)))
    return seen


def test_submit_to_an_unknown_class_uploads_nothing(monkeypatch, tmp_path, capsys):
    model = tmp_path / "m.onnx"
    model.write_bytes(b"not read")
    seen = _mock_farm(monkeypatch, {"/v1/device-classes": [{"name": "x86-avx2"}, {"name": "rpi4"}]})
    assert main(["submit", str(model), "--device-class", "x86-avx", "--trials", "8"]) == 2
    one_line_error(capsys, "no device class 'x86-avx'", "rpi4, x86-avx2", "farm device-class")
    assert seen == ["GET /v1/device-classes"]


@pytest.mark.parametrize(("given", "words"), [("m=0", ["positive"]), ("other=5", ["names no model: other"]),
                                              ("fast", ["not a number"])])
def test_submit_takes_tunes_latency_target_grammar(given, words, tmp_path, capsys, monkeypatch):
    model = tmp_path / "m.onnx"
    model.write_bytes(b"not read")
    seen = _mock_farm(monkeypatch, {})
    assert main(["submit", str(model), "--device-class", "c", "--trials", "8", "--latency-target", given]) == 2
    one_line_error(capsys, "--latency-target", *words)
    assert seen == []


def test_jobs_and_devices_print_headed_readable_tables_and_json(monkeypatch, capsys):
    from datetime import UTC, datetime, timedelta

    beat = (datetime.now(UTC) - timedelta(seconds=30)).isoformat()
    flags = ["sse", "sse2", "sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "bmi2"]
    agent = {"name": "box", "device_class": "c1", "state": "idle", "measurements_done": 3, "errors_by_kind": {},
             "last_heartbeat_at": beat, "capabilities": {"arch": "x86_64", "logical_cores": 2, "isa_features": flags}}
    job = {"id": 7, "state": "running", "model_id": 1, "model_name": "resnet", "device_class": "c1", "trial_budget": 64,
           "trials_used": 8, "est_latency_start_secs": 0.002, "est_latency_secs": 0.001}
    _mock_farm(monkeypatch, {"/v1/jobs": {"items": [job], "next_cursor": None},
                             "/v1/device-classes": [{"name": "c1", "agents_online": 1, "target": {"kind": "llvm"}}],
                             "/v1/devices": [agent]})
    assert main(["jobs"]) == 0
    header, row = capsys.readouterr().out.splitlines()
    assert header.split()[:3] == ["job", "state", "trials"] and "model" in header
    assert row.split()[:5] == ["7", "running", "8/64", "c1", "resnet"]
    assert main(["devices"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("agent"))
    assert "avx512_vnni avx512f" in line and "bmi2" not in line and "sse" not in line  # the widest two, not all
    assert "last heartbeat 30 s ago" in line or "last heartbeat 31 s ago" in line
    assert main(["devices", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["agents"][0]["capabilities"]["isa_features"] == flags
    assert main(["jobs", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["items"][0]["model_name"] == "resnet"


def test_status_and_jobs_state_the_measured_speedup_over_onnxruntime(capsys, monkeypatch):
    """A finished job: `status` prints onnxruntime's latency and the measured ratio (the
    API's `speedup_vs_onnxruntime`), `jobs` the ratio; the estimate is never a speed-up."""
    import argparse

    from tunefarm_app import farm_commands
    from tunefarm_app.farm_commands import _print_job

    job = _job("succeeded", 64, None)
    job.update(est_latency_secs=4e-5, est_latency_start_secs=1.2e-4, speedup_vs_onnxruntime=2.5,
               speedup_vs_openvino=2.0, result={
        "latency": {"median": 3e-5, "p90": 3.4e-5}, "onnxruntime_latency": {"median": 7.5e-5, "p90": 8e-5},
        "openvino_latency": {"median": 6e-5, "p90": 6.5e-5}, "check": {}, "measured_on": {}})  # fmt: skip
    _print_job(job)
    out = capsys.readouterr().out
    assert "ORT        75.0 us p50, 80.0 us p90" in out
    assert "vs ORT     2.50x the speed of onnxruntime (p50, measured" in out
    assert "OpenVINO   60.0 us p50, 65.0 us p90" in out and "vs OpenVINO 2.00x the speed of OpenVINO (p50, measured" in out
    assert "40.0 us estimated now, 120.0 us at the start" in out and "3.00x" not in out

    page = {"items": [{**job, "id": 7}, {**_job("running", 8, None), "id": 6}], "next_cursor": None}
    settings = ClientSettings.load(server="farm.example:8000", token="tft_secret")
    transport = httpx.MockTransport(lambda request: httpx.Response(200, json=page))
    monkeypatch.setattr(farm_commands, "_client", lambda args: FarmClient(settings, transport=transport))
    assert farm_commands.cmd_jobs(argparse.Namespace(limit=None, json=False)) == 0
    lines = capsys.readouterr().out.splitlines()  # a header, then the jobs
    assert lines[1].endswith("40.0 us  2.50x onnxruntime  2.00x OpenVINO (measured)") and lines[2].endswith(" -")


def test_status_lists_a_tasks_alternatives_under_it(capsys):
    """A convolution also tuned by Winograd: its row says which program leads, then each
    program's trials and best."""
    from tunefarm_app.farm_commands import _print_job

    def member(algorithm: str, position: int, trials: int, best: float | None) -> dict:
        return {"algorithm": algorithm, "position": position, "trials": trials, "best_secs": best, "dead_reason": None}

    job = _job("running", 8, None)
    job["tasks"] = [{"position": 0, "name": "conv", "weight": 2, "trials": 8, "best_secs": 1e-5, "dead_reason": None,
                     "best_confirmed": True, "algorithm": "winograd4",
                     "alternatives": [member("direct", 0, 5, 2e-5), member("winograd2", 1, 3, None),
                                      member("winograd4", 2, 0, 1e-5)]}]  # fmt: skip
    _print_job(job)
    out = capsys.readouterr().out
    assert "task     0: conv x2: 8 trials, best 10.0 us by winograd4" in out
    assert "direct: 5 trials, best 20.0 us" in out and "winograd2: 3 trials, best -" in out


def test_farm_ups_supervisor_waits_longer_after_each_death_and_gives_up_on_five_quick_ones_in_a_row():
    """`farm up`'s restart policy (tunefarm_app.farm_supervisor; a farm's processes under
    it: tests/test_farm_ops.py): 1 s, doubling to 60 s; back to 1 s after a good run (a
    minute); given up after five deaths in a row within 10 s of starting, however far the
    delays had grown (five deaths within a minute, as it was, never came once they had)."""
    from tunefarm_app.farm_supervisor import ProcessLife, RestartPolicy

    def lives(runs: list[float]) -> tuple[list[float | None], ProcessLife]:
        """The delays after deaths following runs of `runs` seconds each."""
        life, now, delays = ProcessLife(RestartPolicy(), started_at=0.0), 0.0, []
        for run in runs:
            now += run
            delays.append(life.died(now))
            if life.given_up:
                break
            now = life.start_at
            life.started(now)
        return delays, life

    delays, life = lives([100.0, 1.0, 1.0, 1.0, 1.0, 1.0])  # a good run, then five quick deaths
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, None] and life.given_up and life.restarts == 5
    delays, life = lives([20.0] * 10)  # dies after 20 s each time: at most 3 deaths a minute
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0, 60.0] and not life.given_up
    delays, life = lives([20.0, 20.0, 20.0, 90.0, 20.0])  # a good run starts the delays over
    assert delays == [1.0, 2.0, 4.0, 1.0, 2.0] and not life.given_up
    delays, life = lives([20.0, 20.0, 20.0] + [1.0] * 5)  # then a crash loop, 8 to 60 s apart
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, None] and life.given_up


def test_farm_ups_restart_delays_are_operator_settings_and_a_bad_one_fails_farm_up(tmp_path, capsys, monkeypatch):
    """TUNEFARM_RESTART_FIRST_DELAY_SECS and TUNEFARM_RESTART_MAX_DELAY_SECS set the
    supervisor's delays; a bad value fails `farm up` with one line before anything starts."""
    from tunefarm_app.cli import main
    from tunefarm_app.farm_supervisor import RestartPolicy

    assert RestartPolicy.from_environment({}) == RestartPolicy()
    policy = RestartPolicy.from_environment({"TUNEFARM_RESTART_FIRST_DELAY_SECS": "0.25",
                                             "TUNEFARM_RESTART_MAX_DELAY_SECS": "2"})  # fmt: skip
    assert (policy.first_delay, policy.max_delay) == (0.25, 2.0)
    assert (policy.give_up_deaths, policy.quick_death_secs) == (5, 10.0)  # what gives a process up stays
    bad = [
        ({"TUNEFARM_RESTART_FIRST_DELAY_SECS": "soon"}, "TUNEFARM_RESTART_FIRST_DELAY_SECS must be a number"),
        ({"TUNEFARM_RESTART_MAX_DELAY_SECS": "0"}, "TUNEFARM_RESTART_MAX_DELAY_SECS must be a positive number"),
        ({"TUNEFARM_RESTART_FIRST_DELAY_SECS": "nan"}, "must be a positive number of seconds, not 'nan'"),
        ({"TUNEFARM_RESTART_FIRST_DELAY_SECS": "5", "TUNEFARM_RESTART_MAX_DELAY_SECS": "2"},
         "TUNEFARM_RESTART_MAX_DELAY_SECS (2) must be at least TUNEFARM_RESTART_FIRST_DELAY_SECS (5)"),
    ]
    for env, words in bad:
        with pytest.raises(UsageError, match=re.escape(words)):
            RestartPolicy.from_environment(env)
    monkeypatch.setenv("TUNEFARM_RESTART_MAX_DELAY_SECS", "-1")
    state_dir = tmp_path / "farm"
    assert main(["farm", "up", "--state-dir", str(state_dir), "--database-url", "postgresql://nowhere/none"]) == 2
    err = capsys.readouterr().err.strip()
    assert "TUNEFARM_RESTART_MAX_DELAY_SECS must be a positive number of seconds, not '-1'" in err, err
    assert len(err.splitlines()) == 1 and not state_dir.exists()  # nothing started
