"""Build a (tuned) model into a library, run it, and check it against onnxruntime.

- `apply_schedules(fused_mod, schedules)`: replays each task's schedule trace on its
  workload and puts the scheduled PrimFunc back for every GlobalVar of that task, in a
  new IRModule (the input is not modified).
- `build_model_library(fused_mod, out_dir, ...)`: applies the schedules, compiles with
  `tvm.compile` and writes `model.so` and `manifest.json`, in an isolated child process
  (a codegen crash or hang becomes a `ModelError`, not the caller's death).
  `build_default_library` is the same with no schedule: TVM's default build of the
  fused module, every PrimFunc unscheduled (the "TVM default" baseline).
- `run_model(model_dir, inputs)`: outputs and latency (`tunefarm.models.timing`), in a
  child process whose TVM thread pool has one thread per core (or `threads`).
- `time_side_by_side(builds, inputs, onnx_model=...)`: several built models and
  onnxruntime timed in alternating blocks (`timing.time_interleaved`), each in its own
  child process, on the same thread count and input.
- `check_library(model_dir, onnx_model)`: the built model against onnxruntime on every
  input kind of `tunefarm.models.check`.

How the fused module reaches the build child: `tvm.ir.save_json` written to a temporary
file, weights embedded as constants (base64). For resnet18 that is 63.5 MB, about 1.0 s
to save and 0.8 s to load here; pickling the IRModule is the same size and speed, and
re-importing and re-fusing the ONNX model in the child would cost 1-7 s (mobilenet_v2's
fusion alone takes 6 s). The schedules travel as a JSON string.

Weights in a rewritten layout: a schedule may store a task's constant input (a weight)
in the order its loops read it (`tunefarm.layout`); `build_job` splits each such
transform into its own call and folds it into the weight (`fold_layout_rewrites`), so
the built model holds the transformed weights and never runs a transform per inference.

Attributes of a scheduled function: the function gets back exactly the attributes the
fused one had (FuseTIR's functions carry no global_symbol; the build's
AttachGlobalSymbol names them after their GlobalVar) plus ``tirx.is_scheduled``. On CPU
targets TVM's default Relax pipeline never reschedules a PrimFunc, so the attribute
changes nothing there; GPU pipelines run DLight, which skips functions marked with it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tunefarm.cuda import CUDA_KERNEL_SUFFIX
from tunefarm.errors import ModelError
from tunefarm.export import export_library
from tunefarm.gpu import is_gpu
from tunefarm.isolation import IsolatedWorker, summarize_error
from tunefarm.models import check
from tunefarm.models.check import ModelCheck
from tunefarm.models.peers import available_peers, peer_call
from tunefarm.models.timing import ROUNDS, WARMUP_CALLS, Latency, time_calls, time_interleaved
from tunefarm.records import TensorSpec, TraceJSON

LIBRARY_NAME = "model.so"
CUDA_LIBRARY_NAME = f"model{CUDA_KERNEL_SUFFIX}"
"""The library of a model built for a CUDA target: a `tunefarm.cuda` artifact (TVM's
library with the kernels' source, nvcc's fatbin of it for the target's arch, the source
and their digests), the same one file as a CUDA kernel."""
MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1

BUILD_TIMEOUT = 900.0
"""Seconds a whole-model build may take in its child (resnet18 builds in ~5 s here;
heavily unrolled schedules can make LLVM much slower)."""

RUN_TIMEOUT = 300.0
"""Seconds `run_model` may take in its child, warm-up and timed runs included."""

_JOBS = "tunefarm.models.build"


def library_name(target: dict[str, Any]) -> str:
    """The file name of a model's library built for `target`."""
    return CUDA_LIBRARY_NAME if is_gpu(target) else LIBRARY_NAME


