"""Build a (tuned) model into a library (`tunefarm.models.runtime` runs, checks and times it).

- `apply_schedules(fused_mod, schedules)`: replays each task's schedule trace on its
  workload and puts the scheduled PrimFunc back for every GlobalVar of that task, in a
  new IRModule (the input is not modified).
- `build_model_library(fused_mod, out_dir, ...)`: applies the schedules, compiles with
  `tvm.compile` and writes `model.so` and `manifest.json`, in an isolated child process
  (a codegen crash or hang becomes a `ModelError`, not the caller's death).
  `build_default_library` is the same with no schedule: TVM's default build of the
  fused module, every PrimFunc unscheduled (the "TVM default" baseline).
- `call_isolated`, `child_error_text`: a job in an isolated child and its error's words.

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

import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunefarm import wmma
from tunefarm.cuda import CUDA_GRAPH_CONFIG, CUDA_KERNEL_SUFFIX, lowering
from tunefarm.errors import ModelError
from tunefarm.export import export_library
from tunefarm.gpu import is_gpu
from tunefarm.isolation import WITHOUT_TORCH, IsolatedWorker, summarize_error
from tunefarm.models.check import Tolerance
from tunefarm.models.precision import FP32, reductions_per_run, tolerance
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


_JOBS = "tunefarm.models.build"


def library_name(target: dict[str, Any]) -> str:
    """The file name of a model's library built for `target`."""
    return CUDA_LIBRARY_NAME if is_gpu(target) else LIBRARY_NAME


