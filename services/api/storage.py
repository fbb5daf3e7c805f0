"""The API's files under the artifact root (rows keep paths relative to it; the layout is
services/common/artifacts.py's):

    models/<sha256>.onnx         an uploaded model, by content
    models/<sha256>.fused.json   its fused Relax module (weights included), by content
    jobs/<job id>/tuned.tar.gz   a finished job's tuned model archive (the scheduler writes it)
    tmp/                         staging of uploads; emptied of a request's files when it ends

Files are written under a temporary name and renamed into place, so a reader never
sees half a file, and identical content is stored once. A file's address is the hash of
the bytes renamed into place, computed then (never one computed earlier, of a file
that may have changed since).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from services.common import artifacts
from services.db.model_runs import StoredFile

COPY_CHUNK_BYTES = 1 << 20


@contextmanager
def staging(root: Path) -> Iterator[Path]:
    """A private directory under the artifact root, removed with what is left in it."""
    base = root / artifacts.STAGING_DIR
    base.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix="upload-", dir=base))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def copy_limited(source: BinaryIO, dest: Path, *, limit: int) -> int | None:
    """Copy `source` to `dest`; its size, or None (and `dest` removed) as soon as more
    than `limit` bytes have come."""
    size = 0
    with open(dest, "wb") as out:
        while chunk := source.read(COPY_CHUNK_BYTES):
            size += len(chunk)
            if size > limit:
                break
            out.write(chunk)
    if size > limit:
        dest.unlink(missing_ok=True)
        return None
    return size


def file_sha256(path: Path) -> tuple[str, int]:
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(COPY_CHUNK_BYTES):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def keep(root: Path, staged: Path, *, suffix: str) -> StoredFile:
    """Move a staged file to `models/<sha256><suffix>`, its address the hash of the bytes
    moved (kept once per content). A file already there is kept if it holds those bytes,
    and replaced if it does not."""
    sha256, size = file_sha256(staged)
    rel = artifacts.uploaded_model_path(sha256, suffix)
    dest = root / rel
    dest.parent.mkdir(parents=True, exist_ok=True)
    if not (dest.is_file() and file_sha256(dest) == (sha256, size)):
        os.replace(staged, dest)
    return StoredFile(rel, sha256, size)
