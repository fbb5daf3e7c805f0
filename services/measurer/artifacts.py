"""Files under the artifact root, as the lease service hands them out.

The artifact root is a directory shared by the farm's server-side processes (build
workers write kernels into it, the scheduler task data, the lease service reads both);
rows keep paths relative to it. Agents never see it: they fetch files over gRPC.

    kernels/<sha1>.so | .tar     built kernels (tunefarm.measure.builder names them)
    task_data/<workload id>.npz  inputs and expected outputs of a workload
    workloads/<workload id>.json the workload's IRModule, for the builders
    model_runs/<job id>/<uuid>/  a tuned model run on an agent: model.so, inputs.npz,
                                 and the outputs.npz the agent sent back
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from services.protocol.signing import file_sha256

KERNELS_DIR = "kernels"
TASK_DATA_DIR = "task_data"
WORKLOADS_DIR = "workloads"
MODEL_RUNS_DIR = "model_runs"

DEFAULT_CHUNK_BYTES = 256 * 1024
"""Bytes per Fetch chunk: well under gRPC's 4 MiB message limit, large enough that a
24 KB kernel is one message."""


class OutsideArtifactRoot(ValueError):
    """A stored path that would leave the artifact root."""


def resolve(root: str | os.PathLike[str], relative: str) -> Path:
    """The file a stored relative path names; never a file outside `root`."""
    base = Path(root).resolve()
    path = (base / relative).resolve()
    if path != base and base not in path.parents:
        raise OutsideArtifactRoot(f"{relative!r} is outside the artifact root")
    return path


def relative_to_root(root: str | os.PathLike[str], path: str | os.PathLike[str]) -> str:
    """The form a row stores: `path` relative to the artifact root (posix separators)."""
    return Path(path).resolve().relative_to(Path(root).resolve()).as_posix()


def read_chunks(path: Path, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[tuple[int, bytes, str | None]]:
    """(offset, data, sha256 of the file or None) per chunk; the sha256 comes with the
    last chunk (an empty file is one empty chunk). Raises OSError if unreadable."""
    digest = hashlib.sha256()
    offset = 0
    with open(path, "rb") as f:
        data = f.read(chunk_bytes)
        while True:
            nxt = f.read(chunk_bytes) if data else b""
            digest.update(data)
            last = not nxt
            yield offset, data, digest.hexdigest() if last else None
            if last:
                return
            offset += len(data)
            data = nxt


def put(root: str | os.PathLike[str], relative: str, data: bytes | Path) -> tuple[str, int]:
    """Write `data` (bytes, or a file's content) to `relative` under the root, atomically
    (a reader never sees half a file); returns its sha256 and size."""
    dest = resolve(root, relative)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f"{dest.name}.{os.getpid()}.tmp")
    try:
        if isinstance(data, Path):
            shutil.copyfile(data, tmp)
        else:
            tmp.write_bytes(data)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return file_sha256(dest), dest.stat().st_size
