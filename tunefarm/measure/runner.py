"""Runners: load built kernels, check their output, and time them.

A runner runs kernels strictly one at a time, so that no timed kernel shares the cores
with another one, and never raises for a bad kernel: a crash, a hang, an exception or a
wrong output is a `RunResult` with an `ErrorKind` and a message.

`LocalRunner` runs in one long-lived isolated process on this machine; a device agent can
call the same job function, `run_kernel`. A device agent's runner is sandboxed
(`tunefarm.isolation.Sandbox`: started by root, the process runs as `nobody` in a network
namespace of its own); it then imports, while still privileged, every module its jobs
use (`SANDBOX_PRELOAD`: the Python installation may sit where `nobody` cannot read).

What one run does (`run_kernel`), following `TimingConfig`:

1. load the library and the task data (inputs, output shapes, expected outputs); a
   library whose kernel takes a constant input in a rewritten layout transforms it once
   with its own `main_weight_prepack` (`tunefarm.layout.pretransform`), untimed;
2. one untimed warm-up call, whose output is saved (`save_outputs`) and checked
   against the expected one (`verify`); a wrong output ends the run: WRONG_RESULT;
3. time with TVM's time_evaluator: `repeat` repeats of at least `min_repeat_ms` each,
   caches flushed before each (all arguments but the first; CPU kernels only); a kernel whose warm-up
   took longer than `slow_cutoff_secs` is timed once; `repeat` 0 times nothing (the
   warm-up call's time is the only cost: runs that only produce outputs). With
   `flush_every_call` the caches are flushed before every call instead, each call timed
   alone, and a repeat is the mean of up to `max_flushed_calls` of them
   (`calls_per_flushed_repeat`); the result then says `flushed_calls`.

A CUDA kernel (`tunefarm.cuda` artifact) runs on the machine's GPU (`tvm.cuda(0)`): the
inputs are copied to it, the library is loaded with the binary the build worker compiled
for the class's arch, the warm-up is synchronised, time_evaluator times it on the GPU
(device-synchronised, no CPU cache flush), and the outputs are copied back and checked
like a CPU kernel's. Without a GPU the run is a RUN_ERROR saying so (`NoGpuError`).

A runner also runs whole tuned models for the farm (`run_model`, `ModelRunInput`): every
tuned model is sent to an agent of its class, which runs it once for its outputs
(`tunefarm.models.runtime.run_job`, in the same process as the kernels, one at a time
with them) and times it as `tunefarm tune` does: `repeat` inferences of it and as many
of each peer engine (onnxruntime, and OpenVINO where it is installed) on the model's
ONNX graph, in alternating rounds on the same input and thread count
(`tunefarm.models.runtime.time_beside_peers`). The tuned model is timed in the kernels'
process, each peer in a process of its own, sandboxed like it (`PEER_PRELOAD`). A peer
that cannot be timed (not installed, a model it cannot load) is left out and says why;
only the tuned model's own failure fails the run.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from tunefarm import cuda, layout
from tunefarm.digest import digest
from tunefarm.isolation import WITHOUT_TORCH, CallStatus, IsolatedWorker, summarize_error
from tunefarm.measure.task_data import TaskData, read_task_data, save_outputs
from tunefarm.records import ErrorKind, RunInput, RunResult, Stage, TimingConfig, failure_kind
from tunefarm.sandbox import Sandbox, SandboxStatus

VERIFY_RTOL = 1e-3
"""Relative tolerance of the output check."""

VERIFY_ATOL = 1e-3
"""Absolute tolerance of the output check, relative to max(1, max |expected|)."""

SANDBOX_PRELOAD = (
    "tvm",
    "tvm.relax",  # a model run's VM
    "tvm.support.cc",  # a .tar kernel is linked at load
    "tvm.support.tar",
    "tvm.support.utils",
    "tvm_ffi",
    "zipfile",  # task data and inputs are .npz files ...
    "encodings.cp437",  # ... whose member names zipfile decodes with it
    "numpy.ma",  # comparing outputs
    "tunefarm.models.build",
    "tunefarm.models.runtime",
    "tunefarm.models.timing",
)
"""What a sandboxed runner imports before it gives up its rights: every module its jobs
import later (the sandbox's user may not read the Python installation: a module first
imported after the drop would fail to load)."""

PEER_PRELOAD = ("zipfile", "encodings.cp437", "numpy", "tunefarm.models.runtime", "tunefarm.models.peers")
"""What a sandboxed peer's process imports before it gives up its rights, besides the
peer's own package (`onnxruntime`, `openvino`)."""


