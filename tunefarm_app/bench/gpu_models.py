"""`tunefarm bench gpu-models`: whole models tuned for this machine's NVIDIA GPU, against
what a team would run on that GPU without us: PyTorch eager (cuDNN, cuBLAS) and
`torch.compile(mode="max-autotune")` (Triton kernels it benchmarks itself), all in float32
with TF32 off.

Per model of the set (`tunefarm.models.examples`: a torch module with fixed random weights,
exported to ONNX):
- tunefarm: `tune_models` on the ONNX graph with the GPU's CUDA target and N trials; the
  tuned model is checked against onnxruntime on the CPU on every input kind (the same
  check and tolerance as on a CPU) before it is timed;
- PyTorch eager and `torch.compile` of the same module, in a child process of their own
  (compiling happens there, before any timing, and may take minutes).
- tunefarm with CUDA graphs: the same tuned kernels built again with
  `build_model_library(cuda_graph=True)` and checked the same way: what graph launches
  save beside the plain build.
Then all are timed on the same input in alternating blocks (`time_interleaved`),
each call followed by a device synchronisation, and the table gives p50s and ratios
(above 1.0: tunefarm is faster; for the CUDA-graph build, below 1.0: the graphs are). A contender that fails gives "n/a" and a note.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tunefarm.errors import UsageError

Log = Callable[[str], None]

GPU_MODELS = ("yolov8n_like",)
"""The default model set: a detector-sized model."""

COMPILE_TIMEOUT = 900.0
"""Seconds `torch.compile` may take to compile and warm up a model (max-autotune
benchmarks many kernels)."""

TORCH_MODES = {"torch_eager": None, "torch_compile": "max-autotune"}
"""The PyTorch contenders: name -> torch.compile mode (None: eager)."""

GRAPHS = "tunefarm_graphs"
"""The tuned model's kernels run as CUDA graphs: timed beside the plain build, so the
table says what graph launches save on this GPU (where many small kernels' launches
dominate a model's time)."""


@dataclass
class GpuModelRow:
    model: str
    trials: int
    gpu: str = ""
    tune_secs: float | None = None
    search_share: float | None = None
    check: str = ""  # "ok", or why the tuned model is not timed
    graphs_check: str = ""  # "ok" when the CUDA-graph build passed the check too
    p50: dict[str, float] = field(default_factory=dict)  # contender -> seconds
    p90: dict[str, float] = field(default_factory=dict)
    p99: dict[str, float] = field(default_factory=dict)
    round_ratios: dict[str, list[float]] = field(default_factory=dict)  # peer -> per-round p50 ratio
    notes: list[str] = field(default_factory=list)


def add_command(bsub) -> None:
    p = bsub.add_parser("gpu-models", help="tune whole models on this machine's GPU; compare with PyTorch and torch.compile")
    p.add_argument("--trials", type=int, default=500, help="trial budget per model (default 500)")
    p.add_argument("--models", default=",".join(GPU_MODELS), help=f"comma-separated example models (default {','.join(GPU_MODELS)})")
    p.add_argument("--no-compile", action="store_true", help="leave torch.compile out (its max-autotune takes minutes)")
    p.add_argument("--compile-timeout", type=float, default=COMPILE_TIMEOUT,
                   help=f"seconds torch.compile may take per model (default {COMPILE_TIMEOUT:.0f})")
    p.add_argument("--json", type=Path, help="write the results as JSON here")
    p.add_argument("--work-dir", type=Path, help="keep models, records and builds here")
    p.add_argument("--seed", type=int, default=1, help="search seed (default 1)")


def run_gpu_models_bench(args: argparse.Namespace) -> int:
    from tunefarm.models.examples import EXAMPLES
    from tunefarm_app.bench.ops import fresh_work_dir

    if args.trials < 1:
        raise UsageError("--trials must be at least 1")
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [n for n in names if n not in EXAMPLES]
    if unknown or not names:
        raise UsageError(f"--models: unknown model {unknown[0] if unknown else ''!r}; known: {', '.join(EXAMPLES)}")
    target = local_gpu_target()
    work = args.work_dir or fresh_work_dir()
    _stderr(f"bench gpu-models: {', '.join(names)} x {args.trials} trials on {target['arch']}; work dir {work}")
    modes = {k: v for k, v in TORCH_MODES.items() if not (args.no_compile and v is not None)}
    rows = []
    for name in names:
        row = bench_gpu_model(name, args.trials, work, target, modes, seed=args.seed,
                              compile_timeout=args.compile_timeout, log=lambda m, n=name: _stderr(f"[{n}] {m}"))  # fmt: skip
        rows.append(row)
        print("\n".join(render([row])), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"target": target, "rows": [asdict(r) for r in rows]}, indent=1))
    return 0