def usage_lines(inputs: Sequence[TensorSpec], target: dict[str, Any] | None = None) -> list[str]:
    """The three lines of Python that load and call a built model (in manifest.json).
    A CUDA model's artifact is unpacked first; TVM then compiles the kernels' source
    for the GPU at load time (NVRTC), where tunefarm's own loader uses the fatbin built
    with the model (`tunefarm.cuda.load_kernel`)."""
    names = [_identifier(t.name, i) for i, t in enumerate(inputs)]
    outs = f'# {", ".join(names)}: numpy arrays; out: a Tensor (.numpy()) or an Array of them'
    if target is not None and is_gpu(target):
        args = ", ".join(f"tvm.runtime.tensor({n}, tvm.cuda())" for n in names)
        return [
            f'import tarfile, tvm; from tvm import relax; tarfile.open("{CUDA_LIBRARY_NAME}").extractall("model.cuda", filter="data")',
            'vm = relax.VirtualMachine(tvm.runtime.load_module("model.cuda/kernel.so"), tvm.cuda())',
            f'out = vm["main"]({args})  {outs}',
        ]
    args = ", ".join(f"tvm.runtime.tensor({n})" for n in names)
    return [
        "import tvm; from tvm import relax",
        f'vm = relax.VirtualMachine(tvm.runtime.load_module("{LIBRARY_NAME}"), tvm.cpu())',
        f'out = vm["main"]({args})  {outs}',
    ]


# -- schedules ------------------------------------------------------------------------------


def apply_schedules(fused_mod, schedules: Mapping[str, TraceJSON | None], *, tasks=None) -> Any:
    """A copy of `fused_mod` with each task's PrimFuncs replaced by the scheduled ones.

    `schedules` maps a task's workload key to its trace (`Trace.as_json()` as plain JSON
    data), or None for the default, unscheduled function. Keys of tasks this module does
    not have are ignored (a run over several models shares one map). `tasks` is the
    `ModelTasks` of `fused_mod` when the caller has it (otherwise it is recomputed).
    Raises `ModelError` naming the task whose trace does not replay.
    """
    import tvm
    from tvm.s_tir import Schedule, Trace

    from tunefarm.models.tasks import extract_tasks

    if tasks is None:
        tasks = extract_tasks(fused_mod, fused=True)
    replaced: dict[str, Any] = {}
    for task in tasks.tasks:
        trace = schedules.get(task.key)
        if trace is None:
            continue
        try:
            sch = Schedule(task.workload.mod)
            Trace.apply_json_to_schedule(trace, sch)
        except Exception as exc:
            text = summarize_error(f"{type(exc).__name__}: {exc}")
            raise ModelError(f"the schedule of task {task.name} does not replay: {text}") from None
        scheduled = sch.mod["main"]
        for gv_name in task.global_vars:
            original = fused_mod[gv_name]
            func = scheduled.without_attr("global_symbol")
            for k, v in (original.attrs or {}).items():
                func = func.with_attr(k, v)
            replaced[gv_name] = func.with_attr("tirx.is_scheduled", True)
    # A new module with the same GlobalVar objects: update_func would change fused_mod
    # (and every alias of it) in place.
    functions = {gv: replaced.get(gv.name_hint, f) for gv, f in fused_mod.functions.items()}
    return tvm.IRModule(functions, attrs=fused_mod.attrs, global_infos=fused_mod.global_infos)


# -- building -------------------------------------------------------------------------------


@dataclass(frozen=True)
class BuiltModel:
    """A model library on disk and how it was built."""

    directory: Path
    library: Path
    manifest: Path
    build_secs: float  # the child's load + schedule + compile + export time
    scheduled_tasks: tuple[str, ...]  # workload keys whose schedule was applied
    total_secs: float = 0.0  # including serialising the module and starting the child


