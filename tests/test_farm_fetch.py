"""`tunefarm fetch` against a farm that sends what it likes (a loopback HTTP server): the
archive, each file and all of them unpacked are capped, a bad entry anywhere refuses the
whole archive, and a refused fetch leaves nothing behind (no --out, no partial file, no
temporary directory); a good one lands whole."""

from __future__ import annotations

import hashlib
import http.server
import io
import tarfile
import threading
from pathlib import Path

import pytest

pytest.importorskip("httpx")

from tunefarm_app.cli import main  # noqa: E402

ANSWERS: dict[int, dict] = {}
"""Job id -> what the server answers for its artifact: body, and whether to declare
its length / its sha256."""


class ArtifactServer(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        job = int(self.path.split("/")[3])
        answer = ANSWERS[job]
        body = answer["body"]
        self.send_response(200)
        self.send_header("Content-Type", "application/gzip")
        if answer.get("length", True):
            self.send_header("Content-Length", str(answer.get("declared", len(body))))
        if answer.get("sha256") is not None:
            self.send_header("X-Content-SHA256", answer["sha256"])
        self.send_header("Connection", "close")
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server() -> str:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), ArtifactServer)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def archive(entries: list[tuple[str, bytes | str]]) -> bytes:
    """A .tar.gz of (name, bytes) files, or (name, "->target") symlinks, in order."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in entries:
            info = tarfile.TarInfo(name)
            if isinstance(data, str):
                info.type, info.linkname = tarfile.SYMTYPE, data[2:]
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


GOOD = [("tuned/model.so", b"\x7fELF" + b"k" * 5000), ("tuned/manifest.json", b"{}"),
        ("tuned/records.jsonl", b"{}\n" * 100), ("tuned/report.json", b"{}")]


def fetch(server, job: int, out: Path, monkeypatch, **env) -> int:
    monkeypatch.setenv("TUNEFARM_TOKEN", "tft_test")
    for k, v in env.items():
        monkeypatch.setenv(k, str(v))
    return main(["fetch", str(job), "--out", str(out), "--server", server])


def left_in(parent: Path) -> list[str]:
    return sorted(str(p.relative_to(parent)) for p in parent.rglob("*"))


def test_a_good_archive_lands_whole(server, tmp_path, monkeypatch, capsys):
    body = archive(GOOD)
    ANSWERS[1] = {"body": body, "sha256": hashlib.sha256(body).hexdigest()}
    out = tmp_path / "out"
    assert fetch(server, 1, out, monkeypatch) == 0
    assert left_in(tmp_path) == ["out", "out/manifest.json", "out/model.so", "out/records.jsonl", "out/report.json"]
    assert (out / "model.so").read_bytes() == GOOD[0][1]
    assert "fetched    job 1: 4 files" in capsys.readouterr().out
    (out / "mine.txt").write_text("kept")  # fetched again into a directory with a file of the user's
    assert fetch(server, 1, out, monkeypatch) == 0
    assert (out / "mine.txt").read_text() == "kept" and (out / "model.so").read_bytes() == GOOD[0][1]


@pytest.mark.parametrize(
    ("entries", "words"),
    [
        ([*GOOD, ("tuned/../../escape", b"x")], "unexpected entry"),
        ([*GOOD, ("/etc/cron.d/x", b"x")], "unexpected entry"),
        ([*GOOD, ("tuned/link", "->/etc/passwd")], "unexpected entry"),
        ([*GOOD, ("tuned/model.so", b"again")], "twice"),
        ([*GOOD[:2], ("tuned/big.bin", b"\0" * 300_000)], "per file"),
        ([*GOOD, ("tuned/a", b"x"), ("tuned/a/b", b"y")], "both as a file and as a directory"),
        ([*GOOD, ("tuned/a/b", b"y"), ("tuned/a", b"x")], "both as a file and as a directory"),
        ([*GOOD, ("tuned/.ssh/authorized_keys", b"ssh-ed25519 AAAA")], "unexpected entry"),
    ],
    ids=["dotdot", "absolute", "symlink", "twice", "entry-too-large", "file-then-dir", "dir-then-file", "hidden"],
)
def test_a_bad_entry_after_good_ones_leaves_nothing_behind(server, tmp_path, monkeypatch, capsys, entries, words):
    """The bad entry comes last: before, the good ones were already written to --out."""
    ANSWERS[2] = {"body": archive(entries)}
    assert fetch(server, 2, tmp_path / "out", monkeypatch, TUNEFARM_FETCH_MAX_ENTRY_BYTES=100_000) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and words in err, err
    assert left_in(tmp_path) == []


def test_a_non_empty_out_that_holds_no_tuned_model_is_refused(server, tmp_path, monkeypatch, capsys):
    """A farm's archive does not write among a user's own files (say, --out ~)."""
    out = tmp_path / "home"
    out.mkdir()
    (out / ".bashrc").write_text("mine")
    body = archive(GOOD)
    ANSWERS[40] = {"body": body, "sha256": hashlib.sha256(body).hexdigest()}
    assert fetch(server, 40, out, monkeypatch) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "not empty" in err, err
    assert left_in(tmp_path) == ["home", "home/.bashrc"]


def test_a_refused_archive_leaves_an_existing_out_as_it_was(server, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.so").write_bytes(b"the old one")
    (out / "manifest.json").write_text("{}")  # an earlier fetch's tuned model: --out may be reused
    ANSWERS[3] = {"body": archive([("tuned/model.so", b"new"), ("tuned/../x", b"x")])}
    assert fetch(server, 3, out, monkeypatch) == 1  # the archive is refused, not the command
    assert left_in(tmp_path) == ["out", "out/manifest.json", "out/model.so"]
    assert (out / "model.so").read_bytes() == b"the old one"


@pytest.mark.parametrize("declared", [True, False], ids=["declared", "streamed"])
def test_an_archive_over_the_download_cap_is_refused(server, tmp_path, monkeypatch, capsys, declared):
    ANSWERS[4] = {"body": archive(GOOD) + b"\0" * 200_000, "length": declared}
    assert fetch(server, 4, tmp_path / "out", monkeypatch, TUNEFARM_FETCH_MAX_BYTES=100_000) == 1
    err = capsys.readouterr().err
    assert "more than tunefarm fetch downloads (100000" in err, err
    assert left_in(tmp_path) == []


def test_a_small_archive_unpacking_into_too_much_is_refused(server, tmp_path, monkeypatch, capsys):
    body = archive([(f"tuned/zeros-{i}.bin", b"\0" * 1_000_000) for i in range(8)])  # 8 MB of zeros, ~8 KiB sent
    assert len(body) < 100_000
    ANSWERS[5] = {"body": body}
    assert fetch(server, 5, tmp_path / "out", monkeypatch, TUNEFARM_FETCH_MAX_UNPACKED_BYTES=3_000_000) == 1
    assert "unpacks to more than" in capsys.readouterr().err
    assert left_in(tmp_path) == []


@pytest.mark.parametrize("body", [b"not gzip at all", archive(GOOD)[:-20], archive(GOOD)[:-4]],
                         ids=["garbage", "truncated", "no-length-trailer"])
def test_a_broken_archive_is_one_line(server, tmp_path, monkeypatch, capsys, body):
    ANSWERS[6] = {"body": body}
    assert fetch(server, 6, tmp_path / "out", monkeypatch) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "not a tuned model archive" in err, err
    assert left_in(tmp_path) == []


def test_a_damaged_download_is_refused(server, tmp_path, monkeypatch, capsys):
    ANSWERS[7] = {"body": archive(GOOD), "sha256": "0" * 64}
    assert fetch(server, 7, tmp_path / "out", monkeypatch) == 1
    assert "damaged" in capsys.readouterr().err
    assert left_in(tmp_path) == []