def local_gpu_target() -> dict[str, Any]:
    """The CUDA target of this machine's GPU (asked in a child process). UsageError without one."""
    from tunefarm.isolation import IsolatedWorker

    with IsolatedWorker(name="gpu-probe") as worker:
        outcome = worker.call("tunefarm.cuda:describe_gpu", timeout=60.0)
    if not outcome.ok:
        raise UsageError(f"bench gpu-models needs an NVIDIA GPU: {outcome.message.splitlines()[-1]}")
    major, minor = str(outcome.value["compute_capability"]).split(".")[:2]
    return {"kind": "cuda", "arch": f"sm_{major}{minor}"}


def bench_gpu_model(
    name: str, trials: int, work: Path, target: dict[str, Any], modes: Mapping[str, str | None], *, seed: int,
    log: Log, compile_timeout: float = COMPILE_TIMEOUT,
) -> GpuModelRow:
    from tunefarm.isolation import IsolatedWorker
    from tunefarm.models.examples import export_example
    from tunefarm.models.finish import load_model, model_inputs
    from tunefarm.models.runtime import load_manifest, model_worker, timing_block
    from tunefarm.models.timing import round_ratios, time_interleaved
    from tunefarm.tune import tune_models

    row = GpuModelRow(name, trials)
    onnx = export_example(name, work / "models" / f"{name}.onnx")
    feeds = model_inputs(load_model(onnx, name=name))
    log(f"tunefarm: {trials} trials on {target['arch']}")
    t0 = time.perf_counter()
    ours = tune_models([onnx], trials=trials, out=work / "ours" / name, target=target, seed=seed, log=log)
    row.tune_secs = time.perf_counter() - t0
    row.search_share = ours.report.get("search_share")
    outcome = ours.models[0]
    row.gpu = (outcome.measured_on or {}).get("gpu", "")
    row.check = "ok" if outcome.directory else (outcome.error or "not built")
    npz = work / "inputs" / f"{name}.npz"
    npz.parent.mkdir(parents=True, exist_ok=True)
    np.savez(npz, **feeds)
    workers: list[IsolatedWorker] = []
    blocks = {}
    try:
        if outcome.directory:
            manifest = load_manifest(outcome.directory)
            ordered = work / "inputs" / f"{name}.ordered.npz"
            np.savez(ordered, *[feeds[s["name"]] for s in manifest["inputs"]])
            worker = model_worker(1)
            workers.append(worker)
            lib = str(Path(outcome.directory) / manifest["library"])
            blocks["tunefarm"] = timing_block(worker, "tunefarm", "tunefarm.models.runtime:tvm_block_job", (lib, str(ordered)), 300.0)
            graphs = _with_cuda_graphs(name, onnx, ours.schedules, work / "ours-graphs" / name, target, row, log)
            if graphs is not None:
                worker = model_worker(1)
                workers.append(worker)
                blocks[GRAPHS] = timing_block(worker, GRAPHS, "tunefarm.models.runtime:tvm_block_job",
                                              (str(graphs), str(ordered)), 300.0)  # fmt: skip
        for peer, mode in modes.items():
            worker = IsolatedWorker(name=peer)
            log(f"{peer}: loading{' and compiling (' + mode + ')' if mode else ''}")
            t0 = time.perf_counter()
            ready = worker.call(f"{__name__}:torch_prepare_job", name, str(npz), mode, timeout=compile_timeout)
            if not ready.ok:
                row.notes.append(f"{peer}: {ready.status}: {ready.message.splitlines()[-1] if ready.message else ''}")
                worker.close()
                continue
            log(f"{peer}: ready in {time.perf_counter() - t0:.0f} s; its output differs from the model's by {ready.value:.2e} (max abs)")
            workers.append(worker)
            blocks[peer] = timing_block(worker, peer, f"{__name__}:torch_block_job", (name, str(npz), mode), 300.0)
        log(f"timing {', '.join(blocks)} in alternating blocks")
        timed = time_interleaved(blocks)
    finally:
        for w in workers:
            w.close()
    for k, lat in timed.items():
        row.p50[k], row.p90[k], row.p99[k] = lat.median, lat.p90, lat.p99
    if "tunefarm" in timed:
        for peer in [*modes, GRAPHS]:
            if peer in timed:
                row.round_ratios[peer] = round_ratios(timed[peer].as_report(), timed["tunefarm"].as_report())
    return row


