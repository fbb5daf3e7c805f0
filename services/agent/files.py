"""What an agent downloads, and what of it it accepts.

A lease's kernels and, unless cached, its task data come in one Fetch stream
(`Downloads.batch_files`), a model run's library, inputs and ONNX graph in another
(`fetch`); a stream broken by a transport error is opened again for what is missing.
Each file is written to `<name>.part`, checked against the sha256 the server sent and
renamed (`_Sink`); then it is accepted or deleted (`Downloads._accepted`): code (and a
model run's ONNX graph) only with the farm's signature over the bytes received (when
the agent has the farm's public key), task data only when its bytes are the sha256 it
is cached under. Files are saved under names made here, never under a name the server
sent (see the package's docstring for what an agent trusts).

Every file is capped: at the size the lease declared for it (`ArtifactRef.size`, when it
did) and at `max_download_bytes` in any case. A file the lease declared larger than the
cap is not asked for; one that grows past its cap as it streams is refused at the first
part over it, the stream is cancelled (the rest is never read) and the files it had not
delivered yet are asked for again. The refusal is that file's error (its candidate's
result, or the model run's), never the agent's.

Task data is cached in the work directory (the `TASK_DATA_CACHE` most recently used).
"""
from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

import grpc

from services.agent.channel import FATAL_ERRORS, AgentLink, Backoff
from services.agent.kernel_files import LOADABLE_SUFFIXES, KernelFiles, local_file_name
from services.protocol.errors import LeaseLost, MeasurerError, Transient, from_rpc_error
from services.protocol.generated import measurer_pb2 as pb
from services.protocol.signing import SHA256_HEX, ArtifactVerifier, BadSignature, SignedKind

log = logging.getLogger("tunefarm.agent")

TASK_DATA_CACHE = 8
"""Task data files kept in the agent's work directory (least recently used go first)."""

FETCH_ATTEMPTS = 5
"""Tries of a batch's Fetch before its missing files count as unavailable."""

SIGNED_KINDS = {
    pb.ARTIFACT_KIND_KERNEL: SignedKind.KERNEL,
    pb.ARTIFACT_KIND_MODEL_LIBRARY: SignedKind.MODEL_LIBRARY,
    pb.ARTIFACT_KIND_MODEL_ONNX: SignedKind.MODEL_ONNX,
}
"""The files that are code, or that native parsers read (the peers' ONNX graph): used only
with the farm's signature."""


class TooLarge(Exception):
    """A file grew past its cap as it was downloaded (`_Sink.write`)."""


