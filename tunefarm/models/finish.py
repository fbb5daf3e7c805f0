"""After tuning a whole model: build it with the best schedules, check it, report.

The service-agnostic half of `tunefarm tune` (embedded mode) and of the farm's scheduler
service, which both end a run the same way and write the same directory:

    model.so, manifest.json     the tuned model (`build_model_library`)
    reference.onnx              the ONNX graph it was imported from (for `tunefarm run`'s
                                onnxruntime column; ONNX models only)
    records.jsonl               every measurement, one `MeasureRecord` JSON line each
    report.json                 `model_report`: per task best and trials, check, latency

Map:
- `load_model` / `LoadedModel`: an imported model, its tasks and its reference
  (onnxruntime on the ONNX graph as given, the module itself for torch); `model_inputs`
  seeds its inputs (the timing input, the first of the check's input kinds);
- `finish_model`: build with the tasks' best schedules, check it against the reference
  on every input kind (`tunefarm.models.check`; a mismatch beyond float32 noise is an
  error: the library is kept as `model.failed-check.so` and the task to suspect is
  found by bisection, `tunefarm.models.suspects`), time it and onnxruntime on the same threads (`tunefarm.models.timing`),
  `ModelOutcome`;
- `model_report`: the report as plain data, from what a run of the search came to
  (`tunefarm.search.run`'s `TaskOutcome`s and `TuningSummary`: embedded mode's and the
  farm's jobs' alike);
- `write_records`, `archive_directory`: the records file and the one-file archive of a
  tuned model directory (what the farm's API hands out).

Nothing here imports `services` or `tunefarm_app`.
"""

from __future__ import annotations

import io
import math
import os
import re
import tarfile
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tunefarm.errors import ModelError
from tunefarm.gpu import is_gpu
from tunefarm.isolation import WITHOUT_TORCH, IsolatedWorker
from tunefarm.models import check
from tunefarm.models.alternatives import DIRECT, Choice, schedule_key
from tunefarm.models.build import build_default_library, build_model_library, library_name
from tunefarm.models.importer import ImportedModel, import_model
from tunefarm.models.peers import ONNXRUNTIME, OPENVINO, available_peers
from tunefarm.models.precision import FP32, reductions_per_run, tolerance
from tunefarm.models.runtime import model_threads, model_worker, run_model, time_side_by_side
from tunefarm.models.suspects import Suspects, find_suspects
from tunefarm.models.tasks import CONV_LAYOUTS, ModelTasks, extract_tasks
from tunefarm.records import MeasureRecord
from tunefarm.search.run import TaskOutcome, TuningSummary

RECORDS_NAME = "records.jsonl"
REPORT_NAME = "report.json"
FAILED_LIBRARY_NAME = "model.failed-check.so"
"""Where a tuned model that failed its check is kept (loaded by nothing; for inspection);
`failed_library_name` for a CUDA model's."""
REFERENCE_NAME = "reference.onnx"

REPORT_VERSION = 1

DEFAULT_BUILD_REPEAT = 5
"""Timed inferences of TVM's untuned default build (it is slow; a few are enough)."""


def failed_library_name(target: dict[str, Any]) -> str:
    """Where a tuned model built for `target` that failed its check is kept."""
    return FAILED_LIBRARY_NAME if not is_gpu(target) else library_name(target).replace("model.", "model.failed-check.", 1)


# -- loading ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadedModel:
    """An imported model, its tasks and how to get reference outputs."""

    imported: ImportedModel
    tasks: ModelTasks
    reference: Callable[[dict[str, np.ndarray]], list[np.ndarray]]
    reference_name: str  # "onnxruntime" or "torch"
    # The ONNX graph as given (before simplification): the check's reference and the
    # graph onnxruntime is timed on. None for a torch module.
    reference_onnx: bytes | None = None
    # The model in float64, for the check's noise judgment (`check.ExactReference`).
    exact: check.ExactReference | None = None

    @property
    def name(self) -> str:
        return self.imported.name


def model_name(source: Any, taken: set[str]) -> str:
    """A unique, file-name-safe name: the file's stem, or the module's class name."""
    if isinstance(source, (str, Path)):
        base = Path(source).stem
    else:
        base = type(source).__name__
    base = re.sub(r"[^A-Za-z0-9_.-]", "_", base) or "model"
    name, n = base, 2
    while name in taken:
        name, n = f"{base}_{n}", n + 1
    taken.add(name)
    return name