def usage_lines(inputs: Sequence[TensorSpec], target: dict[str, Any] | None = None) -> list[str]:
    """The three lines of Python that load and call a built model (in manifest.json).
    A CUDA model's artifact is unpacked first; TVM then compiles the kernels' source
    for the GPU at load time (NVRTC), where tunefarm's own loader uses the fatbin built
    with the model (`tunefarm.cuda.load_kernel`)."""
    names = [input_identifier(t.name, i) for i, t in enumerate(inputs)]
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
    data), or None for the default, unscheduled function; or an alternative's key (a
    Winograd program of the task, `tunefarm.models.alternatives`) to its trace, which then
    replaces the task's function. Keys of tasks this module does
    not have are ignored (a run over several models shares one map). `tasks` is the
    `ModelTasks` of `fused_mod` when the caller has it (otherwise it is recomputed).
    Raises `ModelError` naming the task whose trace does not replay.
    """
    import tvm
    from tvm.s_tir import Schedule, Trace

    from tunefarm.models.alternatives import member_workload, schedule_key
    from tunefarm.models.tasks import extract_tasks

    if tasks is None:
        tasks = extract_tasks(fused_mod, fused=True)
    replaced: dict[str, Any] = {}
    for task in tasks.tasks:
        key = schedule_key(task, schedules)
        if key is None:
            continue
        workload = member_workload(task, key)  # the task's own program or an alternative's
        if workload is None:
            raise ModelError(f"the schedule of task {task.name} is for {key.partition('#')[0]}, which this version does not make")
        trace = schedules[key]
        if wmma.uses_wmma(trace):
            wmma.register()
        try:
            sch = Schedule(workload.mod)
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
    cuda_graph: bool = False,
    precision: str = FP32,
) -> BuiltModel:
    """Apply `schedules` to `fused_mod`, compile it for `target` and write
    `out_dir/model.so` (`model.cuda.tar` for a CUDA target: `library_name`) and
    `out_dir/manifest.json`. Runs in an isolated child process
    (`worker`, or a fresh one closed afterwards); every failure is a `ModelError`.
    `cuda_graph` (CUDA targets only): the kernels between the model's inputs and outputs
    run as one CUDA graph (`tunefarm.cuda.CUDA_GRAPH_CONFIG`); the manifest says so.
    `precision`: what `fused_mod` computes in (`tunefarm.models.precision`); the manifest
    of a reduced-precision model says so (and its check takes that tolerance)."""
    import tvm

    if cuda_graph and not is_gpu(target):
        raise ModelError(f"CUDA graphs are for CUDA targets, not {target.get('kind')!r}")
    t0 = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    schedules = {k: v for k, v in (schedules or {}).items() if v is not None}
    tmp = tempfile.mkdtemp(prefix="tunefarm-model-")
    try:
        mod_path = os.path.join(tmp, "fused.json")
        with open(mod_path, "w") as f:
            f.write(tvm.ir.save_json(fused_mod))
        outcome = call_isolated(
            worker,
            "build",
            f"{_JOBS}:build_job",
            mod_path,
            json.dumps(schedules),
            json.dumps(target),
            str(out / library_name(target)),
            cuda_graph,
            timeout=timeout,
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not outcome.ok:
        raise ModelError(f"building {name} failed ({outcome.status}): {child_error_text(outcome.message)}")
    result = outcome.value
    manifest_path = write_manifest(
        out, name=name, target=target, inputs=inputs, outputs=outputs, scheduled=result["scheduled"],
        cuda_graph=cuda_graph, precision=precision,
        reductions=reductions_per_run(fused_mod) if precision != FP32 else 0,
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
    cuda_graph: bool = False,
    precision: str = FP32,
    reductions: int = 0,
) -> Path:
    """Write `out/manifest.json` for the library `out/model.so` (`library_name`); a model
    in reduced precision has "precision" (a float32 one none: `manifest_precision`)."""
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
    if cuda_graph:
        manifest["cuda_graph"] = True
    if precision != FP32:
        manifest["precision"] = precision
        manifest["reductions_per_run"] = reductions
    path = Path(out) / MANIFEST_NAME
    path.write_text(json.dumps(manifest, indent=2) + "\n")
    return path


def manifest_tolerance(manifest: Mapping[str, Any]) -> Tolerance:
    """The check's tolerance of a built model: its precision's (a manifest without one:
    float32's), `tunefarm.models.precision.tolerance`."""
    return tolerance(str(manifest.get("precision", FP32)), int(manifest.get("reductions_per_run", 0)))


def build_default_library(fused_mod, out_dir: str | Path, **kwargs: Any) -> BuiltModel:
    """TVM's default build of the fused module, every PrimFunc unscheduled (the baseline)."""
    kwargs.pop("schedules", None)
    return build_model_library(fused_mod, out_dir, schedules=None, **kwargs)


def build_job(
    mod_path: str, schedules_json: str, target_json: str, lib_path: str, cuda_graph: bool = False
) -> dict[str, Any]:
    """Child side of `build_model_library`: plain arguments, plain result."""
    import tvm

    from tunefarm import fastmath, tir_pipeline

    fastmath.install()  # the same vectorizable exp/tanh/erf the tuned kernels were measured with
    tir_pipeline.register()  # and the same TIR rewrites (CPU targets)
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
        from tunefarm.models.alternatives import schedule_key
        from tunefarm.models.tasks import extract_tasks

        tasks = extract_tasks(fused, fused=True)
        mod = apply_schedules(fused, schedules, tasks=tasks)
        keys = [k for k in (schedule_key(t, schedules) for t in tasks.tasks) if k is not None]
        # Weights the schedules store in a rewritten layout: the transforms are split off
        # and folded into the constants now, never run per inference.
        mod = _fold_layouts(mod)
    target = _tvm_target(target_dict)
    try:
        with _lowering(target_dict, cuda_graph):
            ex = tvm.compile(mod, target=target, relax_pipeline=relax_pipeline(target),
                             tir_pipeline="default" if is_gpu(target_dict) else tir_pipeline.PIPELINE)
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


def _lowering(target: dict[str, Any], cuda_graph: bool = False) -> contextlib.AbstractContextManager:
    """The pass context the kernels of `target` lower in (`tunefarm.cuda.lowering` for a
    CUDA target: cp.async for the tuned kernels' pipelined shared stages), with the
    model's CUDA graphs when asked."""
    if not is_gpu(target):
        return contextlib.nullcontext()
    return lowering(target, CUDA_GRAPH_CONFIG if cuda_graph else None)


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


# -- checking and timing against onnxruntime --------------------------------------------------


# -- helpers --------------------------------------------------------------------------------


def call_isolated(
    worker: IsolatedWorker | None,
    what: str,
    func: str,
    *args: Any,
    timeout: float,
    env: dict[str, str] | None = None,
):
    if worker is not None:
        return worker.call(func, *args, timeout=timeout)
    with IsolatedWorker(env=env, name=f"model-{what}", blocked_imports=WITHOUT_TORCH) as own:
        return own.call(func, *args, timeout=timeout)


def child_error_text(message: str) -> str:
    """ "ModelError: compiling failed: ..." -> "compiling failed: ..." (the child's own errors)."""
    prefix = f"{ModelError.__name__}: "
    return message[len(prefix) :] if message.startswith(prefix) else message


def input_identifier(name: str, index: int) -> str:
    """The Python name manifest.json's usage lines give an input (its own name where that is an identifier)."""
    text = "".join(c if c.isalnum() or c == "_" else "_" for c in name)
    return text if text and not text[0].isdigit() and text.isidentifier() else f"input_{index}"


def _spec_json(t: TensorSpec) -> dict[str, Any]:
    return {"name": t.name, "shape": list(t.shape), "dtype": t.dtype}


