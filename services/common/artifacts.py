"""The artifact root: its directory layout, and reading and writing files under it.

The artifact root is a directory shared by the farm's server-side processes; rows keep
paths relative to it. Agents never see it: they fetch files over gRPC (the lease service
reads them here). Every path under it is made by a function of this module:

    models/<sha256>.onnx           an uploaded model, by content (the API)
    models/<sha256>.fused.json     its fused Relax module, weights included (the API)
    workloads/<workload id>.json   a workload's IRModule, for the builders (build workers)
    task_data/<workload id>.npz    inputs and expected outputs of a workload (the scheduler)
    kernels/<sha1>.so | .tar       built kernels (build workers; tunefarm.measure.builder names them)
    model_runs/<job id>/<uuid>/    a tuned model run on an agent: its library and inputs.npz
                                   (the scheduler), the outputs.npz the agent sent back (the
                                   lease service)
    cost_models/<class id>/        versions of a device class's shared cost model (the scheduler)
    jobs/<job id>/tuned.tar.gz     a finished job's tuned model archive (the scheduler)
    scheduler/<pid>/               the scheduler's own builds (reference outputs of task data)
    tmp/                           staging (uploads, tuned models being packed)
"""
from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

from services.protocol.signing import file_sha256

MODELS_DIR = "models"
WORKLOADS_DIR = "workloads"
TASK_DATA_DIR = "task_data"
KERNELS_DIR = "kernels"
MODEL_RUNS_DIR = "model_runs"
COST_MODELS_DIR = "cost_models"
JOBS_DIR = "jobs"
SCHEDULER_DIR = "scheduler"
STAGING_DIR = "tmp"

JOB_ARCHIVE_NAME = "tuned.tar.gz"
"""A finished job's tuned model archive, in its directory under `jobs/`."""

MODEL_RUN_INPUTS_NAME = "inputs.npz"
MODEL_RUN_OUTPUTS_NAME = "outputs.npz"
"""A model run's inputs (the scheduler's) and outputs (the agent's), beside its library."""

DEFAULT_CHUNK_BYTES = 256 * 1024
"""Bytes per Fetch chunk: well under gRPC's 4 MiB message limit, large enough that a
24 KB kernel is one message."""


class OutsideArtifactRoot(ValueError):
    """A stored path that would leave the artifact root."""


# -- the layout: paths relative to the root, as rows store them ----------------------------


def uploaded_model_path(sha256: str, suffix: str) -> str:
    """An uploaded model's file (or its fused module's), by the sha256 of its bytes."""
    return f"{MODELS_DIR}/{sha256}{suffix}"


def workload_path(workload_id: int) -> str:
    return f"{WORKLOADS_DIR}/{workload_id}.json"


def task_data_path(workload_id: int) -> str:
    return f"{TASK_DATA_DIR}/{workload_id}.npz"


def model_run_dir(job_id: int, run_name: str) -> str:
    """The directory of one model run of a job (`run_name`: unique, made by its creator)."""
    return f"{MODEL_RUNS_DIR}/{job_id}/{run_name}"


def model_run_outputs_path(inputs_path: str) -> str:
    """Where a model run's outputs are kept: beside its inputs."""
    return f"{PurePosixPath(inputs_path).parent.as_posix()}/{MODEL_RUN_OUTPUTS_NAME}"


def cost_model_dir(device_class_id: int) -> str:
    return f"{COST_MODELS_DIR}/{device_class_id}"


def job_archive_path(job_id: int) -> str:
    return f"{JOBS_DIR}/{job_id}/{JOB_ARCHIVE_NAME}"


def scheduler_work_dir(pid: int) -> str:
    """A scheduler process's own build directory."""
    return f"{SCHEDULER_DIR}/{pid}"


# -- files under the root ------------------------------------------------------------------


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
