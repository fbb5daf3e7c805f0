"""No secret on a command line (`ps` shows every process's arguments to every user): the
client commands, the agent and `farm team`/`farm agent-token` take tokens from the
environment or a file, and a leftover `--token`/`--value` is refused in one line, exit 2."""

from __future__ import annotations

import io
import sys

import pytest

from services.agent.cli import main as agent_main
from tunefarm_app.cli import main


def refused(capsys, argv_main, argv: list[str], *words: str) -> None:
    with pytest.raises(SystemExit) as done:
        argv_main(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "would show the secret to anyone who runs ps" in err, err
    for w in words:
        assert w in err, err


@pytest.mark.parametrize(
    "argv",
    [
        ["status", "1", "--token", "tft_secret"],
        ["submit", "m.onnx", "--device-class", "c", "--trials", "5", "--token", "tft_secret"],
        ["fetch", "1", "--out", "d", "--token", "tft_secret"],
        ["cancel", "1", "--token", "tft_secret"],
        ["jobs", "--token", "tft_secret"],
        ["devices", "--token=tft_secret"],
    ],
)
def test_a_team_token_on_the_command_line_is_refused(argv, capsys):
    refused(capsys, main, argv, "--token", "TUNEFARM_TOKEN", "--token-file PATH")


def test_an_agent_token_on_the_command_line_is_refused(capsys):
    refused(capsys, agent_main, ["--server", "127.0.0.1:1", "--token", "tfa_secret"],
            "TUNEFARM_AGENT_TOKEN", "--token-file PATH")  # fmt: skip


@pytest.mark.parametrize("command", [["farm", "team", "t"], ["farm", "agent-token"]])
def test_a_stored_token_on_the_command_line_is_refused(command, capsys):
    refused(capsys, main, [*command, "--value", "tft_secret"], "--value-file PATH")


def test_the_agent_reads_its_token_from_a_file(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TUNEFARM_AGENT_TOKEN", raising=False)
    token = tmp_path / "agent-token"
    token.write_text("tfa_" + "x" * 40 + "\n")
    # Past the settings (the token was read): the missing CA file is the error.
    assert agent_main(["--server", "127.0.0.1:1", "--token-file", str(token), "--tls-ca", str(tmp_path / "no.pem"),
                       "--accept-unsigned-code"]) == 2  # fmt: skip
    assert "cannot read the CA certificate" in capsys.readouterr().out
    assert agent_main(["--server", "127.0.0.1:1"]) == 2
    assert "no token: set TUNEFARM_AGENT_TOKEN or pass --token-file" in capsys.readouterr().out
    assert agent_main(["--server", "127.0.0.1:1", "--token-file", str(tmp_path / "none")]) == 2
    out = capsys.readouterr().out.strip()
    assert out.count("\n") == 0 and "cannot read the agent token file" in out


def test_farm_team_stores_a_token_read_from_stdin(database_url, monkeypatch, capsys):
    token = "tft_" + "s" * 40
    monkeypatch.setattr(sys, "stdin", io.StringIO(token + "\n"))
    assert main(["farm", "team", "stdin-team", "--value-file", "-", "--database-url", database_url]) == 0
    assert "token stored" in capsys.readouterr().out
    assert main(["farm", "token", "list", "--team", "stdin-team", "--database-url", database_url]) == 0
    assert token[:8] in capsys.readouterr().out