@dataclass(frozen=True)
class ModelRunInput:
    """A built model to run: `library` (model.so) on the arrays of `inputs` (.npz,
    arr_0, arr_1, ... in the model's input order); the outputs of one inference go to
    `outputs` (.npz, arr_0, ...). Then, unless `repeat` is 0, `repeat` timed inferences
    and as many of each peer on `onnx_model` (the ONNX graph; "" times no peer), fed the
    same arrays under `input_names`, in alternating rounds (their warm-up is
    `tunefarm.models.timing`'s, as `tunefarm tune`'s: `warmup` is not used).
    `timeout_secs` bounds each call: the output run, and each block of the timing."""

    library: str
    inputs: str
    outputs: str
    repeat: int
    warmup: int
    timeout_secs: float
    onnx_model: str = ""
    input_names: tuple[str, ...] = ()


@dataclass(frozen=True)
class PeerRun:
    """A peer timed beside the model (its samples), or why it was not (`error`)."""

    peer: str  # `tunefarm.models.peers.ONNXRUNTIME`, `OPENVINO`
    latency_samples: tuple[float, ...] = ()
    round_medians: tuple[float, ...] = ()
    threads: int = 0
    error: str = ""


@dataclass(frozen=True)
class ModelRunResult:
    latency_samples: tuple[float, ...]  # seconds per timed inference
    run_secs: float  # wall time of the whole run
    error: str = ""  # why the model did not run ("" when it did)
    threads: int = 0  # the threads of the timed inferences (0: none timed)
    round_medians: tuple[float, ...] = ()  # p50 of each round of the timing
    peers: tuple[PeerRun, ...] = ()  # those asked for (`ModelRunInput.onnx_model`), timed or not