def build_model_library(
    fused_mod,
    out_dir: str | Path,
    *,
    target: dict[str, Any],
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
    schedules: Mapping[str, TraceJSON | None] | None = None,
    name: str = "model",
    timeout: float = BUILD_TIMEOUT,
    worker: IsolatedWorker | None = None,
) -> BuiltModel:
    """Apply `schedules` to `fused_mod`, compile it for `target` and write
    `out_dir/model.so` (`model.cuda.tar` for a CUDA target: `library_name`) and
    `out_dir/manifest.json`. Runs in an isolated child process
    (`worker`, or a fresh one closed afterwards); every failure is a `ModelError`."""
    import tvm

    t0 = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    schedules = {k: v for k, v in (schedules or {}).items() if v is not None}
    tmp = tempfile.mkdtemp(prefix="tunefarm-model-")
    try:
        mod_path = os.path.join(tmp, "fused.json")
        with open(mod_path, "w") as f:
            f.write(tvm.ir.save_json(fused_mod))
        outcome = _call(
            worker,
            "build",
            f"{_JOBS}:build_job",
            mod_path,
            json.dumps(schedules),
            json.dumps(target),
            str(out / library_name(target)),
            timeout=timeout,
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not outcome.ok:
        raise ModelError(f"building {name} failed ({outcome.status}): {_strip_kind(outcome.message)}")
    result = outcome.value
    manifest_path = write_manifest(
        out, name=name, target=target, inputs=inputs, outputs=outputs, scheduled=result["scheduled"]
    )
    return BuiltModel(
        out,
        out / library_name(target),
        manifest_path,
        result["secs"],
        tuple(result["scheduled"]),
        time.perf_counter() - t0,
    )


def write_manifest(
    out: Path,
    *,
    name: str,
    target: dict[str, Any],
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
    scheduled: Sequence[str],
) -> Path:
    """Write `out/manifest.json` for the library `out/model.so` (`library_name`)."""
    manifest = {
        "version": MANIFEST_VERSION,
        "name": name,
        "library": library_name(target),
        "target": target,
        "inputs": [_spec_json(t) for t in inputs],
        "outputs": [_spec_json(t) for t in outputs],
        "scheduled_tasks": list(scheduled),
        "usage": usage_lines(inputs, target),
    }
    path = Path(out) / MANIFEST_NAME
    path.write_text(json.dumps(manifest, indent=2) + "\n")
    return path


def build_default_library(fused_mod, out_dir: str | Path, **kwargs: Any) -> BuiltModel:
    """TVM's default build of the fused module, every PrimFunc unscheduled (the baseline)."""
    kwargs.pop("schedules", None)
    return build_model_library(fused_mod, out_dir, schedules=None, **kwargs)


def build_job(mod_path: str, schedules_json: str, target_json: str, lib_path: str) -> dict[str, Any]:
    """Child side of `build_model_library`: plain arguments, plain result."""
    import tvm

    from tunefarm import fastmath

    fastmath.install()  # the same vectorizable exp/tanh/erf the tuned kernels were measured with
    t0 = time.perf_counter()
    with open(mod_path) as f:
        fused = tvm.ir.load_json(f.read())
    schedules = json.loads(schedules_json)
    target_dict = json.loads(target_json)
    if is_gpu(target_dict):
        from tunefarm import cuda

        cuda.use_nvcc(target_dict)  # the binary tvm.compile embeds where TVM's CUDA runtime is present
    mod, keys = fused, []
    if schedules:
        from tunefarm.models.tasks import extract_tasks

        tasks = extract_tasks(fused, fused=True)
        mod = apply_schedules(fused, schedules, tasks=tasks)
        keys = [t.key for t in tasks.tasks if t.key in schedules]
        # Weights the schedules store in a rewritten layout: the transforms are split off
        # and folded into the constants now, never run per inference.
        mod = _fold_layouts(mod)
    target = _tvm_target(target_dict)
    try:
        ex = tvm.compile(mod, target=target, relax_pipeline=relax_pipeline(target))
    except Exception as exc:
        raise ModelError(f"compiling failed: {summarize_error(f'{type(exc).__name__}: {exc}')}") from None
    try:
        # A board's target is linked by its cross compiler (tunefarm.export).
        export_library(ex, lib_path, target_dict)
    except Exception as exc:
        raise ModelError(
            f"exporting the library failed: {summarize_error(f'{type(exc).__name__}: {exc}')}"
        ) from None
    return {"secs": time.perf_counter() - t0, "scheduled": keys}


def _tvm_target(target: dict[str, Any]):
    if is_gpu(target):
        from tunefarm.cuda import tvm_target

        return tvm_target(target)  # this machine's LLVM as the host
    import tvm

    return tvm.target.Target(target)


def relax_pipeline(target) -> Any:
    """The Relax passes of the build: TVM's default CPU pipeline (`tvm.compile`'s
    "default", as of TVM 0.27) with `place_slices` after CallTIRRewrite, so that the
    concats and splits marked at fusion become views of one buffer. GPU targets keep
    TVM's own (DLight) pipeline."""
    import tvm
    from tvm import relax

    from tunefarm.models.slices import place_slices

    if "gpu" in target.keys:
        return "default"
    t, backend = relax.transform, relax.backend
    passes = [
        backend.DispatchSampling(),
        backend.DispatchSortScan(),
        t.LegalizeOps(),
        t.RewriteDataflowReshape(),
        t.ToNonDataflow(),
        t.RemovePurityChecking(),
        t.CallTIRRewrite(),
        place_slices(),
        t.StaticPlanBlockMemory(),
        t.RewriteCUDAGraph(),
        t.LowerAllocTensor(),
        t.KillAfterLastUse(),
        t.LowerRuntimeBuiltin(),
        t.ComputePrimValue(),
        t.VMShapeLower(),
        t.AttachGlobalSymbol(),
    ]
    return tvm.transform.Sequential(passes, name="tunefarm_relax_build")


def _fold_layouts(mod):
    from tunefarm import layout

    try:
        return layout.fold_layout_rewrites(mod)
    except Exception as exc:
        raise ModelError(
            f"folding the weight layout transforms failed: {summarize_error(f'{type(exc).__name__}: {exc}')}"
        ) from None


# -- running --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelRun:
    outputs: tuple[np.ndarray, ...]
    latency: Latency | None  # None when `repeat` was 0


def load_manifest(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_text())
    except OSError:
        raise ModelError(f"{model_dir}: no {MANIFEST_NAME} (not a built model directory)") from None
    except json.JSONDecodeError as exc:
        raise ModelError(f"{path}: malformed JSON ({exc.msg})") from None
    missing = [k for k in ("library", "inputs", "outputs") if not isinstance(manifest, dict) or k not in manifest]
    if missing:
        raise ModelError(f"{path} is not a built model's manifest (no {', '.join(missing)})")
    return manifest


def model_threads(model_dir: str | Path) -> int:
    """The thread count a built model runs with by default: its target's cores, else this
    machine's physical cores."""
    return int(load_manifest(model_dir).get("target", {}).get("num-cores") or _cores())


def model_worker(threads: int) -> IsolatedWorker:
    """A child process for `run_model` calls with a TVM thread pool of `threads` threads
    (several calls share it: one `import tvm`)."""
    return IsolatedWorker(env={"TVM_NUM_THREADS": str(threads)}, preload=["tvm"], name="model-run")


def run_model(
    model_dir: str | Path,
    inputs: Mapping[str, np.ndarray] | Sequence[np.ndarray],
    *,
    repeat: int | None = None,
    threads: int | None = None,
    timeout: float = RUN_TIMEOUT,
    worker: IsolatedWorker | None = None,
) -> ModelRun:
    """Run a built model: its outputs, and its latency (`timing.time_calls`: `repeat`
    single inferences, or as many as the timing budget holds when None; 0 times
    nothing). Runs in a child process with TVM_NUM_THREADS=`threads` (default
    `model_threads`); a passed `worker` (`model_worker`) keeps its own."""
    manifest = load_manifest(model_dir)
    specs = manifest["inputs"]
    arrays = _ordered_inputs(specs, inputs)
    if threads is None:
        threads = model_threads(model_dir)
    tmp = tempfile.mkdtemp(prefix="tunefarm-run-")
    try:
        npz = os.path.join(tmp, "inputs.npz")
        np.savez(npz, *arrays)
        outcome = _call(
            worker,
            "run",
            f"{_JOBS}:run_job",
            str(Path(model_dir) / manifest["library"]),
            npz,
            repeat,
            timeout=timeout,
            env={"TVM_NUM_THREADS": str(threads)},
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not outcome.ok:
        raise ModelError(f"running {model_dir} failed ({outcome.status}): {_strip_kind(outcome.message)}")
    outs, samples, used = outcome.value
    return ModelRun(tuple(outs), Latency.of(samples, used) if samples else None)


def run_job(
    lib_path: str, inputs_npz: str, repeat: int | None, warmup: int = WARMUP_CALLS
) -> tuple[list[np.ndarray], list[float], int]:
    """Child side of `run_model` (and of the farm's model runs): the outputs of one call,
    the latency samples of `timing.time_calls` (none when `repeat` is 0), and the
    threads of TVM's pool."""
    import tvm

    call = _loaded_model(lib_path, inputs_npz)
    outputs = [t.numpy() for t in _flatten(call())]
    samples: list[float] = []
    if repeat != 0:
        samples = time_calls(call, runs=repeat, warmup_calls=warmup)
    return outputs, samples, int(tvm.runtime.num_threads())


def _loaded_model(lib_path: str, inputs_npz: str) -> Callable[[], Any]:
    """In a child: one inference of the built model on its inputs (the .npz's arrays in
    order), as a call that returns the Relax VM's result. A CUDA model
    (`CUDA_LIBRARY_NAME`) runs on the GPU with the fatbin built with it, its inputs
    copied there once; the call waits for the GPU (a launch returns before the kernels
    end), so that a timed call is the inference's whole time."""
    import tvm
    from tvm import relax

    on_gpu = lib_path.endswith(CUDA_KERNEL_SUFFIX)
    if on_gpu:
        from tunefarm import cuda

        dev = cuda.cuda_device()
        module = cuda.load_kernel(lib_path, Path(lib_path).with_suffix(".unpacked"))
    else:
        dev = tvm.cpu(0)
        module = tvm.runtime.load_module(lib_path)
    main = relax.VirtualMachine(module, dev)["main"]
    with np.load(inputs_npz) as data:
        args = [tvm.runtime.tensor(data[f"arr_{i}"], dev) for i in range(len(data.files))]
    if not on_gpu:
        return lambda: main(*args)

    def synced() -> Any:
        out = main(*args)
        dev.sync()
        return out

    return synced


def _flatten(value) -> list:
    import tvm

    if isinstance(value, tvm.runtime.Tensor):
        return [value]
    return [t for item in value for t in _flatten(item)]


# -- checking and timing against onnxruntime --------------------------------------------------


def check_library(model_dir: str | Path, onnx_model: Any, *, worker: IsolatedWorker | None = None) -> ModelCheck:
    """Run the built model and onnxruntime on every input kind of `tunefarm.models.check`
    and compare them (`check.check_model`). `onnx_model` is the ONNX graph (bytes, path
    or ModelProto) the model was imported from."""
    from tunefarm.models.importer import run_onnxruntime

    manifest = load_manifest(model_dir)
    specs = manifest["inputs"]
    onnx_model = _onnx_bytes(onnx_model)

    def reference(feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        try:
            return run_onnxruntime(onnx_model, feeds)
        except Exception as exc:
            raise ModelError(f"onnxruntime cannot run the reference model: {summarize_error(str(exc))}") from None

    inputs = check.check_inputs({s["name"]: s["shape"] for s in specs}, {s["name"]: s["dtype"] for s in specs})
    own = worker or model_worker(model_threads(model_dir))
    try:
        return check.check_model(
            lambda feeds: run_model(model_dir, feeds, repeat=0, worker=own).outputs,
            reference,
            inputs,
            reference_name="onnxruntime",
            output_names=[s["name"] for s in manifest["outputs"]],
            exact=check.exact_onnx_reference(onnx_model),
        )
    finally:
        if worker is None:
            own.close()


def time_side_by_side(
    builds: Mapping[str, str | Path],
    inputs: Mapping[str, np.ndarray],
    *,
    threads: int,
    onnx_model: Any = None,
    peers: Sequence[str] | None = None,
    runs: int | None = None,
    rounds: int = ROUNDS,
    budget_secs: float | None = None,
    timeout: float = RUN_TIMEOUT,
) -> dict[str, Latency]:
    """The latency of each built model (name -> model directory) and, when `onnx_model`
    (bytes, path or ModelProto) is given, of each engine of `peers` (default: those
    installed, `peers.available_peers()`) under its own name (`peers.ONNXRUNTIME`,
    `peers.OPENVINO`). Each runs in its own child process with `threads` threads, on the
    same `inputs` (name -> array), in `rounds` alternating blocks
    (`timing.time_interleaved`): `runs` samples each, or `budget_secs` of them (default
    `timing.BUDGET_SECS` per contender). Raises `ModelError` when one cannot be run."""
    peer_names = tuple(available_peers() if peers is None else peers) if onnx_model is not None else ()
    if set(builds) & set(peer_names):
        raise ValueError(f"a build may not be named like a peer ({', '.join(peer_names)})")
    tmp = tempfile.mkdtemp(prefix="tunefarm-timing-")
    workers: list[IsolatedWorker] = []
    blocks = {}
    try:
        for i, (name, model_dir) in enumerate(builds.items()):
            manifest = load_manifest(model_dir)
            npz = os.path.join(tmp, f"inputs-{i}.npz")
            np.savez(npz, *_ordered_inputs(manifest["inputs"], inputs))
            worker = model_worker(threads)
            workers.append(worker)
            lib = str(Path(model_dir) / manifest["library"])
            blocks[name] = _block(worker, name, f"{_JOBS}:tvm_block_job", (lib, npz), timeout)
        if peer_names:
            model_path = os.path.join(tmp, "model.onnx")
            Path(model_path).write_bytes(_onnx_bytes(onnx_model))
            npz = os.path.join(tmp, "inputs-peers.npz")
            np.savez(npz, **dict(inputs))
            for peer in peer_names:
                worker = IsolatedWorker(name=f"{peer}-timing")
                workers.append(worker)
                blocks[peer] = _block(worker, peer, f"{_JOBS}:peer_block_job", (peer, model_path, npz, threads), timeout)
        kwargs = {} if budget_secs is None else {"budget_secs": budget_secs}
        return time_interleaved(blocks, runs=runs, rounds=rounds, **kwargs)
    finally:
        for worker in workers:
            worker.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _onnx_bytes(onnx_model: Any) -> bytes:
    if isinstance(onnx_model, (str, os.PathLike)):
        return Path(onnx_model).read_bytes()
    return onnx_model if isinstance(onnx_model, bytes) else onnx_model.SerializeToString()


def _block(worker: IsolatedWorker, name: str, job: str, args: tuple, timeout: float):
    """A `timing.Block` that runs `job(*args, runs, budget, warm-up, min runs)` in `worker`."""

    def block(runs: int | None, budget_secs: float, warmup_secs: float, min_runs: int) -> tuple[list[float], int]:
        outcome = worker.call(job, *args, runs, budget_secs, warmup_secs, min_runs, timeout=timeout)
        if not outcome.ok:
            raise ModelError(f"timing {name} failed ({outcome.status}): {_strip_kind(outcome.message)}")
        # its thread pool spins on after the last call: the next contender must not pay for it
        worker.wait_idle()
        return outcome.value

    return block


_TIMED_CALLS: dict[tuple, Any] = {}
"""In a timing child: the loaded model's call per (library or ONNX file, inputs), so that
each block after the first only times."""


def tvm_block_job(
    lib_path: str, inputs_npz: str, runs: int | None, budget_secs: float, warmup_secs: float, min_runs: int
) -> tuple[list[float], int]:
    """Child side of `time_side_by_side` for a built model: one block of samples."""
    import tvm

    key = (lib_path, inputs_npz)
    if key not in _TIMED_CALLS:
        _TIMED_CALLS[key] = _loaded_model(lib_path, inputs_npz)
    samples = _timed_block(_TIMED_CALLS[key], runs, budget_secs, warmup_secs, min_runs)
    return samples, int(tvm.runtime.num_threads())


def peer_block_job(
    peer: str, model_path: str, inputs_npz: str, threads: int, runs: int | None, budget_secs: float,
    warmup_secs: float, min_runs: int,
) -> tuple[list[float], int]:
    """Child side of `time_side_by_side` for a peer engine: one block of samples."""
    key = (peer, model_path, inputs_npz)
    if key not in _TIMED_CALLS:
        with np.load(inputs_npz) as data:
            feeds = {name: data[name] for name in data.files}
        _TIMED_CALLS[key] = peer_call(peer, model_path, feeds, threads)
    return _timed_block(_TIMED_CALLS[key], runs, budget_secs, warmup_secs, min_runs), threads


def _timed_block(call, runs: int | None, budget_secs: float, warmup_secs: float, min_runs: int) -> list[float]:
    # the first block warms up fully; later ones with one call (caches after the other contenders)
    return time_calls(call, runs=runs, budget_secs=budget_secs, warmup_secs=warmup_secs,
                      warmup_calls=WARMUP_CALLS if warmup_secs > 0 else 1, min_runs=min_runs)  # fmt: skip


# -- helpers --------------------------------------------------------------------------------


def _call(
    worker: IsolatedWorker | None,
    what: str,
    func: str,
    *args: Any,
    timeout: float,
    env: dict[str, str] | None = None,
):
    if worker is not None:
        return worker.call(func, *args, timeout=timeout)
    with IsolatedWorker(env=env, name=f"model-{what}") as own:
        return own.call(func, *args, timeout=timeout)


def _strip_kind(message: str) -> str:
    """ "ModelError: compiling failed: ..." -> "compiling failed: ..." (the child's own errors)."""
    prefix = f"{ModelError.__name__}: "
    return message[len(prefix) :] if message.startswith(prefix) else message


def _ordered_inputs(specs: list[dict[str, Any]], inputs) -> list[np.ndarray]:
    if isinstance(inputs, Mapping):
        missing = [s["name"] for s in specs if s["name"] not in inputs]
        extra = [n for n in inputs if n not in {s["name"] for s in specs}]
        if missing or extra:
            raise ModelError(
                f"the model takes inputs {[s['name'] for s in specs]}; missing {missing}, unknown {extra}"
            )
        arrays = [np.asarray(inputs[s["name"]]) for s in specs]
    else:
        arrays = [np.asarray(a) for a in inputs]
        if len(arrays) != len(specs):
            raise ModelError(f"the model takes {len(specs)} inputs, got {len(arrays)}")
    for s, a in zip(specs, arrays):
        if tuple(a.shape) != tuple(s["shape"]) or str(a.dtype) != s["dtype"]:
            raise ModelError(
                f"input {s['name']!r} must be {s['dtype']} {tuple(s['shape'])}, got {a.dtype} {tuple(a.shape)}"
            )
    return [np.ascontiguousarray(a) for a in arrays]


def _identifier(name: str, index: int) -> str:
    text = "".join(c if c.isalnum() or c == "_" else "_" for c in name)
    return text if text and not text[0].isdigit() and text.isidentifier() else f"input_{index}"


def _spec_json(t: TensorSpec) -> dict[str, Any]:
    return {"name": t.name, "shape": list(t.shape), "dtype": t.dtype}


def _cores() -> int:
    from tunefarm.target import physical_cores

    return physical_cores()
