"""`tunefarm fetch`: download a job's tuned model archive and unpack it, within limits,
all or nothing.

The archive comes from a farm the client does not control. It is streamed to a file in
a temporary directory beside `--out` (at most `FetchLimits.max_archive_bytes`: a
declared length over it is refused before reading, a stream is cut off as it passes
it), checked against the farm's `X-Content-SHA256`, and unpacked there, entry by entry:

- only regular files, named below the archive's `tuned/` directory (no absolute path,
  no `..`, no link or device, no name twice);
- each at most `max_entry_bytes`, all of them together (with a tar header's 512 bytes
  each) at most `max_unpacked_bytes`: a few MiB of gzip cannot unpack into gigabytes.

Only when every entry is unpacked is the result renamed into place (the whole
directory when `--out` is new or empty, else file by file). A refused archive leaves
nothing behind: neither `--out` nor a partial file nor the temporary directory.
"""

from __future__ import annotations

import gzip
import os
import shutil
import tarfile
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from tunefarm.errors import TunefarmError, UsageError
from tunefarm.models.finish import ARCHIVE_ROOT

TAR_HEADER_BYTES = 512
"""What each entry costs besides its data (counted against `max_unpacked_bytes`)."""

COPY_CHUNK_BYTES = 1 << 20


class FetchError(TunefarmError):
    """The farm's archive is too large, malformed, or holds an entry that may not be
    unpacked, or it cannot be put in place: the fetch failed (exit 1), not the command."""


@dataclass(frozen=True)
class FetchLimits:
    max_archive_bytes: int  # the .tar.gz as downloaded
    max_entry_bytes: int  # one unpacked file
    max_unpacked_bytes: int  # every unpacked file, with its tar header


@dataclass(frozen=True)
class Fetched:
    files: list[Path]  # in `out`
    archive_bytes: int


def fetch_tuned_model(client, job_id: int, out: Path, limits: FetchLimits) -> Fetched:
    """Download job `job_id`'s archive with `client` (a `FarmClient`) and unpack it into
    `out` (see the module docstring). Raises `FarmError`/`FetchError`, leaving nothing."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / "manifest.json").is_file():
        # a farm's archive is not trusted to write among the user's own files (say, ~)
        raise UsageError(f"--out {out} is not empty and holds no tuned model (manifest.json): "
                         "choose a new or empty directory; nothing was written")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.fetch-", dir=out.parent) as tmp:
        archive = Path(tmp) / "archive.tar.gz"
        size = client.download_artifact(job_id, archive, max_bytes=limits.max_archive_bytes)
        staged = Path(tmp) / "unpacked"
        relative = unpack(archive, staged, limits, label=f"the archive of job {job_id}")
        try:
            _move_into_place(staged, out, relative)
        except OSError as exc:
            raise FetchError(f"cannot put the tuned model into {out}: {exc.strerror or exc}") from None
    return Fetched([out / r for r in relative], size)


def unpack(archive: Path, dest: Path, limits: FetchLimits, *, label: str) -> list[Path]:
    """Unpack the tuned model archive at `archive` into the new directory `dest`, checking
    every entry; the files' paths relative to `dest`. Raises `FetchError`."""
    dest.mkdir()
    written: list[Path] = []
    unpacked = 0
    try:
        with gzip.open(archive, "rb") as gz:
            with tarfile.open(fileobj=gz, mode="r|") as tar:
                unpacked = _unpack_members(tar, dest, limits, label, written)
            _read_to_the_end(gz, limits.max_unpacked_bytes - unpacked, label)
    except (tarfile.TarError, gzip.BadGzipFile, zlib.error, EOFError) as exc:
        raise FetchError(f"{label} is not a tuned model archive: {exc or type(exc).__name__}") from None
    if not written:
        raise FetchError(f"{label} is empty")
    return written


def _unpack_members(tar: tarfile.TarFile, dest: Path, limits: FetchLimits, label: str, written: list[Path]) -> int:
    """Unpack every entry of `tar` into `dest` (appending to `written`); bytes unpacked."""
    unpacked = 0
    for member in tar:
        relative = _entry_path(member, label)
        if relative in written:
            raise FetchError(f"{label} holds {member.name!r} twice")
        if any(p in written for p in relative.parents) or any(relative in w.parents for w in written):
            raise FetchError(f"{label} holds {member.name!r} both as a file and as a directory")
        if member.size > limits.max_entry_bytes:
            raise FetchError(f"{label}: {member.name!r} is {member.size} bytes, more than tunefarm fetch "
                             f"unpacks per file ({limits.max_entry_bytes}; TUNEFARM_FETCH_MAX_ENTRY_BYTES)")
        unpacked += member.size + TAR_HEADER_BYTES
        if unpacked > limits.max_unpacked_bytes:
            raise FetchError(_unpacks_too_much(label, limits))
        _write_entry(tar, member, dest / relative)
        written.append(relative)
    return unpacked


def _read_to_the_end(gz: gzip.GzipFile, budget: int, label: str) -> None:
    """Read what follows the tar's last entry to the gzip stream's end, where its CRC
    and length are checked (a truncated or damaged download fails there); at most
    `budget` bytes of it."""
    while chunk := gz.read(COPY_CHUNK_BYTES):
        budget -= len(chunk)
        if budget < 0:
            raise FetchError(f"{label} unpacks to more than tunefarm fetch takes (trailing data)")


def _unpacks_too_much(label: str, limits: FetchLimits) -> str:
    return (f"{label} unpacks to more than tunefarm fetch takes "
            f"({limits.max_unpacked_bytes} bytes; TUNEFARM_FETCH_MAX_UNPACKED_BYTES)")


def _entry_path(member: tarfile.TarInfo, label: str) -> Path:
    """The path an entry unpacks to, below the destination; `FetchError` for any entry
    that is not a regular file below the archive's top directory."""
    parts = PurePosixPath(member.name).parts
    if parts[:1] == (ARCHIVE_ROOT,):
        parts = parts[1:]
    bad = not member.isfile() or not parts or PurePosixPath(member.name).is_absolute() or ".." in parts
    # no hidden names: a tuned model has none, and `.ssh/...` has no business in one
    if bad or any(p in ("", ".") or p.startswith(".") for p in parts) or "\\" in member.name:
        raise FetchError(f"{label} holds an unexpected entry {member.name!r}; nothing was unpacked")
    return Path(*parts)


def _write_entry(tar: tarfile.TarFile, member: tarfile.TarInfo, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    source = tar.extractfile(member)
    assert source is not None  # a regular file
    size = 0
    with open(path, "xb") as out:
        while chunk := source.read(COPY_CHUNK_BYTES):
            size += len(chunk)
            out.write(chunk)
    if size != member.size:
        raise tarfile.ReadError(f"{member.name!r} ends after {size} of its {member.size} bytes")


def _move_into_place(staged: Path, out: Path, relative: list[Path]) -> None:
    """`staged` becomes `out`: renamed whole when `out` is new or empty, else file by file
    (files `out` already has that the archive does not are kept)."""
    if not out.exists():
        os.rename(staged, out)
        return
    if not any(out.iterdir()):
        os.rmdir(out)
        os.rename(staged, out)
        return
    for r in relative:
        target = out / r
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staged / r, target)
