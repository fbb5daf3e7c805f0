"""The command line as a person meets it: `--version`, help text on every flag of every
subcommand, `tunefarm report` (terminal and HTML), and `--follow`: the live table of
`tune` drawn from a farm job, retries while the farm is away (a real `tunefarm api` that
is stopped and started again), and a clear error when it does not come back."""

from __future__ import annotations

import argparse
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tunefarm_app.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]


# -- --version and help -------------------------------------------------------------------------


def test_version(capsys):
    from tunefarm import __version__

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith(f"tunefarm {__version__} (TVM ") and "Python 3." in out


def _missing_help(parser: argparse.ArgumentParser, path: str):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                if not (helps.get(name) or "").strip():
                    yield f"{path} {name} (the subcommand)"
                yield from _missing_help(sub, f"{path} {name}")
        elif not isinstance(action, argparse._HelpAction) and not (action.help or "").strip():
            yield f"{path} {'/'.join(action.option_strings) or action.dest}"


def _service_parsers():
    """The parsers the process commands (`tunefarm api`, `worker`, ...) build in their `main`,
    caught at their parse_args call."""
    from tunefarm_app.operator_commands import SERVICE_COMMANDS

    class Caught(Exception):
        pass

    def catch(self, *args, **kwargs):
        raise Caught(self)

    import importlib

    for name, (module, _) in SERVICE_COMMANDS.items():
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(argparse.ArgumentParser, "parse_args", catch)
            mp.setattr(argparse.ArgumentParser, "parse_known_args", catch)
            try:
                importlib.import_module(module).main([])
            except Caught as caught:
                yield name, caught.args[0]
            else:
                raise AssertionError(f"tunefarm {name} parsed no arguments")


def test_every_flag_has_help_text():
    missing = list(_missing_help(build_parser(), "tunefarm"))
    for name, parser in _service_parsers():
        missing += _missing_help(parser, f"tunefarm {name}")
    assert missing == []


def test_the_help_walk_sees_a_flag_without_help():
    p = argparse.ArgumentParser(prog="x")
    p.add_argument("--documented", help="yes")
    p.add_argument("--bare")
    assert list(_missing_help(p, "x")) == ["x --bare"]


# -- tunefarm report ----------------------------------------------------------------------------


def _report() -> dict:
    """A report.json as `tunefarm tune` writes it (tunefarm.models.finish.model_report)."""
    from tunefarm.models.finish import REPORT_VERSION

    def task(name, weight, trials, best, flops, errors=None, dead=None):
        return {"name": name, "key": f"{name}#0", "shapes": "1x8 -> 1x8", "weight": weight, "flops": flops,
                "const_inputs": [], "trials": trials, "best_seconds": best,
                "weighted_seconds": best * weight if best else None,
                "gflops": flops / best / 1e9 if best else None, "verified": bool(best), "reference": "yes",
                "schedule": "tuned" if best else "default build (no valid measurement)", "dead_reason": dead,
                "errors": errors or {}}

    tasks = [task("fused_conv2d_add_relu(1x3x32x32)", 1, 40, 2e-5, 1e6, {"run_error": 3}),
             task("max_pool2d(1x16x32x32)", 2, 16, 5e-6, 1e5, dead="exhausted"),
             task("softmax(1x10)", 1, 8, None, 1e3, {"build_error": 8})]
    timeline = [
        {"round": 0, "task": 0, "trials": 8, "elapsed": 1.0, "best_seconds": 3e-5,
         "estimated_seconds": {"cnn": 3e-5}, "unknown_tasks": [1, 2]},
        {"round": 1, "task": 1, "trials": 16, "elapsed": 2.0, "best_seconds": 9e-6,
         "estimated_seconds": {"cnn": 6e-5}, "unknown_tasks": []},
        {"round": 2, "task": 0, "trials": 40, "elapsed": 4.0, "best_seconds": 2e-5,
         "estimated_seconds": {"cnn": 5e-5}, "unknown_tasks": []},
        {"round": 3, "task": 0, "trials": 64, "elapsed": 6.0, "best_seconds": 2e-5,
         "estimated_seconds": {"cnn": 3e-5}, "unknown_tasks": []},
    ]
    rounds = [{"round": r["round"], "task": r["task"], "reason": "warm-up" if r["round"] < 2 else "gradient",
               "gradient": None, "task_name": tasks[r["task"]]["name"]} for r in timeline]
    return {
        "version": REPORT_VERSION, "target": {"kind": "llvm", "num-cores": 2}, "trials_budget": 64, "trials": 64,
        "resumed_trials": 0, "stop_reason": "budget", "wall_seconds": 80.0, "tuning_seconds": 60.0,
        "search_seconds": 9.0, "train_seconds": 1.0, "measure_seconds": 50.0, "seconds_per_trial": 0.94,
        "search_share": 0.15,
        "models": [{
            "name": "cnn", "directory": "tuned", "inputs": [], "outputs": [],
            "latency": {"mean": 4.2e-5, "median": 4e-5, "p90": 5e-5, "p99": 8e-5, "threads": 2, "runs": 500},
            "untuned_latency": {"mean": 1.2e-4, "median": 1.2e-4, "p90": 1.3e-4, "p99": 1.3e-4, "threads": 2,
                                "runs": 5},
            "onnxruntime_latency": {"mean": 6.1e-5, "median": 6e-5, "p90": 7e-5, "p99": 9e-5, "threads": 2,
                                    "runs": 400},
            "estimated_seconds": 3e-5, "estimated_seconds_at_start": 6e-5,
            "check": _check(),
            "error": None, "warnings": [], "tasks": tasks, "elided": [],
        }],
        "task_scheduler": {"strategy": "gradient", "rounds": rounds},
        "timeline": timeline,
    }


