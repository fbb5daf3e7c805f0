"""Embedded mode's measurer: build on this machine, then run on this machine.

`LocalMeasurer` implements `tunefarm.measure.Measurer` over a `Builder` and a `Runner`.
The submitted batches are built in order, each batch's programs in parallel worker
processes, and run in order, one kernel at a time; each measurement's `MeasureRecord` is
handed over as soon as it exists. On a CPU a batch is built only once the one before it
has run: nothing else uses the cores while a kernel is timed there. A GPU times kernels
on the device, so up to `builds_ahead` later batches are built while one runs
(`rounds_in_flight`: the session keeps that many rounds out; nvcc's builds, not the GPU,
are what a GPU round waits for).

`prepare` readies a task for measurement: it writes the workload's IRModule JSON (the
builder's input, by path) and the task data (inputs, and expected outputs from the
workload's numpy reference or, lacking one, from the unscheduled program (of the workload's
`reference_mod` where it has one: a Winograd alternative is checked against the direct
convolution) run once within `reference_timeout` seconds). When no reference can be had in time, `MeasureTask.verify`
is False and the search checks kernels against each other instead (`tunefarm.digest`).
"""

from __future__ import annotations

import hashlib
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tunefarm.gpu import is_gpu
from tunefarm.measure import MeasureBatch, Measurer, MeasureTask
from tunefarm.measure.builder import Builder
from tunefarm.measure.runner import Runner
from tunefarm.measure.task_data import add_expected_from, write_task_data
from tunefarm.records import BuildInput, BuildResult, MeasureRecord, MeasureResult, RunInput, TimingConfig
from tunefarm.target import host_target_dict
from tunefarm.workloads import Workload

REFERENCE_TIMEOUT_SECS = 60.0
"""Default time the unscheduled program gets to compute a task's reference outputs (build
and run each). A naive program that takes longer would hold tuning up for nothing: the
search then checks kernels against each other."""


def safe_name(text: str, limit: int = 80) -> str:
    """A file-name-safe version of a task key (its tail, which holds the hashes)."""
    return "".join(ch if ch.isalnum() else "_" for ch in text)[-limit:]


