"""What `Fetch` serves: the files of an agent's lease (its kernels, the task data) or of
its model run (the library, its inputs and the ONNX graph its peers are timed on), read
from under the artifact root.

Only the files of the lease or model run the agent holds are served (`LeaseLost`
otherwise), named by the ids it was handed; a row's path that would leave the artifact
root, or a file missing from it, is sent as why it cannot be served, never as a file.
Each file goes as parts of at most `fetch_chunk_bytes`, its sha256 with its last part.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from services.common import artifacts
from services.db import exceptions as db_exc
from services.db import model_runs, stored_files
from services.db.session import Session
from services.lease.auth import AgentInfo, held_lease
from services.protocol.errors import BadRequest, LeaseLost
from services.protocol.generated import measurer_pb2 as pb


def fetch_chunks(paths: list[Path | str], limit: int) -> Iterator[pb.FetchChunk]:
    """The files (or why each cannot be served) as FetchChunks of about `limit` bytes."""
    parts: list[pb.FilePart] = []
    size = 0
    for part in file_parts(paths, limit):
        parts.append(part)
        size += len(part.data)
        if size >= limit:
            yield pb.FetchChunk(parts=parts)
            parts, size = [], 0
    if parts:
        yield pb.FetchChunk(parts=parts)


def fetch_paths(s: Session, request: pb.FetchRequest, agent: AgentInfo, root: str | os.PathLike[str]) -> list[Path | str]:
    """The file each of the request's refs names (or why it cannot be served)."""
    if request.model_run_id:
        return _model_run_paths(s, request, agent, root)
    lease = held_lease(s, request.lease_id, agent.agent_id)
    kernel_ids = [r.id for r in request.refs if r.kind == pb.ARTIFACT_KIND_KERNEL]
    found = stored_files.batch_files(s, batch_id=lease.batch_id, kernel_ids=kernel_ids)
    kernels, td = found.kernels, found.task_data
    out: list[Path | str] = []
    for ref in request.refs:
        rel: str | None
        if ref.kind == pb.ARTIFACT_KIND_KERNEL:
            if ref.id not in kernels:
                raise BadRequest(f"candidate {ref.id} is not in the leased batch {found.batch_id}")
            rel = kernels[ref.id]
        elif ref.kind == pb.ARTIFACT_KIND_TASK_DATA:
            if td is None or ref.id != td.id:
                out.append("the batch's workload has no task data")
                continue
            rel = td.path
        else:
            raise BadRequest(f"unknown artifact kind {ref.kind}")
        out.append(_stored(root, rel) if rel else "no built kernel")
    return out

def _model_run_paths(
    s: Session, request: pb.FetchRequest, agent: AgentInfo, root: str | os.PathLike[str]
) -> list[Path | str]:
    try:
        run = model_runs.held_model_run(s, model_run_id=request.model_run_id, agent_id=agent.agent_id)
    except (db_exc.LeaseNotHeld, db_exc.RowNotFound) as exc:
        raise LeaseLost(str(exc)) from None
    files = {pb.ARTIFACT_KIND_MODEL_LIBRARY: run.library_path, pb.ARTIFACT_KIND_MODEL_INPUTS: run.inputs_path}
    if run.onnx_path:
        files[pb.ARTIFACT_KIND_MODEL_ONNX] = run.onnx_path
    out: list[Path | str] = []
    for ref in request.refs:
        if ref.kind not in files or ref.id != run.id:
            raise BadRequest(f"model run {run.id} has no file of kind {ref.kind} and id {ref.id}")
        out.append(_stored(root, files[ref.kind]))
    return out

def _stored(root: str | os.PathLike[str], rel: str) -> Path | str:
    """The file a row's relative path names, or why it cannot be served."""
    try:
        path = artifacts.resolve(root, rel)
    except artifacts.OutsideArtifactRoot as exc:
        return str(exc)
    return path if path.is_file() else f"{rel} is missing from the artifact store"


def file_parts(paths: list[Path | str], limit: int) -> Iterator[pb.FilePart]:
    """The files (or why each cannot be served) as parts of at most `limit` bytes."""
    for index, found in enumerate(paths):
        if isinstance(found, str):
            yield pb.FilePart(index=index, last=True, error=found)
            continue
        try:
            for offset, data, sha in artifacts.read_chunks(found, limit):
                last = sha is not None
                yield pb.FilePart(
                    index=index,
                    offset=offset,
                    data=data,
                    last=last,
                    total_size=offset + len(data) if last else 0,
                    sha256=sha or "",
                )
        except OSError as exc:
            yield pb.FilePart(index=index, last=True, error=f"cannot read {found.name}: {exc.strerror}")