class Downloads:
    """An agent's downloads: into `files` (where its kernel process reads them), code
    checked with `verifier` (None: `--accept-unsigned-code`)."""

    def __init__(self, agent: AgentLink, files: KernelFiles, verifier: ArtifactVerifier | None):
        self.agent = agent
        self.files = files
        self.verifier = verifier

    def batch_files(self, batch: pb.LeasedBatch, lease_dir: Path) -> tuple[dict[int, Path | str], Path | str]:
        """Download the batch's kernels, and its task data unless cached: one Fetch stream
        (retried for what is missing after a transport error). Returns each candidate's
        kernel path or why it is unavailable, and the task data's path or why not. Files
        are saved under names made here (`local_file_name`, the task data's checked
        sha256), never under a name the server sent."""
        self.files.make_dir(lease_dir.parent)
        self.files.make_dir(lease_dir, writable=True)  # a CUDA or .tar kernel unpacks next to itself
        cache = self.files.root / "task_data"
        self.files.make_dir(cache)
        out: dict[int, Path | str] = {}
        wanted: list[tuple[pb.ArtifactRef, Path]] = []
        for cand in batch.candidates:
            name = local_file_name(cand.kernel.file_name, str(cand.batch_candidate_id))
            if not cand.kernel.file_name:
                out[cand.batch_candidate_id] = "the candidate has no built kernel"
            elif name is None:
                out[cand.batch_candidate_id] = f"refused: its file name ends in none of {LOADABLE_SUFFIXES}"
            elif cand.kernel.id != cand.batch_candidate_id:
                out[cand.batch_candidate_id] = "refused: the kernel offered is another candidate's"
            else:
                wanted.append((cand.kernel, lease_dir / name))
        td_ref = batch.task_data
        task_data: Path | str
        if not td_ref.id:
            task_data = "the workload has no task data"
        elif not SHA256_HEX.fullmatch(td_ref.sha256):
            task_data = "refused: the server named it by something other than a sha256"
        else:
            task_data = cache / f"{td_ref.sha256}.npz"
            if task_data.is_file() and (not td_ref.size or task_data.stat().st_size == td_ref.size):
                task_data.touch()  # most recently used
                self.files.share_file(task_data)
            else:
                wanted.append((td_ref, task_data))
        done = self.fetch(wanted, lease_id=batch.lease_id)
        for i, (ref, _) in enumerate(wanted):
            got = done.get(i, "not fetched")
            if ref.kind == pb.ARTIFACT_KIND_TASK_DATA:
                task_data = got
            else:
                out[ref.id] = got
        if isinstance(task_data, Path):
            _evict(cache, keep=TASK_DATA_CACHE)
        return out, task_data

    def fetch(
        self, wanted: list[tuple[pb.ArtifactRef, Path]], *, lease_id: int = 0, model_run_id: int = 0
    ) -> dict[int, Path | str]:
        """Download the files of a lease (or of a model run) to their paths: one Fetch
        stream, retried for what is missing after a transport error. Returns, by index
        in `wanted`, each file's path or why it is unavailable."""
        done: dict[int, Path | str] = {}
        cap = self.agent.settings.max_download_bytes
        for i, (ref, _) in enumerate(wanted):
            if ref.size > cap:
                done[i] = f"refused: {ref.size} bytes declared, more than the agent downloads ({cap})"
                log.warning("%s %d %s", pb.ArtifactKind.Name(ref.kind), ref.id, done[i])
        backoff = Backoff(self.agent.settings.reconnect_max_secs)
        for attempt in range(FETCH_ATTEMPTS):
            todo = [i for i in range(len(wanted)) if i not in done]
            if not todo:
                break
            try:
                self._fetch_once([wanted[i] for i in todo], todo, done, lease_id=lease_id, model_run_id=model_run_id)
            except LeaseLost:
                raise
            except MeasurerError as exc:
                if isinstance(exc, FATAL_ERRORS) or attempt == FETCH_ATTEMPTS - 1:
                    for i in todo:
                        done.setdefault(i, f"fetch failed: {exc}")
                    break
                self.agent.stop.wait(backoff.next())
        return done

    def _fetch_once(
        self,
        files: list[tuple[pb.ArtifactRef, Path]],
        indices: list[int],
        done: dict[int, Path | str],
        *,
        lease_id: int,
        model_run_id: int,
    ) -> None:
        assert self.agent.agent_id is not None
        request = pb.FetchRequest(
            agent_id=self.agent.agent_id, lease_id=lease_id, model_run_id=model_run_id, refs=[ref for ref, _ in files]
        )
        sinks: dict[int, _Sink] = {}
        timeout = max(60.0, self.agent.settings.rpc_timeout_secs * 4)
        call = self.agent.stub.Fetch(request, metadata=self.agent.metadata, timeout=timeout)
        try:
            for chunk in call:
                for part in chunk.parts:
                    if not 0 <= part.index < len(files):
                        raise Transient(f"the server sent part of file {part.index}; {len(files)} were asked for")
                    if indices[part.index] in done:
                        raise Transient(f"the server sent more of file {part.index} after its end")
                    ref, dest = files[part.index]
                    sink = sinks.get(part.index)
                    if part.error:
                        if sink is not None:
                            sink.discard()
                        done[indices[part.index]] = part.error
                        continue
                    if sink is None:
                        sink = sinks[part.index] = _Sink(dest, self._cap(ref))
                    try:
                        sink.write(part.offset, part.data)
                    except TooLarge as exc:
                        sink.discard()
                        done[indices[part.index]] = f"refused: {exc}"
                        log.warning("%s %d refused: %s", pb.ArtifactKind.Name(ref.kind), ref.id, exc)
                        return  # read no more of the stream; `fetch` asks again for the files not done
                    if part.last:
                        got = sink.close(part.sha256)
                        done[indices[part.index]] = self._accepted(ref, got, sink.sha256) if isinstance(got, Path) else got
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        finally:
            call.cancel()  # nothing more is read of a stream left early (no-op once it ended)
            for sink in sinks.values():
                sink.discard()

    def _cap(self, ref: pb.ArtifactRef) -> tuple[int, str]:
        """The most bytes the file may have, and what says so."""
        cap = self.agent.settings.max_download_bytes
        if 0 < ref.size <= cap:
            return ref.size, "the size the lease declared"
        return cap, "the agent's download limit (TUNEFARM_AGENT_MAX_DOWNLOAD_BYTES)"

    def _accepted(self, ref: pb.ArtifactRef, path: Path, sha256: str) -> Path | str:
        """`path` once downloaded, if it may be used: task data whose bytes are the sha256
        it is cached under; code with the farm's signature over the bytes received (when
        the agent has the farm's public key). Otherwise it is deleted: why, as a string."""
        problem = ""
        if ref.kind == pb.ARTIFACT_KIND_TASK_DATA and sha256 != ref.sha256:
            problem = "refused: its bytes are not the sha256 it was named by"
        kind = SIGNED_KINDS.get(ref.kind)
        if kind is not None and self.verifier is not None:
            try:
                self.verifier.verify(kind, ref.signed_as or ref.id, sha256, ref.signature)
            except BadSignature as exc:
                problem = f"not loaded: {exc}"
                log.warning("%s %d %s", kind, ref.id, problem)
        if problem:
            path.unlink(missing_ok=True)
            return problem
        self.files.share_file(path)
        return path


class _Sink:
    """One file being downloaded: written to `<dest>.part`, checked, then renamed; never
    more than `cap` bytes (the limit, and what sets it)."""

    def __init__(self, dest: Path, cap: tuple[int, str]):
        self.dest = dest
        self.cap, self._cap_source = cap
        self.part = dest.with_name(dest.name + ".part")
        self._file: Any = open(self.part, "wb")
        self._sha = hashlib.sha256()
        self._size = 0
        self.sha256 = ""  # of the bytes received, once closed

    def write(self, offset: int, data: bytes) -> None:
        if offset != self._size:
            raise Transient(f"{self.dest.name}: chunk at {offset}, expected {self._size}")
        if self._size + len(data) > self.cap:
            raise TooLarge(f"more than {self.cap} bytes, {self._cap_source}")
        self._file.write(data)
        self._sha.update(data)
        self._size += len(data)

    def close(self, sha256: str) -> Path | str:
        self._file.close()
        self._file = None
        self.sha256 = self._sha.hexdigest()
        if sha256 and sha256 != self.sha256:
            self.part.unlink(missing_ok=True)
            return f"{self.dest.name}: checksum mismatch"
        os.replace(self.part, self.dest)
        return self.dest

    def discard(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
            self.part.unlink(missing_ok=True)


def _evict(directory: Path, keep: int) -> None:
    files = sorted((p for p in directory.glob("*.npz")), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in files[keep:]:
        old.unlink(missing_ok=True)