class LocalMeasurer(Measurer):
    def __init__(
        self,
        builder: Builder,
        runner: Runner,
        work_dir: str | Path,
        *,
        reference_timeout: float = REFERENCE_TIMEOUT_SECS,
        close_workers: bool = True,
        builds_ahead: int = 0,
        log: Callable[[str], None] = lambda msg: None,
    ):
        if builds_ahead < 0:
            raise ValueError(f"builds_ahead must be at least 0, got {builds_ahead}")
        self.builder = builder
        self.runner = runner
        self.work_dir = Path(work_dir)
        self.reference_timeout = reference_timeout
        self.close_workers = close_workers  # False: the builder and runner are the caller's
        self.log = log
        self._batches: queue.SimpleQueue[MeasureBatch | None] = queue.SimpleQueue()
        self._results: queue.SimpleQueue[MeasureRecord] = queue.SimpleQueue()
        self._pending = 0
        self._lock = threading.Lock()
        self._closed = threading.Event()
        # A batch holds a slot from its build until its last run: one slot (builds_ahead 0)
        # keeps builds and runs apart.
        self._slots = threading.BoundedSemaphore(1 + builds_ahead)
        self._build_pool = ThreadPoolExecutor(1 + builds_ahead, thread_name_prefix="batch-build")
        self._built: queue.SimpleQueue[tuple[MeasureBatch, Future] | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._build_batches, name="local-measurer-build", daemon=True),
            threading.Thread(target=self._run_batches, name="local-measurer-run", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # -- preparing a task -------------------------------------------------------------------

    def prepare(self, workload: Workload, task_key: str, target: dict[str, Any]) -> MeasureTask:
        """Write the task's workload file and task data; compute its reference outputs."""
        safe = safe_name(task_key)
        wl_path = self.work_dir / "workloads" / f"{safe}.json"
        write_text_once(wl_path, workload.to_json())
        data_path = self.work_dir / "data" / f"{safe}.npz"
        if workload.reference is not None:
            write_task_data(data_path, workload, seed=0, with_expected=True)
            verify = True
        else:
            write_task_data(data_path, workload, seed=0, with_expected=False)
            ref_path = wl_path
            if workload.reference_mod is not None:  # another algorithm's program is the reference
                import tvm

                ref_path = self.work_dir / "workloads" / f"reference_{safe}.json"
                write_text_once(ref_path, tvm.ir.save_json(workload.reference_mod))
            verify = self._reference_from_unscheduled(workload, str(ref_path), str(data_path), target, safe)
        return MeasureTask(
            key=task_key,
            workload=str(wl_path),
            workload_name=workload.name,
            target=target,
            task_data=str(data_path),
            n_inputs=len(workload.inputs),
            n_outputs=len(workload.outputs),
            verify=verify,
        )

    def prepare_all(self, tasks: Sequence[tuple[Workload, str, dict[str, Any]]]) -> list[MeasureTask]:
        """`prepare` for every task, as many at once as the builder builds: a model's
        tasks each build and run their unscheduled program for reference outputs (68
        tasks of a detector took 126 s one after the other on a GPU machine)."""
        if self.builder.parallelism <= 1 or len(tasks) <= 1:
            return super().prepare_all(tasks)
        with ThreadPoolExecutor(min(self.builder.parallelism, len(tasks)), thread_name_prefix="prepare") as pool:
            return list(pool.map(lambda t: self.prepare(*t), tasks))

    def _reference_from_unscheduled(self, wl: Workload, wl_path: str, data_path: str, target, safe: str) -> bool:
        t0 = time.perf_counter()
        # A GPU task's reference runs on this host's CPU (an unscheduled program has no
        # thread binding; it is a reference, not a candidate).
        ref_target = host_target_dict() if is_gpu(target) else target
        build = self.builder.build([BuildInput("reference", wl_path, None, ref_target, self.reference_timeout)])[0]
        if build.error_kind.is_error:
            self.log(f"{wl.name}: no reference: the unscheduled program does not build ({build.error_msg})")
            return False
        outputs = str(self.work_dir / "data" / f"reference_{safe}.npz")
        run = self.runner.run(
            [
                RunInput(
                    candidate_key="reference",
                    artifact=build.artifact or "",
                    task_data=data_path,
                    n_inputs=len(wl.inputs),
                    n_outputs=len(wl.outputs),
                    verify=False,
                    timing=TimingConfig(repeat=0),
                    timeout_secs=self.reference_timeout,
                    save_outputs=outputs,
                )
            ]
        )[0]
        Path(build.artifact or "").unlink(missing_ok=True)
        if run.error_kind.is_error:
            self.log(
                f"{wl.name}: no reference ({run.error_kind}: {run.error_msg}); "
                "kernels are checked against each other instead"
            )
            return False
        add_expected_from(data_path, outputs)
        Path(outputs).unlink(missing_ok=True)
        self.log(f"{wl.name}: reference outputs from the unscheduled program ({time.perf_counter() - t0:.1f} s)")
        return True

    # -- Measurer ---------------------------------------------------------------------------

    def submit(self, batch: MeasureBatch) -> None:
        if self._closed.is_set():
            raise RuntimeError("the measurer is closed")
        with self._lock:
            self._pending += len(batch.inputs)
        self._batches.put(batch)

    def collect(self, timeout: float | None = None) -> list[MeasureRecord]:
        out: list[MeasureRecord] = []
        if self.pending == 0:
            return out
        try:
            out.append(self._results.get(timeout=timeout))
        except queue.Empty:
            return out
        while True:
            try:
                out.append(self._results.get_nowait())
            except queue.Empty:
                break
        with self._lock:
            self._pending -= len(out)
        return out

    @property
    def pending(self) -> int:
        with self._lock:
            return self._pending

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._batches.put(None)
        if self.close_workers:
            self.builder.close()  # ends a build or run in progress at once
            self.runner.close()
        for t in self._threads:
            t.join(timeout=30)
        self._build_pool.shutdown(wait=False, cancel_futures=True)

    # -- the background threads -------------------------------------------------------------

    def _build_batches(self) -> None:
        """Start each batch's build once it has a slot; hand it to the run thread in order."""
        while True:
            batch = self._batches.get()
            while batch is not None and not self._slots.acquire(timeout=0.2):
                if self._closed.is_set():
                    batch = None
            if batch is None or self._closed.is_set():
                self._built.put(None)
                return
            self._built.put((batch, self._build_pool.submit(self._build, batch)))

    def _run_batches(self) -> None:
        while True:
            item = self._built.get()
            if item is None or self._closed.is_set():
                return
            batch, building = item
            try:
                builds = building.result()
                if self._closed.is_set():
                    return
                self._run(batch, builds)
            finally:
                self._slots.release()

    def _build(self, batch: MeasureBatch) -> list[BuildResult]:
        task = batch.task
        return self.builder.build(
            [BuildInput(m.key, task.workload, m.trace, task.target, batch.build_timeout) for m in batch.inputs]
        )

    def _run(self, batch: MeasureBatch, builds: list[BuildResult]) -> None:
        task = batch.task
        for m, build in zip(batch.inputs, builds, strict=True):
            if self._closed.is_set():
                return
            run = None
            if not build.error_kind.is_error and build.artifact is not None:
                run = self.runner.run(
                    [
                        RunInput(
                            candidate_key=m.key,
                            artifact=build.artifact,
                            task_data=task.task_data,
                            n_inputs=task.n_inputs,
                            n_outputs=task.n_outputs,
                            verify=task.verify,
                            timing=batch.timing,
                            timeout_secs=batch.run_timeout,
                        )
                    ]
                )[0]
                Path(build.artifact).unlink(missing_ok=True)
            self._results.put(
                MeasureRecord.of(
                    MeasureResult(m, build, run), workload=task.workload_name, target=task.target, timestamp=time.time()
                )
            )


def rounds_in_flight(target: dict[str, Any], build_workers: int, batch_size: int) -> int:
    """Rounds an embedded session keeps out on `target` (the measurer builds all but one
    of them ahead): 1 on a CPU; on a GPU enough for the builder's workers to build a
    batch each (at least 2: one builds while one runs), at most `MAX_ROUNDS_IN_FLIGHT`."""
    if not is_gpu(target):
        return 1
    return max(2, min(MAX_ROUNDS_IN_FLIGHT, -(-build_workers // max(1, batch_size))))


MAX_ROUNDS_IN_FLIGHT = 8
"""A GPU session's rounds out at once, at most: each is proposed before the results of the
others are in, so more would search with a staler cost model."""


def write_text_once(path: Path, text: str) -> None:
    """Write `text` to `path` unless the file already holds exactly it (atomic replace)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and _sha(path.read_bytes()) == _sha(text.encode()):
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _sha(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()
