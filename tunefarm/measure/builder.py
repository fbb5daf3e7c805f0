"""Builders: turn `BuildInput`s (workload + schedule trace + target) into shared libraries.

A builder never raises for a bad candidate: a failed build is a `BuildResult` with an
`ErrorKind` and a message. `LocalBuilder` builds in long-lived isolated processes on this
machine; a queue worker can call the same job function, `build_module`, with plain
arguments (the workload by the path of its JSON file, the trace as JSON data).
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tunefarm import cuda
from tunefarm.export import artifact_suffix, export_library
from tunefarm.gpu import GpuLimits, is_gpu
from tunefarm.isolation import WITHOUT_TORCH, CallStatus, IsolatedWorker, summarize_error
from tunefarm.records import BuildInput, BuildResult, Stage, TraceJSON, failure_kind


class Builder(ABC):
    """Builds the candidates of one measured batch."""

    parallelism: int = 1
    """Builds that run at once (a caller may overlap that many independent `build` calls)."""

    def start(self) -> None:  # noqa: B027 (optional hook, nothing to do by default)
        """Called once before the first batch; may prepare workers so that the first
        batch does not pay their start-up."""

    @abstractmethod
    def build(self, inputs: Sequence[BuildInput]) -> list[BuildResult]:
        """Called once per measured batch. Returns one result per input, in input order.
        Never raises for a bad candidate: errors are `BuildResult.error_kind`."""

    @abstractmethod
    def close(self) -> None:
        """Called once when tuning is over; releases workers. The builder is unusable after."""

    def __enter__(self) -> Builder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalBuilder(Builder):
    """Builds a batch in parallel over `n_workers` isolated worker processes.

    Artifacts go to `work_dir`, named by a hash of what determines the program (workload,
    trace, target, candidate key), so equal programs share one file and different tasks
    never overwrite each other's. Nothing is deleted: `work_dir` is the caller's.
    """

    def __init__(self, work_dir: str | os.PathLike[str], n_workers: int = 2, *, start_timeout: float = 120.0):
        if n_workers < 1:
            raise ValueError(f"n_workers must be at least 1, got {n_workers}")
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.parallelism = n_workers
        self._workers = [
            IsolatedWorker(
                env={"TVM_NUM_THREADS": "1"},  # a build runs no kernels; keep TVM's pool small
                preload=["tvm", __name__],
                blocked_imports=WITHOUT_TORCH,
                start_timeout=start_timeout,
                name=f"builder{i}",
            )
            for i in range(n_workers)
        ]
        self._idle: queue.SimpleQueue[IsolatedWorker] = queue.SimpleQueue()
        for w in self._workers:
            self._idle.put(w)
        self._pool = ThreadPoolExecutor(n_workers, thread_name_prefix="builder")

    def start(self) -> None:
        """Start all workers (in parallel) and wait until they have imported TVM."""
        for f in [self._pool.submit(w.start) for w in self._workers]:
            f.result()

    def build(self, inputs: Sequence[BuildInput]) -> list[BuildResult]:
        futures = [self._pool.submit(self._build_one, inp) for inp in inputs]
        return [f.result() for f in futures]

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for w in self._workers:
            w.close()

    def artifact_path(self, inp: BuildInput) -> Path:
        """Named by what determines the program, so equal programs share one file."""
        h = hashlib.sha1()
        for part in (inp.candidate_key, json.dumps(inp.target, sort_keys=True), json.dumps(inp.trace), inp.workload):
            h.update(part.encode())
            h.update(b"\0")
        return self.work_dir / f"{h.hexdigest()}{artifact_suffix(inp.target)}"

    def _build_one(self, inp: BuildInput) -> BuildResult:
        worker = self._idle.get()
        try:
            path = self.artifact_path(inp)
            outcome = worker.call(_BUILD_JOB, inp.workload, inp.trace, inp.target, str(path), timeout=inp.timeout_secs)
        finally:
            self._idle.put(worker)
        if outcome.status is CallStatus.OK:
            return BuildResult(inp.candidate_key, str(path), float(outcome.value))
        kind = failure_kind(Stage.BUILD, outcome.status)
        if outcome.status is CallStatus.TIMED_OUT:
            msg = f"build: {outcome.message}"
        elif outcome.status is CallStatus.CRASHED:
            msg = f"builder process crashed: {outcome.message}"
        else:
            msg = summarize_error(outcome.message.removeprefix("BuildError: "))
        return BuildResult(inp.candidate_key, None, outcome.secs, kind, msg)


# -- the job, run inside a worker process -------------------------------------------------

_BUILD_JOB = f"{__name__}:build_module"

_WORKLOAD_CACHE_SIZE = 16
"""Parsed workloads kept per worker process (a tuning round builds many candidates of few tasks)."""

_workloads: OrderedDict[tuple[str, int, int], Any] = OrderedDict()


class BuildError(Exception):
    """One step of `build_module` failed; the message names the step and TVM's reason."""