def _check(ok: bool = True) -> dict:
    from tunefarm.models.check import ModelCheck, OutputError

    errors = [OutputError(kind, "y", 1e-7, 1e-6, 0.1, 0, 10) for kind in ("normal", "uniform", "pixels")]
    if not ok:
        errors[1] = OutputError("uniform", "y", 0.04, 0.4, 0.1, 3, 10, ((0, 7), 0.31, 0.35))
    return ModelCheck("onnxruntime", tuple(errors)).as_report()


def test_report_in_the_terminal_and_as_html(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # room for whole task names
    (tmp_path / "report.json").write_text(json.dumps(_report()))
    assert main(["report", str(tmp_path), "--html"]) == 0
    out = capsys.readouterr().out
    assert "42.0 us mean, 40.0 us p50, 50.0 us p90, 80.0 us p99 (500 runs, 2 threads)" in out
    assert "61.0 us mean, 60.0 us p50" in out  # onnxruntime, same threads
    assert "3.00x the speed of TVM" in out and "1.50x the speed of onnxruntime" in out
    assert "matches onnxruntime on 3 input kinds" in out and "60.0 us at the start" in out
    assert "0.0001 x max|ref| + 0.001 x |ref| per element" in out and "uniform [0, 255)" in out
    assert "4 (gradient task scheduler): warm-up 2, gradient 2" in out
    for name in ("fused_conv2d_add_relu", "max_pool2d", "softmax"):
        assert name in out
    html = (tmp_path / "report.html").read_text()
    assert "<script" not in html and "http://" not in html.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert 'data-points="3"' in html and html.count('class="point"') == 3  # complete estimates only
    assert html.count('<tr class="task">') == 3
    assert "50.0" in html  # GFLOPS of the conv: 1e6 / 2e-5 / 1e9
    assert "exhausted" in html and "build_error 8" in html


def test_report_of_a_failed_check_names_the_output_and_input(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    report = _report()
    report["models"][0].update(check=_check(ok=False), latency=None, error="cnn: the tuned model's output differs")
    (tmp_path / "report.json").write_text(json.dumps(report))
    assert main(["report", str(tmp_path), "--html"]) == 0
    out = capsys.readouterr().out
    assert "DOES NOT match onnxruntime" in out
    assert "uniform  y: max abs error 0.04" in out and "3 of 10 elements differ, worst at [0, 7]" in out
    assert "does not match" in (tmp_path / "report.html").read_text().lower()


def test_report_html_to_a_chosen_file(tmp_path, capsys):
    (tmp_path / "tuned").mkdir()
    (tmp_path / "tuned" / "report.json").write_text(json.dumps(_report()))
    out = tmp_path / "pages" / "cnn.html"
    assert main(["report", str(tmp_path / "tuned"), "--html", "--out", str(out)]) == 0
    assert out.read_text().startswith("<!doctype html>")


@pytest.mark.parametrize(
    ("content", "words"),
    [(None, ["no report.json"]), ("{not json", ["not a readable JSON report"]),
     (json.dumps({"version": 99, "models": []}), ["version 1", "99"])],
)
def test_report_of_a_bad_directory_is_one_line(tmp_path, capsys, content, words):
    if content is not None:
        (tmp_path / "report.json").write_text(content)
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("tunefarm: error:")
    for w in words:
        assert w in err, err


# -- --follow: the live table and retries ------------------------------------------------------


def _job(state="running", trials=24, est=4.2e-5):
    return {
        "id": 3, "state": state, "model_id": 1, "model_name": "cnn", "device_class": "c", "trial_budget": 64,
        "trials_used": trials, "latency_target_secs": None, "est_latency_start_secs": 9e-5,
        "est_latency_secs": est, "cancel_requested": False, "error": None, "config": {},
        "tasks": [
            {"position": 0, "name": "fused_conv2d_add_relu(1x3x32x32)", "key": "k0", "weight": 1, "trials": 16,
             "best_secs": 3e-5, "dead_reason": None},
            {"position": 1, "name": "max_pool2d(1x16x32x32)", "key": "k1", "weight": 2, "trials": 8,
             "best_secs": 6e-6, "dead_reason": "exhausted"},
            {"position": 2, "name": "softmax(1x10)", "key": "k2", "weight": 1, "trials": 0, "best_secs": None,
             "dead_reason": None},
        ],
        "curve": [], "cost_model": {"version_id": None, "version": None, "trained_on": None,
                                    "trained_on_at_first_batch": None},
        "artifact": {"available": False, "sha256": None, "size": None}, "result": None,
        "created_at": "2026-01-01T00:00:00+00:00", "started_at": "2026-01-01T00:00:00+00:00", "finished_at": None,
    }


def test_follow_draws_the_live_table_of_tune():
    from rich.console import Console

    from tunefarm_app.progress import JobProgressView, render_progress, snapshot_of_job

    out = io.StringIO()
    view = JobProgressView(out, force_terminal=True)
    view.update(_job())
    view.close()
    text = out.getvalue()
    for words in ("trials 24/64", "cnn: estimated latency 42.0 us (at start 90.0 us)", "1 tasks not measured yet",
                  "fused_conv2d_add_relu", "dead: exhausted", "30.0 us"):
        assert words in text, (words, text)
    # The same renderer as tune's view: shares of the estimate, weight x best.
    plain = Console(file=io.StringIO(), width=120)
    plain.print(render_progress(snapshot_of_job(_job())))
    rows = plain.file.getvalue().splitlines()
    conv = next(r for r in rows if "fused_conv2d" in r)
    pool = next(r for r in rows if "max_pool2d" in r)
    assert "71%" in conv and "29%" in pool  # 30 us vs 2 x 6 us


def test_follow_retries_transient_failures_and_not_others():
    import httpx

    from tunefarm_app.farm_client import ClientSettings, FarmClient, FarmError

    answers = iter([httpx.ConnectError("refused"), httpx.Response(503, json={"error": {"message": "db down"}}),
                    httpx.ReadTimeout("slow"), httpx.Response(200, json=_job()),
                    httpx.Response(200, json=_job("succeeded", 64, 3e-5))])

    def answer(request):
        a = next(answers)
        if isinstance(a, Exception):
            raise a
        return a

    settings = ClientSettings.load(server="farm:8000", token="tft_x", follow_retry_secs=600)
    notes, seen, pauses = [], [], []
    with FarmClient(settings, transport=httpx.MockTransport(answer)) as client:
        final = client.follow(3, seen.append, on_retry=notes.append, sleep=pauses.append)
    assert final["state"] == "succeeded" and [j["trials_used"] for j in seen] == [24, 64]
    assert [n.split(" (")[0] for n in notes[:3]] == ["retrying in 1 s", "retrying in 2 s", "retrying in 4 s"]
    assert "HTTP 503" in notes[1] and "answers again" in notes[3]

    with FarmClient(settings, transport=httpx.MockTransport(
            lambda r: httpx.Response(404, json={"error": {"message": "job 3 not found"}}))) as client:
        with pytest.raises(FarmError, match="job 3 not found"):
            client.follow(3, seen.append, on_retry=notes.append, sleep=pauses.append)


def test_follow_gives_up_after_the_bound(capsys, monkeypatch):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    monkeypatch.setenv("TUNEFARM_TOKEN", "tft_x")
    code = main(["status", "5", "--follow", "--server", f"http://127.0.0.1:{port}", "--retry-secs", "2"])
    assert code == 3 and time.monotonic() - t0 < 120  # --retry-secs 2 bounds it, not the default 300 s
    err = capsys.readouterr().err
    assert "retrying in 1 s" in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("tunefarm: error: gave up following job 5") and "status 5 --follow" in last


@pytest.mark.slow
def test_follow_survives_the_api_going_away_and_coming_back(database_url, db_sessions, tmp_path):
    from farm_state import seed_farm

    from services.db.job_store import set_job_state
    from services.db.session import transaction
    from services.db.states import JobState
    from tunefarm_app.bench.farm_progress import start_api

    state = seed_farm(db_sessions)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    api, base = start_api(database_url, artifact_root=tmp_path, port=port)
    env = {**os.environ, "TUNEFARM_FOLLOW_INTERVAL_SECS": "0.3", "PYTHONPATH": str(ROOT),
           "TUNEFARM_TOKEN": state.team_a_token}
    follower = subprocess.Popen(
        [sys.executable, "-m", "tunefarm_app.cli", "status", str(state.job_a), "--follow", "--server", base,
         "--retry-secs", "120"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(follower.stderr), daemon=True)
    reader.start()

    def wait_for(word: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not any(word in ln for ln in lines):
            assert time.monotonic() < deadline and follower.poll() is None, (word, lines)
            time.sleep(0.1)

    try:
        wait_for("running")  # following
        api.terminate()
        api.wait(timeout=20)
        wait_for("retrying in")  # the farm is away: it says so and waits
        api, _ = start_api(database_url, artifact_root=tmp_path, port=port)
        wait_for("answers again")
        with transaction(db_sessions) as s:
            set_job_state(s, job_id=state.job_a, state=JobState.SUCCEEDED)
        out, _ = follower.communicate(timeout=60)
        reader.join(timeout=5)
    finally:
        follower.kill()
        api.terminate()
        api.wait(timeout=20)
    assert follower.returncode == 0, lines
    assert f"job        {state.job_a}: succeeded" in out
    assert not any("Traceback" in ln for ln in lines)


def test_json_means_the_results_as_json_on_stdout_or_in_a_file(tmp_path, capsys):
    """`--json` alone: the results as JSON and nothing else on stdout; `--json FILE`: the
    usual lines, and the JSON in FILE (one meaning on every command that prints results)."""
    pytest.importorskip("onnx")
    from onnx_models import tiny_onnx

    from tunefarm_app.cli import main

    model = tiny_onnx(tmp_path / "tiny.onnx", dynamic=False)
    assert main(["tasks", str(model), "--json"]) == 0
    (listed,) = json.loads(capsys.readouterr().out)
    assert listed["model"] == "tiny" and listed["tasks"] and {"name", "weight", "flops", "share"} <= set(listed["tasks"][0])
    assert main(["tasks", str(model), "--json", str(tmp_path / "tasks.json")]) == 0
    out = capsys.readouterr().out
    assert "tiny:" in out and f"json       {tmp_path / 'tasks.json'}" in out
    assert json.loads((tmp_path / "tasks.json").read_text()) == [listed]