def load_model(
    source: Any,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    *,
    name: str,
    example_inputs: Sequence[Any] | None = None,
    conv_layouts: dict[str, list[str]] | None = CONV_LAYOUTS,
    precision: str = FP32,
) -> LoadedModel:
    """Import one model (a path, ONNX bytes, a ModelProto or a torch module) and extract
    its tasks (`conv_layouts`, `precision`: `tunefarm.models.tasks.fuse`'s)."""
    if isinstance(source, (str, Path)) and not Path(source).is_file():
        raise ModelError(f"no such model file: {source}")
    imported = import_model(source, input_shapes, name=name, example_inputs=example_inputs)
    tasks = extract_tasks(imported, name=name, conv_layouts=conv_layouts, precision=precision)
    if imported.onnx_bytes is not None:
        # The reference is the graph the user has, not the simplified one TVM converted:
        # a simplification that moved the results must not move the reference with them.
        original = _onnx_bytes(source) or imported.onnx_bytes
        return LoadedModel(
            imported, tasks, onnx_reference(original), "onnxruntime", original, check.exact_onnx_reference(original)
        )

    module = source

    def torch_reference(feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        import torch

        with torch.no_grad():
            out = module(*[torch.from_numpy(feeds[t.name]) for t in imported.inputs])
        outs = out if isinstance(out, (tuple, list)) else (out,)
        return [o.detach().numpy() for o in outs]

    exact = check.exact_torch_reference(module, [t.name for t in imported.inputs])
    return LoadedModel(imported, tasks, torch_reference, "torch", exact=exact)


def _onnx_bytes(source: Any) -> bytes | None:
    """The serialized ONNX graph of an ONNX source (a path, bytes or a ModelProto)."""
    if isinstance(source, (str, Path)):
        return Path(source).read_bytes()
    if isinstance(source, bytes):
        return source
    serialize = getattr(source, "SerializeToString", None)
    return serialize() if callable(serialize) else None


def onnx_reference(onnx_bytes: bytes) -> Callable[[dict[str, np.ndarray]], list[np.ndarray]]:
    """Reference outputs of an ONNX graph from onnxruntime."""

    def reference(feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        from tunefarm.models.importer import run_onnxruntime

        return [np.asarray(x) for x in run_onnxruntime(onnx_bytes, feeds)]

    return reference


def check_inputs(model: LoadedModel) -> dict[str, dict[str, np.ndarray]]:
    """The inputs of the output check, one set per input kind (`tunefarm.models.check`)."""
    specs = model.imported.inputs
    return check.check_inputs({t.name: t.shape for t in specs}, {t.name: t.dtype for t in specs})


def model_inputs(model: LoadedModel) -> dict[str, np.ndarray]:
    """The timing input: the first input kind's set."""
    return check_inputs(model)[check.INPUT_KINDS[0].name]


# -- building and checking ------------------------------------------------------------------


@dataclass(frozen=True)
class ModelOutcome:
    """One model after tuning: where it was written and how it does."""

    name: str
    directory: Path | None  # None when the build or the check failed
    latency: dict | None  # `Latency.as_report()`: mean, median (p50), p90, p99, threads, runs
    check: dict  # `ModelCheck.as_report()` (ok, reference, per input kind and output, tolerance)
    default_latency: dict | None
    onnxruntime_latency: dict | None = None  # the same timing, input and thread count
    openvino_latency: dict | None = None  # likewise, when OpenVINO is installed
    error: str = ""
    # Where the check and the latency were taken when not on this host: a device class's
    # agent {"device_class", "agent", "emulated", ...}; `emulated` means the latencies
    # (the peers' too) are an emulator's, not the device's.
    measured_on: dict | None = None
    # Where the tuned model's time goes (`profile_breakdown`): the end-to-end latency
    # against its kernel calls, and per task key its row with what holds it back.
    breakdown: dict | None = None
    # Per peer that was not timed where the model was (a farm agent without onnxruntime,
    # a graph it cannot load), why; None when every peer asked for was timed.
    peer_notes: dict | None = None


def finish_model(
    m: LoadedModel,
    directory: Path,
    target: dict[str, Any],
    schedules: Mapping[str, Any],
    *,
    compare_default: bool = False,
    peers: Sequence[str] | None = None,
    log: Callable[[str], None] = lambda msg: None,
) -> ModelOutcome:
    """Build `m` with the best schedules (workload key -> trace; a task without one keeps
    TVM's default build) into `directory`, run it, check its output against the
    reference and time it, beside the engines of `peers` (None: those installed,
    `peers.available_peers()`; (): none, and no OpenVINO layers in the per-task
    breakdown). A mismatch is an error: the library is removed and the outcome says why."""
    keys = {t.key: schedule_key(t, schedules) for t in m.tasks.tasks}  # its own, or an alternative's
    mine = {k: schedules[k] for k in keys.values() if k is not None}
    missing = [t.name for t in m.tasks.tasks if keys[t.key] is None]
    if missing:
        log(f"{m.name}: {len(missing)} task(s) without a valid measurement keep TVM's default build")
    log(f"{m.name}: building the tuned model")
    build_model_library(
        m.tasks.fused_mod,
        directory,
        target=target,
        inputs=m.imported.inputs,
        outputs=m.imported.outputs,
        schedules=mine,
        name=m.name,
        precision=m.tasks.precision,
    )
    threads = model_threads(directory)
    on_gpu = is_gpu(target)
    # (not beside a GPU's model: the peers run on the CPU; `tunefarm bench gpu` times the GPU's)
    peers = () if on_gpu else tuple(available_peers() if peers is None else peers)
    feeds = model_inputs(m)
    with model_worker(threads) as worker:  # the check's child times the model too: one `import tvm`
        result = check_built(m, directory, worker=worker)
        if not result.ok:
            worker.close()
            return _failed_check(m, directory, target, mine, result, log)
        if m.reference_onnx is not None:
            (directory / REFERENCE_NAME).write_bytes(m.reference_onnx)
        # the tuned model, onnxruntime and OpenVINO in alternating blocks: a noisy minute hits all
        timed = time_side_by_side({"tuned": directory}, feeds, threads=threads, onnx_model=m.reference_onnx,
                                  peers=peers, workers={"tuned": worker})  # fmt: skip
    checked = result.as_report()
    latency = timed["tuned"].as_report()
    ort_latency = timed[ONNXRUNTIME].as_report() if ONNXRUNTIME in timed else None
    ov_latency = timed[OPENVINO].as_report() if OPENVINO in timed else None
    default_latency = None
    if compare_default:
        log(f"{m.name}: building and timing TVM's default (untuned) build for comparison")
        default_dir = directory / "untuned"
        build_default_library(
            m.tasks.fused_mod, default_dir, target=target, inputs=m.imported.inputs, outputs=m.imported.outputs,
            name=f"{m.name} (untuned)", precision=m.tasks.precision,
        )
        d = run_model(default_dir, feeds, repeat=DEFAULT_BUILD_REPEAT, threads=threads)
        default_latency = d.latency.as_report() if d.latency else None
    if on_gpu:  # the per-kernel profile reads the CPU's kernels
        return ModelOutcome(m.name, directory, latency, checked, default_latency, measured_on=_gpu_here())
    breakdown = profile_breakdown(m, directory, feeds, target, log, beside_openvino=OPENVINO in peers)
    return ModelOutcome(
        m.name, directory, latency, checked, default_latency, ort_latency, ov_latency, breakdown=breakdown
    )


def _gpu_here() -> dict[str, Any]:
    """`measured_on` of a model timed on this machine's GPU (asked in a child: the tuner's
    own process never initialises CUDA)."""
    with IsolatedWorker(name="gpu-probe") as worker:
        outcome = worker.call("tunefarm.cuda:describe_gpu", timeout=60.0)
    return outcome.value if outcome.ok else {"gpu": f"unknown ({outcome.message})"}



def _failed_check(
    m: LoadedModel,
    directory: Path,
    target: dict[str, Any],
    schedules: Mapping[str, Any],
    result: check.ModelCheck,
    log: Callable[[str], None],
) -> ModelOutcome:
    """A model that failed its check: its library is kept under `FAILED_LIBRARY_NAME`
    (never loaded as the tuned model), and the tuned tasks are bisected for the kernel to
    suspect (`tunefarm.models.suspects`)."""
    kept = directory / failed_library_name(target)
    (directory / library_name(target)).replace(kept)
    log(f"{m.name}: the tuned model fails its check ({result.problem()}); looking for the task to suspect")
    keys = {t.name: schedule_key(t, schedules) for t in m.tasks.tasks}
    tuned = [t.name for t in m.tasks.tasks if keys[t.name]]

    def fails(subset: Sequence[str], builder: IsolatedWorker, runner: IsolatedWorker) -> bool:
        with tempfile.TemporaryDirectory(prefix="tunefarm-suspect-") as tmp:
            picked = {keys[n]: schedules[keys[n]] for n in subset}
            build_model_library(
                m.tasks.fused_mod, tmp, target=target, inputs=m.imported.inputs, outputs=m.imported.outputs,
                schedules=picked, name=f"{m.name} ({len(picked)} tuned tasks)", worker=builder,
                precision=m.tasks.precision,
            )
            return not check_built(m, Path(tmp), worker=runner).ok

    try:  # one build process and one run process for every step (one TVM import each)
        with IsolatedWorker(name="model-build", blocked_imports=WITHOUT_TORCH) as builder, model_worker(model_threads(kept.parent)) as runner:
            suspects = find_suspects(tuned, lambda subset: fails(subset, builder, runner))
    except ModelError as exc:
        suspects = Suspects((), 0, f"the bisection could not build the model: {exc}")
    checked = {**result.as_report(), "suspects": suspects.as_report(), "kept_library": kept.name}
    named = ", ".join(suspects.tasks) if suspects.tasks else "none"
    msg = (
        f"{m.name}: the tuned model's output differs from {m.reference_name}'s: {result.problem()};"
        f" kept as {kept} (not the tuned model); suspect task(s): {named} ({suspects.reason})"
    )
    log(msg)
    return ModelOutcome(m.name, None, None, checked, None, error=msg)


def profile_breakdown(
    m: LoadedModel, directory: Path, feeds: Mapping[str, np.ndarray], target: dict[str, Any],
    log: Callable[[str], None], beside_openvino: bool = True,
) -> dict | None:
    """`tunefarm.models.profile` on the built model: the latency against the kernel calls,
    and per task what holds it back (with `beside_openvino`, OpenVINO's matching layers
    where it is installed). None (and a log line) when profiling fails: it is an
    explanation, never a reason to lose a tuned model."""
    from tunefarm.models.profile import in_model_breakdown, kernel_symbols, profile_model
    from tunefarm.target import num_cores

    kernels = kernel_symbols(m.tasks)
    try:
        prof = profile_model(
            directory, [feeds[t.name] for t in m.imported.inputs], kernels, threads=num_cores(target)
        )
    except ModelError as exc:
        log(f"{m.name}: no per-task breakdown: {exc}")
        return None
    rows = in_model_breakdown(m.tasks, prof)
    if beside_openvino and m.reference_onnx is not None and OPENVINO in available_peers():
        _beside_openvino(m, directory / REFERENCE_NAME, feeds, num_cores(target), rows, log)
    return {
        "latency": prof.latency,
        "threads": prof.threads,
        "kernel_calls": len(prof.calls),
        "kernel_seconds": prof.kernel_seconds,
        "warm_kernel_seconds": prof.warm_kernel_seconds,
        "builtin_calls": prof.builtin_calls,
        "overhead_per_call": prof.overhead_per_call,
        "copy_bandwidth": prof.copy_bandwidth,
        "cached_copy_bandwidth": prof.cached_copy_bandwidth,
        "tasks": rows,
    }


OPENVINO_WINS_BY = 1.1
"""A task OpenVINO's matching layer runs at least this much faster is said to be held back by it."""


def _beside_openvino(
    m: LoadedModel, onnx_path: Path, feeds: Mapping[str, np.ndarray], threads: int, rows: dict[str, dict],
    log: Callable[[str], None],
) -> None:
    """Each task's row gains OpenVINO's time per call for the same layer, where one matches
    (`tunefarm.models.peer_layers`), and says so in `holds_back` where OpenVINO is faster."""
    from tunefarm.models.peer_layers import match_tasks, openvino_layers

    try:
        layers = openvino_layers(onnx_path, feeds, threads)
    except ModelError as exc:
        log(f"{m.name}: no per-layer comparison with OpenVINO: {exc}")
        return
    for key, peer in match_tasks(m.tasks.tasks, layers).items():
        row = rows.get(key)
        if row is None:
            continue
        theirs, ours = peer["openvino_seconds_per_call"], row["seconds_per_call"]
        row.update(peer, vs_openvino=theirs / ours if ours > 0 else None)
        if theirs > 0 and ours > OPENVINO_WINS_BY * theirs:
            row["holds_back"] = [*row["holds_back"], f"OpenVINO's layer is {ours / theirs:.1f}x as fast "
                                 f"({theirs * 1e6:.1f} us vs {ours * 1e6:.1f} us)"]  # fmt: skip


def check_built(m: LoadedModel, directory: Path, *, worker: IsolatedWorker | None = None) -> check.ModelCheck:
    """The model built in `directory` against its reference on every input kind (run in
    `worker`, or a child of its own)."""
    if worker is None:
        with model_worker(model_threads(directory)) as own:
            return check_built(m, directory, worker=own)
    return check.check_model(
        lambda feeds: run_model(directory, feeds, repeat=0, worker=worker).outputs,
        m.reference,
        check_inputs(m),
        reference_name=m.reference_name,
        output_names=[t.name for t in m.imported.outputs],
        exact=m.exact,
        tolerance=model_tolerance(m),
    )


def model_tolerance(m: LoadedModel) -> check.Tolerance:
    """The check's tolerance of `m`: its precision's (`tunefarm.models.precision.tolerance`)."""
    precision = m.tasks.precision
    return tolerance(precision, reductions_per_run(m.tasks.fused_mod) if precision != FP32 else 0)


# -- the report -------------------------------------------------------------------------------


def model_report(
    models: Sequence[LoadedModel],
    outcomes: Sequence[ModelOutcome],
    tasks: Mapping[str, TaskOutcome],
    summary: TuningSummary,
    target: dict[str, Any],
    trials_budget: int,
    wall_secs: float,
    *,
    choices: Mapping[str, Choice] | None = None,
) -> dict:
    """`report.json`: per model its check, latency and task rows; the run's accounting.
    `tasks` maps a workload key to its outcome (that of the program the model took);
    `choices`, per task with alternatives, which program that was and what each reached."""
    new = summary.trials - summary.resumed
    tuning = summary.tuning_secs
    return {
        "version": REPORT_VERSION,
        "target": target,
        "trials_budget": trials_budget,
        "trials": summary.trials,
        "resumed_trials": summary.resumed,
        "stop_reason": summary.stop_reason,
        "wall_seconds": round(wall_secs, 3),
        "tuning_seconds": round(tuning, 3),
        "search_seconds": round(summary.search_secs, 3),
        "train_seconds": round(summary.train_secs, 3),
        "measure_seconds": round(summary.measure_secs, 3),
        "seconds_per_trial": round(tuning / max(1, new), 4),
        "search_share": round(summary.search_secs / tuning, 4) if tuning else None,
        "models": [_model_entry(m, o, tasks, summary, choices or {}) for m, o in zip(models, outcomes)],
        "task_scheduler": {
            "strategy": summary.strategy,
            "rounds": [{**d, "task_name": summary.task_names[d["task"]]} for d in summary.decisions],
        },
        "timeline": list(summary.timeline),
    }


def _model_entry(
    m: LoadedModel, o: ModelOutcome, tasks: Mapping[str, TaskOutcome], summary: TuningSummary,
    choices: Mapping[str, Choice],
) -> dict:
    """One model of the report: where it went, its latencies and check, its task rows."""
    rows = [_task_row(t, tasks[t.key], o, choices.get(t.key)) for t in m.tasks.tasks]
    estimate = sum(r["weighted_seconds"] for r in rows if r["weighted_seconds"] is not None)
    complete = [p for p in summary.timeline if not p["unknown_tasks"] and m.name in p["estimated_seconds"]]
    at_start = complete[0]["estimated_seconds"][m.name] if complete else None
    return {
        "name": m.name,
        "precision": m.tasks.precision,
        "directory": str(o.directory) if o.directory else None,
        "inputs": [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype} for t in m.imported.inputs],
        "outputs": [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype} for t in m.imported.outputs],
        "latency": o.latency,
        "untuned_latency": o.default_latency,
        "onnxruntime_latency": o.onnxruntime_latency,
        "openvino_latency": o.openvino_latency,
        "estimated_seconds": estimate,
        "estimated_seconds_at_start": at_start,
        "check": o.check,
        "measured_on": o.measured_on,
        "peer_notes": o.peer_notes,
        "breakdown": {k: v for k, v in o.breakdown.items() if k != "tasks"} if o.breakdown else None,
        "error": o.error or None,
        "warnings": list(m.imported.warnings),
        "tasks": rows,
        "elided": list(m.tasks.elided),
    }