class Runner(ABC):
    """Runs and times the built kernels of one measured batch, one kernel at a time."""

    def start(self) -> None:  # noqa: B027 (optional hook, nothing to do by default)
        """Called once before the first batch; may prepare the device so that the first
        kernel does not pay its start-up."""

    @abstractmethod
    def run(self, inputs: Sequence[RunInput]) -> list[RunResult]:
        """Called once per measured batch, after the build. Runs the kernels strictly one
        at a time and returns one result per input, in input order. Never raises for a
        bad kernel: errors are `RunResult.error_kind`."""

    @abstractmethod
    def close(self) -> None:
        """Called once when tuning is over. The runner is unusable after."""

    def run_model(self, inp: ModelRunInput) -> ModelRunResult:
        """Run a whole built model (between batches, never during one). Never raises for
        a model that fails: the result's `error` says why."""
        return ModelRunResult((), 0.0, f"{type(self).__name__} does not run whole models")

    @property
    def sandbox_status(self) -> SandboxStatus | None:
        """What confines the kernels, once started (None: nothing does)."""
        return None

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalRunner(Runner):
    """Runs kernels in one isolated worker process with `num_threads` TVM threads.

    Use one LocalRunner per machine, and build nothing while it runs: timings are only
    meaningful when the kernel has the cores to itself.
    """

    def __init__(
        self,
        num_threads: int,
        *,
        start_timeout: float = 120.0,
        sandbox: Sandbox | None = None,
        cwd: str | Path | None = None,
    ):
        if num_threads < 1:
            raise ValueError(f"num_threads must be at least 1, got {num_threads}")
        self.num_threads = num_threads
        self._sandbox = sandbox
        self._cwd = cwd
        self._worker = IsolatedWorker(
            env={"TVM_NUM_THREADS": str(num_threads)},
            preload=[*SANDBOX_PRELOAD, __name__] if sandbox is not None else ["tvm", __name__],
            blocked_imports=WITHOUT_TORCH,
            start_timeout=start_timeout,
            name="runner",
            sandbox=sandbox,
            cwd=cwd,
        )

    def start(self) -> None:
        self._worker.start()

    @property
    def sandbox_status(self) -> SandboxStatus | None:
        """What the kernel process's sandbox got (once started; None without a sandbox)."""
        return self._worker.sandbox_status

    def run(self, inputs: Sequence[RunInput]) -> list[RunResult]:
        return [self._run_one(inp) for inp in inputs]

    def close(self) -> None:
        self._worker.close()

    def run_model(self, inp: ModelRunInput) -> ModelRunResult:
        from tunefarm.errors import ModelRunError

        t0 = time.perf_counter()
        outcome = self._worker.call(_RUN_MODEL_JOB, inp, timeout=inp.timeout_secs)
        if not outcome.ok:
            message = outcome.message if outcome.status is not CallStatus.RAISED else summarize_error(outcome.message)
            return ModelRunResult((), outcome.secs, f"{outcome.status}: {message}")
        if inp.repeat == 0:
            return ModelRunResult((), outcome.secs)
        try:
            return self._timed(inp, t0)
        except ModelRunError as exc:
            return ModelRunResult((), time.perf_counter() - t0, str(exc))

    def _timed(self, inp: ModelRunInput, t0: float) -> ModelRunResult:
        """The model timed beside its peers (see the module docstring)."""
        from tunefarm.models.peers import ONNXRUNTIME, PEERS, available_peers
        from tunefarm.models.runtime import time_beside_peers, timing_block

        installed = available_peers() if inp.onnx_model else ()
        absent = {ONNXRUNTIME: "onnxruntime is not installed on this agent"} if inp.onnx_model else {}
        absent = {peer: why for peer, why in absent.items() if peer not in installed}
        model = timing_block(self._worker, "the tuned model", _MODEL_BLOCK_JOB, (inp.library, inp.inputs), inp.timeout_secs)
        workers = {peer: self._peer_worker(peer) for peer in PEERS if peer in installed}
        try:
            blocks = {
                peer: timing_block(worker, peer, _PEER_BLOCK_JOB,
                                   (peer, inp.onnx_model, inp.inputs, inp.input_names, self.num_threads),
                                   inp.timeout_secs)  # fmt: skip
                for peer, worker in workers.items()
            }
            timed = time_beside_peers((MODEL, model), blocks, runs=inp.repeat)
        finally:
            for worker in workers.values():
                worker.close()
            self._worker.call(_FORGET_JOB, timeout=60.0)
        mine = timed.latencies.pop(MODEL)
        peers = [PeerRun(p, lat.samples, lat.round_medians, lat.threads) for p, lat in timed.latencies.items()]
        peers += [PeerRun(p, error=why) for p, why in (absent | timed.failed).items()]
        return ModelRunResult(mine.samples, time.perf_counter() - t0, threads=mine.threads,
                              round_medians=mine.round_medians, peers=tuple(peers))  # fmt: skip

    def _peer_worker(self, peer: str) -> IsolatedWorker:
        """A process for one peer's timing blocks, sandboxed like the kernels'."""
        return IsolatedWorker(
            preload=[*PEER_PRELOAD, peer] if self._sandbox is not None else [],
            name=f"{peer}-timing",
            sandbox=self._sandbox,
            cwd=self._cwd,
        )

    def _run_one(self, inp: RunInput) -> RunResult:
        outcome = self._worker.call(_RUN_JOB, inp, timeout=inp.timeout_secs)
        if outcome.status is CallStatus.OK:
            return replace(outcome.value, run_secs=outcome.secs)
        kind = failure_kind(Stage.RUN, outcome.status)
        if outcome.status is CallStatus.TIMED_OUT:
            msg = f"run: {outcome.message}"
        elif outcome.status is CallStatus.CRASHED:
            msg = outcome.message
        else:
            msg = summarize_error(outcome.message)
        return RunResult(inp.candidate_key, (), outcome.secs, kind, msg)