def build_module(workload: str, trace: TraceJSON | None, target: dict[str, Any], out_path: str) -> float:
    """Build one candidate: load the workload (the path of its IRModule JSON), replay the
    schedule trace on it (none: the unscheduled program), split off any layout transform
    of a constant input (`tunefarm.layout`), compile for `target` and export the shared
    library to `out_path`. For a CUDA target the kernels first pass TVM's GPU code
    verifier, and the artifact holds nvcc's binary for the target's arch (`tunefarm.cuda`).

    Returns the wall time of the build in seconds. Raises `BuildError` naming the step that
    failed. Plain arguments, so any worker (an isolated process, an RQ job) can call it.
    """
    import tvm

    from tunefarm import fastmath, layout, tir_pipeline

    # Vectorizable exp/tanh/erf, whole vectors and horizontal reductions for scheduled programs; the
    # unscheduled program (a reference) keeps libm's and TVM's own lowering.
    if trace is not None:
        fastmath.install()
        tir_pipeline.register()
    else:
        fastmath.uninstall()
    t0 = time.perf_counter()
    mod = _step("loading the workload", _load_workload, workload)
    if trace is not None:
        mod = _step("replaying the schedule trace", _apply_trace, mod, trace)
        # A constant input stored in a rewritten layout: the kernel takes it transformed,
        # and the library also holds the transform (see tunefarm.layout).
        mod = _step("splitting off the layout transform", layout.kernel_library_module, mod)
    if is_gpu(target):
        # Checked before the compile: a kernel over the GPU's limits never costs nvcc.
        bad = _step("verifying the GPU code", cuda.verify, mod, target)
        if bad:
            limits = GpuLimits.of(target)
            raise BuildError(
                f"TVM's GPU code verifier rejects kernel {', '.join(bad)} for {limits.arch} "
                f"(at most {limits.max_threads_per_block} threads, {limits.max_shared_memory_per_block} bytes of "
                f"shared memory per block, {limits.max_vthreads} vthreads, {limits.max_vector_bytes}-byte vectors)"
            )
        tvm_target = _step("making the target", cuda.tvm_target, target)
        cuda.use_nvcc(target)  # the binary tvm.compile embeds where TVM's CUDA runtime is present
        with cuda.lowering(target):  # cp.async for the pipelined shared stages (sm_80+)
            ex = _step("compiling", tvm.compile, mod, target=tvm_target)
    else:
        tvm_target = _step("making the target", tvm.target.Target, target)
        pipeline = tir_pipeline.PIPELINE if trace is not None else "default"
        ex = _step("compiling", tvm.compile, mod, target=tvm_target, tir_pipeline=pipeline)
    _step("exporting the library", export_library, ex, out_path, target)
    return time.perf_counter() - t0


def _step(what: str, func: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return func(*args, **kwargs)
    except Exception as exc:
        raise BuildError(f"{what} failed: {summarize_error(f'{type(exc).__name__}: {exc}')}") from None


def _load_workload(path: str) -> Any:
    import tvm

    st = os.stat(path)
    key = (path, st.st_mtime_ns, st.st_size)
    mod = _workloads.get(key)
    if mod is None:
        mod = tvm.ir.load_json(Path(path).read_text())
        _workloads[key] = mod
        if len(_workloads) > _WORKLOAD_CACHE_SIZE:
            _workloads.popitem(last=False)
    else:
        _workloads.move_to_end(key)
    return mod


def _apply_trace(mod: Any, trace: TraceJSON) -> Any:
    import tvm

    from tunefarm import wmma

    if wmma.uses_wmma(trace):
        wmma.register()
    sch = tvm.s_tir.Schedule(mod)
    tvm.s_tir.Trace.apply_json_to_schedule(trace, sch)
    return sch.mod