def _task_row(t: Any, tr: TaskOutcome, o: ModelOutcome, choice: Choice | None = None) -> dict:
    """One task of a model in the report: its best, how it was found, its share in the
    model, and the algorithm the model computes it by (with what the others reached)."""
    best = tr.best
    return {
        "name": t.name,
        "key": t.key,
        "shapes": t.shape_summary,
        "weight": t.weight,
        "flops": t.flops,
        "const_inputs": list(t.const_inputs),
        "trials": sum(m.trials for m in choice.members) if choice else tr.trials,  # its alternatives' too
        "best_seconds": best.cost if best else None,
        "weighted_seconds": best.cost * t.weight if best else None,
        "gflops": t.flops / best.cost / 1e9 if best and best.cost > 0 else None,
        "verified": bool(best and best.verified),
        "emulated": bool(best and best.emulated),  # best_seconds is an emulator's time
        "reference": "yes" if tr.verify_available else "none (kernels checked against each other)",
        "schedule": "tuned" if best else "default build (no valid measurement)",
        "dead_reason": tr.dead_reason,
        "errors": dict(tr.errors),
        "in_model": (o.breakdown or {}).get("tasks", {}).get(t.key),
        "algorithm": choice.algorithm if choice else DIRECT,
        "alternatives": choice.as_report() if choice and len(choice.members) > 1 else [],
    }