def kernel_output_mismatch(
    outputs: Sequence[np.ndarray], expected: Sequence[np.ndarray], *, rtol: float = VERIFY_RTOL
) -> str:
    """What differs between the outputs and the expected ones, and where ("" if nothing).

    An element matches when |out - exp| <= atol + rtol * |exp|, with
    atol = VERIFY_ATOL * max(1, max |exp|) (a scale-aware absolute floor for values near
    zero). A NaN anywhere is a mismatch.
    """
    if len(outputs) != len(expected):
        return f"{len(outputs)} outputs, {len(expected)} expected"
    for k, (out, exp) in enumerate(zip(outputs, expected, strict=True)):
        if out.shape != exp.shape:
            return f"output_{k}: shape {out.shape}, expected {exp.shape}"
        got, want = out.astype(np.float64), exp.astype(np.float64)
        scale = float(np.max(np.abs(want), initial=0.0, where=np.isfinite(want)))
        atol = VERIFY_ATOL * max(1.0, scale)
        bad = ~np.isclose(got, want, rtol=rtol, atol=atol)
        if not bad.any():
            continue
        n_bad, n = int(bad.sum()), bad.size
        nan = np.isnan(got) & bad
        if nan.any():
            at = _index(np.argmax(nan), out.shape)
            return f"output_{k}: NaN at {at} (expected {want[at]:.6g}); {n_bad} of {n} elements differ"
        err = np.where(bad, np.abs(got - want), 0.0)
        err = np.nan_to_num(err, nan=np.inf)
        at = _index(np.argmax(err), out.shape)
        return (
            f"output_{k}: max abs error {err[at]:.3g} at {at} (got {got[at]:.6g}, expected {want[at]:.6g}, "
            f"atol {atol:.3g}); {n_bad} of {n} elements differ"
        )
    return ""


def _index(flat: Any, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(i) for i in np.unravel_index(int(flat), shape))


# -- the job, run inside the worker process -----------------------------------------------

_RUN_JOB = f"{__name__}:run_kernel"
_RUN_MODEL_JOB = f"{__name__}:run_model_job"
_MODEL_BLOCK_JOB = "tunefarm.models.runtime:tvm_block_job"
_PEER_BLOCK_JOB = "tunefarm.models.runtime:ordered_peer_block_job"
_FORGET_JOB = "tunefarm.models.runtime:forget_timed_calls"

MODEL = "tuned"
"""The tuned model's name among the contenders of a model run's timing."""

_TASK_DATA_CACHE_SIZE = 4
"""Task data files kept in memory per worker process (keyed by path, mtime and size)."""

_task_data: OrderedDict[tuple[str, int, int], TaskData] = OrderedDict()


def run_kernel(inp: RunInput) -> RunResult:
    """Run, check and time one kernel in this process (see the module docstring).

    `run_secs` is this function's wall time; `LocalRunner` replaces it with the time the
    parent saw. Exceptions (a missing file, a kernel that raises) propagate.
    """
    t0 = time.perf_counter()
    data = _load_task_data(inp.task_data)
    if len(data.inputs) != inp.n_inputs or len(data.output_specs) != inp.n_outputs:
        raise ValueError(
            f"task data {inp.task_data} has {len(data.inputs)} inputs and {len(data.output_specs)} outputs, "
            f"the kernel takes {inp.n_inputs} and {inp.n_outputs}"
        )
    on_gpu = inp.artifact.endswith(cuda.CUDA_KERNEL_SUFFIX)
    dev, lib, args = _load_kernel(inp.artifact, data, on_gpu=on_gpu)
    func = lib["main"]

    warm0 = time.perf_counter()
    func(*args)
    dev.sync()  # a GPU launch returns before the kernel ends
    warmup_secs = time.perf_counter() - warm0

    verified = False
    check = inp.verify and data.expected is not None
    outputs = [a.numpy() for a in args[inp.n_inputs :]]
    fingerprint = digest(outputs)
    if inp.save_outputs:
        save_outputs(inp.save_outputs, outputs)
    if check:
        assert data.expected is not None
        problem = kernel_output_mismatch(outputs, data.expected)
        if problem:
            return RunResult(
                inp.candidate_key, (), time.perf_counter() - t0, ErrorKind.WRONG_RESULT, problem, digest=fingerprint
            )
        verified = True

    timing = inp.timing
    if timing.repeat == 0:  # an output-only run (a reference): the warm-up is its only call
        return RunResult(inp.candidate_key, (warmup_secs,), time.perf_counter() - t0, verified=verified, digest=fingerprint)
    costs = _timed_costs(lib, dev, args, timing, on_gpu=on_gpu, warmup_secs=warmup_secs)
    return RunResult(inp.candidate_key, costs, time.perf_counter() - t0, verified=verified, digest=fingerprint,
                     flushed_calls=timing.flushes_every_call(on_gpu=on_gpu))  # fmt: skip


