"""The MetaSchedule peer: tune one workload with TVM MetaSchedule, export its best kernel.

Runs inside a child process (`python -m tunefarm_app.bench.peers metaschedule ...`), whose
stdout and stderr the bench sends to a log file; MetaSchedule's own logs go to
`<work_dir>/logs`. What it does, with MetaSchedule's defaults unless said otherwise:

1. `import tvm.s_tir.tensor_intrin` (MetaSchedule's schedule rules need it), or for a CPU
   target only its CPU modules. On this machine the whole import takes 20-40 s
   (TVMScript's parser calls `inspect.stack()` for each of ~500 intrinsics;
   `import_tensor_intrinsics` brings it down to about 6 s, and under 1 s for a CPU); it is
   a one-off start-up cost, timed as `setup_secs` and left out of the tuning wall time.
2. `ms.tune_tir(mod, target, work_dir, max_trials_global=N, num_trials_per_iter=64)` with
   the workload's constant inputs marked `layout_free_buffers` (MetaSchedule's RewriteLayout
   then stores them in the layout its loops read, as tunefarm may), and
   the "evolutionary" strategy, "xgb" cost model and local runner, timed as `tune_secs`.
   One change to the defaults: the builder's build function is `build_without_intrin`, the
   default build (same passes, same `tvm.compile`) minus that import. MetaSchedule restarts
   its build pool for every batch, so with the default build function every batch paid the
   import again in each worker and the first build of each worker hit the 30 s build
   timeout; that is a quirk of this machine, not of MetaSchedule's search.
3. Count the trials: every measured candidate is a database record, a failed one with
   run_secs 1e10. MetaSchedule stops early when its search finds no new candidate; the
   result reports how many trials it really made.
4. `ms.tir_integration.compile_tir(database, mod, target)` gives the best schedule;
   `tvm.compile` + `export_library` write it to the requested .so (function "main", plus
   the layout transform of a rewritten constant, `tunefarm.layout`), which the bench then
   times with tunefarm's own runner, on the pre-transformed constant.

The child inherits TVM_NUM_THREADS from the bench (the cores of the target), so
MetaSchedule's runner times candidates with as many threads as tunefarm's does.

For a CUDA target (`tunefarm.gpu.is_gpu`) MetaSchedule measures on this machine's GPU with
its GPU rules; its kernels' binaries come from the same nvcc call and flags as tunefarm's
(`tunefarm.cuda.use_nvcc`), its builder and search use this host's cores, and its best kernel is
exported as a `tunefarm.cuda` artifact, which tunefarm's runner times on the GPU. No input
is marked layout-free (MetaSchedule's RewriteLayout is a CPU postprocessor).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

MS_TRIALS_PER_ITER = 64
"""Candidates MetaSchedule measures per search iteration (`num_trials_per_iter`)."""

MS_FAILED_COST = 1e9
"""MetaSchedule records a failed measurement with run_secs 1e10; anything above this is one."""


@dataclass(frozen=True)
class MetaScheduleOutcome:
    """What the child reports (as JSON) about one MetaSchedule tuning."""

    trials: int  # records in the database: measured candidates, failed ones included
    valid_trials: int  # measurements that built and ran
    requested_trials: int
    tune_secs: float  # wall time of tune_tir
    setup_secs: float  # the one-off `import tvm.s_tir.tensor_intrin` (not in tune_secs)
    best_recorded_secs: float | None  # MetaSchedule's own timing of its best candidate
    library: str | None  # the exported best kernel, None when there is none
    layout_rewrite: bool  # the best schedule takes a constant input in a rewritten layout
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


CPU_INTRINSIC_MODULES = ("x86", "arm_cpu", "riscv_cpu", "hexagon")
"""The modules of `tvm.s_tir.tensor_intrin` that register CPU intrinsics (the package also
registers CUDA's and ROCm's: most of its ~500, and most of its import time)."""


def import_tensor_intrinsics(gpu: bool) -> None:
    """Register the tensor intrinsics MetaSchedule's rules look up: for a GPU target
    `import tvm.s_tir.tensor_intrin`; for a CPU target only its CPU modules
    (`CPU_INTRINSIC_MODULES`), imported under the package without running the package's
    `__init__`, which would parse the CUDA intrinsics too (8 s of the import here; the CPU
    modules take under 1 s). Either way with the import machinery's own frames known to
    `inspect`. TVMScript's parser calls `inspect.stack()` for each intrinsic it parses
    (~500), which looks up the module of every frame on the stack; a frame whose file
    `inspect.getmodule` has not mapped costs a scan of all of `sys.modules` (~2000
    modules after `import tvm`). The import's own frames ("<frozen importlib._bootstrap>",
    a dozen per nested import) were never mapped, so each was such a scan: mapped to
    their modules here, the import takes a fifth of the time. What `inspect` reports of
    those frames is unchanged (a frozen module's source is not read either way)."""
    import importlib._bootstrap
    import importlib._bootstrap_external
    import inspect

    known = getattr(inspect, "modulesbyfile", None)  # getmodule's cache: file name -> module name
    if isinstance(known, dict):
        for module in (importlib._bootstrap, importlib._bootstrap_external):
            known.setdefault(f"<frozen {module.__name__}>", module.__name__)
    if gpu:
        import tvm.s_tir.tensor_intrin  # noqa: F401

        return
    import importlib.util
    import sys

    import tvm.s_tir

    name = "tvm.s_tir.tensor_intrin"
    if name not in sys.modules:
        found = importlib.util.find_spec(name)
        if found is None or found.origin is None:
            raise ImportError(f"{name} is not installed")
        package = importlib.util.module_from_spec(found)  # the package, its __init__ not run
        sys.modules[name] = package
        tvm.s_tir.tensor_intrin = package
    for module in CPU_INTRINSIC_MODULES:
        importlib.import_module(f"{name}.{module}")


def build_without_intrin(mod: Any, target: Any, _params: Any) -> Any:
    """MetaSchedule's `default_build` without its `import tvm.s_tir.tensor_intrin`
    (see the module docstring); the compilation itself is the same, with tunefarm's
    vectorizable exp/tanh/erf so that both tuners are measured on the same math."""
    from tvm.driver import build as tvm_build
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    from tunefarm import fastmath

    fastmath.install()
    if target.kind.name == "cuda":  # both tuners' kernels compiled alike
        from tunefarm.cuda import use_nvcc

        use_nvcc({"kind": "cuda", "arch": str(target.attrs["arch"])})

    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    return tvm_build(mod, target=target)


def metaschedule_gpu_target(target_dict: dict[str, Any]) -> Any:
    """The TVM target MetaSchedule tunes a CUDA target dict for: the limits its GPU rules
    read (threads per block, warp size, shared memory, registers), from `GpuLimits`, the
    same limits tunefarm's GPU rules and validity checks use."""
    from tunefarm.cuda import tvm_target
    from tunefarm.gpu import GpuLimits

    limits = GpuLimits.of(target_dict)
    return tvm_target(
        {
            "max_threads_per_block": limits.max_threads_per_block,
            "thread_warp_size": limits.warp_size,
            # MetaSchedule's shared stages are static: 48 KB at most, whatever tunefarm's dynamic stages may take
            "max_shared_memory_per_block": limits.static_shared_memory_per_block,
            "registers_per_block": limits.registers_per_block,
            **target_dict,
        }
    )


def tune_metaschedule(
    workload_mod: Any,
    target_dict: dict[str, Any],
    *,
    constants: tuple[int, ...] = (),
    trials: int,
    work_dir: Path,
    library: Path,
    seed: int,
) -> MetaScheduleOutcome:
    """Steps 1-4 of the module docstring."""
    t0 = time.perf_counter()
    import tvm
    from tvm.s_tir import meta_schedule as ms

    from tunefarm.gpu import is_gpu
    from tunefarm.target import physical_cores

    gpu = is_gpu(target_dict)
    import_tensor_intrinsics(gpu)  # registers the intrinsics the rules look up
    setup_secs = time.perf_counter() - t0
    target = metaschedule_gpu_target(target_dict) if gpu else tvm.target.Target(target_dict)
    if constants and not gpu:  # MetaSchedule's RewriteLayout postproc rewrites the inputs marked so
        workload_mod = tvm.IRModule({"main": workload_mod["main"].with_attr("layout_free_buffers", list(constants))})
    _fresh_work_dir(work_dir)
    cores = physical_cores() if gpu else int(target_dict.get("num-cores") or 1)
    t0 = time.perf_counter()
    builder = ms.builder.LocalBuilder(max_workers=cores, f_build=build_without_intrin)
    database = ms.tune_tir(
        workload_mod,
        target,
        str(work_dir),
        max_trials_global=trials,
        num_trials_per_iter=MS_TRIALS_PER_ITER,
        builder=builder,
        num_tuning_cores=cores,
        seed=seed,
    )
    tune_secs = time.perf_counter() - t0
    costs = [_record_cost(r) for r in database.get_all_tuning_records()]
    valid = [c for c in costs if c < MS_FAILED_COST]
    sch = ms.tir_integration.compile_tir(database, workload_mod, target)
    outcome = MetaScheduleOutcome(
        trials=len(costs),
        valid_trials=len(valid),
        requested_trials=trials,
        tune_secs=tune_secs,
        setup_secs=setup_secs,
        best_recorded_secs=min(valid) if valid else None,
        library=None,
        layout_rewrite=False,
        note="" if len(costs) >= trials else f"MetaSchedule stopped after {len(costs)} of {trials} trials",
    )
    if sch is None:
        return _with_note(outcome, "MetaSchedule's database has no valid schedule")
    return _export_best(sch, outcome, target, target_dict, library)


def _export_best(sch: Any, outcome: MetaScheduleOutcome, target: Any, target_dict: dict[str, Any],
                 library: Path) -> MetaScheduleOutcome:
    """Step 4: MetaSchedule's best schedule compiled and exported to `library`."""
    import tvm

    from tunefarm import fastmath, layout
    from tunefarm.export import export_library
    from tunefarm.gpu import is_gpu

    library.parent.mkdir(parents=True, exist_ok=True)
    fastmath.install()
    if is_gpu(target_dict):
        from tunefarm.cuda import use_nvcc

        use_nvcc(target_dict)
        export_library(tvm.compile(sch.mod, target=target), library, target_dict)
        return MetaScheduleOutcome(**{**outcome.as_dict(), "library": str(library)})
    # The layout transform of a constant goes into the library beside the kernel, as in
    # tunefarm's builds, so that the bench times both kernels on pre-transformed weights.
    tvm.compile(layout.kernel_library_module(sch.mod), target=target).export_library(str(library))
    rewrites = layout.has_layout_rewrite(sch.mod["main"])
    return MetaScheduleOutcome(**{**outcome.as_dict(), "library": str(library), "layout_rewrite": rewrites})


def _fresh_work_dir(work_dir: Path) -> None:
    if (work_dir / "database_tuning_record.json").exists():
        raise FileExistsError(f"{work_dir} already holds a MetaSchedule database; use a fresh --work-dir")
    work_dir.mkdir(parents=True, exist_ok=True)


def _record_cost(record: Any) -> float:
    secs = [float(s) for s in record.run_secs] if record.run_secs is not None else []
    return sum(secs) / len(secs) if secs else math.inf


def _with_note(outcome: MetaScheduleOutcome, note: str) -> MetaScheduleOutcome:
    joined = "; ".join(n for n in (outcome.note, note) if n)
    return MetaScheduleOutcome(**{**outcome.as_dict(), "note": joined})


@dataclass(frozen=True)
class MetaScheduleModelOutcome:
    """What the child reports about MetaSchedule's tuning of a whole model."""

    trials: int  # tuning records in the database (failed ones included)
    requested_trials: int
    tasks: int  # tasks MetaSchedule extracted
    tune_secs: float  # wall time of tune_relax
    setup_secs: float  # the one-off `import tvm.s_tir.tensor_intrin`
    directory: str  # the built model (model.so + manifest.json), for `run_model`
    scheduled_functions: int  # PrimFuncs that took a schedule from the database

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def tune_metaschedule_model(
    onnx_path: Path,
    input_shapes: dict[str, list[int]],
    target_dict: dict[str, Any],
    *,
    trials: int,
    work_dir: Path,
    out_dir: Path,
    seed: int,
) -> MetaScheduleModelOutcome:
    """MetaSchedule on a whole model, the way TVM documents it: the same import and the
    same fusion as tunefarm (so both tune the same tasks), the weights marked layout-free
    (`AttachAttrLayoutFreeBuffers`, as TVM's static-shape tuning pipeline does with
    weight prepacking), `tune_relax` with the budget, `MetaScheduleApplyDatabase` on that
    same fused module, the weight layout transforms folded, `tvm.compile`, export."""
    t0 = time.perf_counter()
    import tvm
    from tvm import relax
    from tvm.s_tir import meta_schedule as ms

    from tunefarm.gpu import is_gpu

    import_tensor_intrinsics(is_gpu(target_dict))

    from tunefarm.models.importer import import_model
    from tunefarm.models.tasks import fuse

    setup_secs = time.perf_counter() - t0
    imported = import_model(onnx_path.read_bytes(), {k: tuple(v) for k, v in input_shapes.items()})
    # The weights marked layout-free, so that MetaSchedule's RewriteLayout may store them in
    # the order its loops read them, as tunefarm may; the transforms are folded below.
    fused = relax.transform.AttachAttrLayoutFreeBuffers()(fuse(imported.mod))
    target = tvm.target.Target(target_dict)
    _fresh_work_dir(work_dir)
    cores = int(target_dict.get("num-cores") or 1)
    n_tasks = len(ms.relax_integration.extract_tasks(fused, target))
    t0 = time.perf_counter()
    database = ms.relax_integration.tune_relax(
        fused,
        params={},
        target=target,
        work_dir=str(work_dir),
        max_trials_global=trials,
        num_trials_per_iter=32,
        builder=ms.builder.LocalBuilder(max_workers=cores, f_build=build_without_intrin),
        seed=seed,
    )
    tune_secs = time.perf_counter() - t0
    n_records = len(database.get_all_tuning_records())
    scheduled = _build_applied(fused, database, target, target_dict, imported, out_dir)
    return MetaScheduleModelOutcome(n_records, trials, n_tasks, tune_secs, setup_secs, str(out_dir), scheduled)


def _build_applied(fused: Any, database: Any, target: Any, target_dict: dict[str, Any], imported: Any,
                   out_dir: Path) -> int:
    """The fused model with the database's schedules applied, its weight layouts folded,
    built into `out_dir` with a manifest; how many PrimFuncs took a schedule."""
    import tvm
    from tvm import relax

    from tunefarm import fastmath, layout
    from tunefarm.models.build import LIBRARY_NAME, write_manifest

    with target, database:
        applied = relax.transform.MetaScheduleApplyDatabase()(fused)
    applied = layout.fold_layout_rewrites(applied)
    scheduled = sum(
        1
        for _, f in applied.functions.items()
        if isinstance(f, tvm.tirx.PrimFunc) and f.attrs is not None and "tirx.is_scheduled" in f.attrs
    )
    fastmath.install()
    out_dir.mkdir(parents=True, exist_ok=True)
    tvm.compile(applied, target=target).export_library(str(out_dir / LIBRARY_NAME))
    write_manifest(
        out_dir, name=f"{imported.name} (MetaSchedule)", target=target_dict, inputs=imported.inputs,
        outputs=imported.outputs, scheduled=[],
    )
    return scheduled