def plain(o: Any) -> Any:
    """`o` as strict JSON data: non-finite floats become None, numpy scalars numbers."""
    if isinstance(o, dict):
        return {str(k): plain(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [plain(v) for v in o]
    if isinstance(o, (np.floating, np.integer)):
        o = o.item()
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, Path):
        return str(o)
    return o


# -- files ------------------------------------------------------------------------------------


def write_records(path: str | os.PathLike[str], records: Iterable[MeasureRecord]) -> Path:
    """Write `records` as a records file (one JSON line each), replacing `path` atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for r in records:
                f.write(r.to_json() + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


ARCHIVE_ROOT = "tuned"
"""The top directory inside a tuned model archive (`tar xzf` makes `tuned/model.so`, ...)."""


def archive_directory(directory: str | os.PathLike[str], archive: str | os.PathLike[str]) -> Path:
    """Pack a tuned model directory into one gzip'd tar at `archive` (atomic replace):
    every regular file under `directory`, sorted, as `tuned/<relative path>`."""
    directory, archive = Path(directory), Path(archive)
    archive.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=archive.name + ".", suffix=".tmp", dir=archive.parent)
    try:
        with os.fdopen(fd, "wb") as f, tarfile.open(fileobj=f, mode="w:gz") as tar:
            for path in sorted(p for p in directory.rglob("*") if p.is_file()):
                tar.add(path, arcname=f"{ARCHIVE_ROOT}/{path.relative_to(directory).as_posix()}", recursive=False)
        os.replace(tmp, archive)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return archive


def extract_archive(data: bytes | str | os.PathLike[str], out: str | os.PathLike[str]) -> list[Path]:
    """Unpack a tuned model archive into `out` (its `tuned/` prefix dropped). Only regular
    files inside `out` are written (no links, no absolute or parent paths). Returns them."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    source = io.BytesIO(data) if isinstance(data, bytes) else open(data, "rb")  # noqa: SIM115
    written = []
    try:
        with tarfile.open(fileobj=source, mode="r:gz") as tar:
            for member in tar.getmembers():
                rel = Path(member.name)
                if rel.parts[:1] == (ARCHIVE_ROOT,):
                    rel = Path(*rel.parts[1:]) if len(rel.parts) > 1 else Path()
                if not member.isfile() or rel.is_absolute() or ".." in rel.parts or not rel.parts:
                    raise ModelError(f"the archive holds an unexpected entry {member.name!r}")
                dest = out / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                src = tar.extractfile(member)
                assert src is not None
                with open(dest, "wb") as f:
                    f.write(src.read())
                written.append(dest)
    except tarfile.TarError as exc:
        raise ModelError(f"not a tuned model archive: {exc}") from None
    finally:
        source.close()
    return written