def _load_kernel(artifact: str, data: TaskData, *, on_gpu: bool) -> tuple[Any, Any, list[Any]]:
    """The device, the loaded library and the call's arguments: the task data's inputs on
    the device, then empty output tensors."""
    import tvm

    if on_gpu:  # NoGpuError on a machine without one: a RUN_ERROR naming why
        dev = cuda.cuda_device()
        lib = cuda.load_kernel(artifact, Path(artifact).with_suffix(".unpacked"))
        args = [tvm.runtime.tensor(a, dev) for a in data.inputs]
    else:
        dev = tvm.cpu(0)
        lib = tvm.runtime.load_module(artifact)
        # A kernel that takes a constant input in a rewritten layout gets it transformed
        # once, here, by the library's own transform (tunefarm.layout); only the kernel
        # is timed.
        args = layout.pretransform(lib, [tvm.runtime.tensor(a, dev) for a in data.inputs])
    args += [tvm.runtime.empty(shape, dtype, dev) for shape, dtype in data.output_specs]
    return dev, lib, args


def _timed_costs(
    lib, dev, args: list[Any], timing: TimingConfig, *, on_gpu: bool, warmup_secs: float
) -> tuple[float, ...]:
    """The kernel's times (seconds per call) from TVM's time_evaluator, as `timing` asks: a
    kernel whose warm-up took longer than `slow_cutoff_secs` is timed once."""
    slow = warmup_secs > timing.slow_cutoff_secs
    if timing.flushes_every_call(on_gpu=on_gpu) and not slow:
        return _flushed_call_costs(lib, dev, args, timing, warmup_secs)
    evaluator = lib.time_evaluator(
        "main",
        dev,
        number=1,
        repeat=1 if slow else timing.repeat,
        min_repeat_ms=0 if slow else int(round(timing.min_repeat_ms)),  # TVM takes whole ms
        # CPU caches only: a GPU's L2 is not flushed (time_evaluator syncs the device)
        f_preproc="cache_flush_cpu_non_first_arg" if timing.flush_cache and not on_gpu else "",
    )
    return tuple(float(c) for c in evaluator(*args).results)


def _flushed_call_costs(lib, dev, args: list[Any], timing: TimingConfig, warmup_secs: float) -> tuple[float, ...]:
    """`timing.repeat` costs, each the mean of `calls` single calls with the caches flushed
    before every one (time_evaluator times each repeat alone: `number` 1)."""
    calls = calls_per_flushed_repeat(timing, warmup_secs)
    evaluator = lib.time_evaluator(
        "main", dev, number=1, repeat=calls * timing.repeat, min_repeat_ms=0,
        f_preproc="cache_flush_cpu_non_first_arg",
    )  # fmt: skip
    times = np.asarray(evaluator(*args).results, dtype=np.float64).reshape(timing.repeat, calls)
    return tuple(float(c) for c in times.mean(axis=1))


def calls_per_flushed_repeat(timing: TimingConfig, warmup_secs: float) -> int:
    """How many flushed calls make one repeat: enough to fill `min_repeat_ms` at the
    warm-up call's speed, at least 1 and at most `max_flushed_calls`."""
    wanted = timing.min_repeat_ms / 1000.0 / max(warmup_secs, 1e-7)
    return max(1, min(timing.max_flushed_calls, math.ceil(wanted)))


def run_model_job(inp: ModelRunInput) -> None:
    """Run a whole model once in this process, its outputs to `inp.outputs` (see
    `ModelRunInput`; `LocalRunner.run_model` times it after). Exceptions (a library that
    does not load, wrong inputs) propagate."""
    from tunefarm.models.runtime import run_job

    outputs, _samples, _threads = run_job(inp.library, inp.inputs, 0)
    np.savez(inp.outputs, *outputs)


def _load_task_data(path: str) -> TaskData:
    st = Path(path).stat()
    key = (str(path), st.st_mtime_ns, st.st_size)
    data = _task_data.get(key)
    if data is None:
        data = read_task_data(path)
        _task_data[key] = data
        if len(_task_data) > _TASK_DATA_CACHE_SIZE:
            _task_data.popitem(last=False)
    else:
        _task_data.move_to_end(key)
    return data