def _with_cuda_graphs(
    name: str, onnx: Path, schedules: Mapping[str, Any], directory: Path, target: dict[str, Any], row: GpuModelRow,
    log: Log,
) -> Path | None:
    """The tuned model built again with the same kernels run as CUDA graphs
    (`build_model_library(cuda_graph=True)`) and checked like it: its library, or None
    (and a note) where it does not build or fails the check."""
    from tunefarm.errors import ModelError
    from tunefarm.models.build import build_model_library, library_name
    from tunefarm.models.finish import check_built, load_model

    m = load_model(onnx, name=name)
    log("tunefarm: the same kernels built with CUDA graphs")
    try:
        build_model_library(m.tasks.fused_mod, directory, target=target, inputs=m.imported.inputs,
                            outputs=m.imported.outputs, schedules=schedules, name=f"{name} (CUDA graphs)",
                            cuda_graph=True)  # fmt: skip
    except ModelError as exc:
        row.notes.append(f"{GRAPHS}: {exc}")
        return None
    result = check_built(m, directory)
    if not result.ok:
        row.notes.append(f"{GRAPHS}: fails the check: {result.problem()}")
        return None
    row.graphs_check = "ok"
    return directory / library_name(target)


# -- PyTorch on the GPU, in its own child process --------------------------------------------

_TORCH: dict[tuple, tuple[Callable[[], Any], list]] = {}
"""In a PyTorch child: the warm call and its GPU inputs per (model, inputs, mode)."""


def torch_prepare_job(name: str, inputs_npz: str, mode: str | None) -> float:
    """Child side: build the example's torch module on the GPU (compiled with `mode`, or
    eager), run it until it is warm; the largest absolute difference of its output from
    the same module run in float64 on the CPU (a sanity figure for the log)."""
    import torch

    from tunefarm.models.examples import build_example

    call, x = _torch_call(name, inputs_npz, mode)
    got = call()
    reference = build_example(name)[0].double()  # its own copy: the timed module stays as compiled
    with torch.no_grad():
        exact = reference(*[t.double().cpu() for t in x])
    got = got if isinstance(got, (tuple, list)) else (got,)
    exact = exact if isinstance(exact, (tuple, list)) else (exact,)
    return max(float((g.double().cpu() - e).abs().max()) for g, e in zip(got, exact))


def torch_block_job(
    name: str, inputs_npz: str, mode: str | None, runs: int | None, budget_secs: float, warmup_secs: float, min_runs: int
) -> tuple[list[float], int]:
    """Child side of one timing block of a PyTorch contender (see `tunefarm.models.timing`)."""
    from tunefarm.models.runtime import timed_block

    call, _ = _torch_call(name, inputs_npz, mode)
    return timed_block(call, runs, budget_secs, warmup_secs, min_runs), 1


def _torch_call(name: str, inputs_npz: str, mode: str | None):
    key = (name, inputs_npz, mode)
    if key not in _TORCH:
        import torch

        from tunefarm.models.examples import build_example

        torch.backends.cuda.matmul.allow_tf32 = False  # float32 math, as the TVM kernels do
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.benchmark = True  # cuDNN picks its fastest algorithm per shape
        module = build_example(name)[0].cuda()
        with np.load(inputs_npz) as data:
            x = [torch.from_numpy(data[k]).cuda() for k in data.files]
        run = torch.compile(module, mode=mode) if mode else module

        def call() -> Any:
            with torch.no_grad():
                out = run(*x)
            torch.cuda.synchronize()
            return out

        for _ in range(3):
            call()
        _TORCH[key] = (call, x)
    return _TORCH[key]


# -- the table -----------------------------------------------------------------------------------


def render(rows: list[GpuModelRow]) -> list[str]:
    peers = [GRAPHS, *TORCH_MODES]
    head = ["model", "trials", "GPU", "check", "tune s", "search %", "tunefarm p50 ms",
            *(f"{p} p50 ms" for p in peers), *(f"vs {p}" for p in peers)]  # fmt: skip
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        ours = r.p50.get("tunefarm")
        cells = [r.model, str(r.trials), r.gpu or "?", r.check if r.check == "ok" else "FAILED",
                 f"{r.tune_secs:.0f}" if r.tune_secs else "n/a",
                 f"{100 * r.search_share:.0f}" if r.search_share is not None else "n/a",
                 _ms(ours), *(_ms(r.p50.get(p)) for p in peers),
                 *(f"{r.p50[p] / ours:.2f}x" if ours and p in r.p50 else "n/a" for p in peers)]  # fmt: skip
        lines.append(" | ".join(cells))
        lines += [f"  note: {n}" for n in r.notes]
        if r.check != "ok":
            lines.append(f"  check: {r.check}")
        for p, ratios in r.round_ratios.items():
            lines.append(f"  {p} / tunefarm per round: {', '.join(f'{x:.2f}' for x in ratios)}")
    return lines


def _ms(secs: float | None) -> str:
    return f"{secs * 1e3:.3f}" if secs else "n/a"


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
