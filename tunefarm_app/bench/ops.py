"""`tunefarm bench ops`: tunefarm against TVM MetaSchedule and the vendor libraries.

What is compared, per op of the benchmark set (`suite.BENCH_OPS`, registry defaults):
- tunefarm: `tune_workload` with the trial budget N, records in `<work>/ours/<op>.jsonl`;
  its best kernel is rebuilt from the records into `<work>/ours/<op>.so`;
- TVM MetaSchedule: `tune_tir` with the same budget N in a child process
  (`ms_peer`), its best kernel exported to `<work>/ms/<op>.so`, its log and database in
  `<work>/ms/<op>.log` and `<work>/ms/<op>/`;
- numpy (OpenBLAS) and, when `import torch` works, PyTorch CPU, each in a child process
  (`vendors`), checked against the reference and timed on the same inputs.

`--target` picks another target than this host's CPU. With a CUDA target
(`{"kind": "cuda", "arch": "sm_90"}`, on a machine with that GPU) every kernel runs on the
GPU: both tuners measure there, the vendor peer is PyTorch on the GPU (cuBLAS and cuDNN,
float32 with TF32 off), numpy is left out, builds and the peers use this host's cores, and
there is no FMA peak (the peer to beat is cuBLAS/cuDNN).

How the numbers are made:
- Kernel speed: both tuners' best kernels are timed by the same tunefarm `LocalRunner`
  with the same timing config on the same task data (`<work>/data/<op>.npz`), outputs
  checked first (`timing`); vendor calls are timed in their own process (median per call).
  Speeds print as GFLOPS, or GB/s for memory-bound ops.
- Tuning cost: wall seconds per trial of each tuner (tunefarm's whole `tune_workload`,
  MetaSchedule's whole `tune_tir`) and the share of tunefarm's wall time spent searching
  (sampling, evolution, cost-model training).
- Cost model: held-out ranking accuracy of fresh models on our records, 5-fold in a
  seeded random order: pairwise accuracy over the pairs beyond the measurement noise,
  Spearman, recall@8 (`heldout`).

Everything runs one thing at a time: no two tunings, and no tuning next to a timing. A peer
that fails, times out or computes a wrong result gives "n/a" and a note, never a crash.
Progress goes to stderr, the table (`table`) to stdout, and `--json` writes the same data.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from tunefarm.errors import UsageError
from tunefarm.export import artifact_suffix
from tunefarm.gpu import is_gpu
from tunefarm.target import physical_cores
from tunefarm.workloads import Workload
from tunefarm_app.bench import peers
from tunefarm_app.bench.heldout import FOLDS, HeldOutAccuracy, held_out_accuracy
from tunefarm_app.bench.results import MetaScheduleRun, OpRow, OursRun, Summary, summarize
from tunefarm_app.bench.suite import BenchOp, select_ops
from tunefarm_app.bench.table import render
from tunefarm_app.bench.timing import KernelTimer

Log = Callable[[str], None]
T = TypeVar("T")

DEFAULT_WORK_ROOT = Path("tunefarm-bench")
"""Each run without --work-dir gets a fresh timestamped directory under this one."""


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class BenchPlan:
    """Everything one bench run needs to know."""

    ops: tuple[BenchOp, ...]
    trials: int  # the trial budget of both tuners, per op
    seed: int
    work_dir: Path
    target: dict[str, Any]
    metaschedule: bool = True  # False: --no-metaschedule
    ms_timeout: float | None = None  # seconds per MetaSchedule child; None: peers.ms_timeout(trials)

    @property
    def on_gpu(self) -> bool:
        return is_gpu(self.target)

    @property
    def cores(self) -> int:
        """CPU cores for CPU kernels, builds and the peers: the target's, this host's for a GPU."""
        return physical_cores() if self.on_gpu else int(self.target.get("num-cores") or 1)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ops"] = [op.id for op in self.ops]
        d["work_dir"] = str(self.work_dir)
        return d


@dataclass(frozen=True)
class _Tuned:
    """A tuner's result before the bench times its best kernel."""

    run: OursRun | MetaScheduleRun | None
    library: Path | None
    notes: tuple[str, ...]


# -- entry point ---------------------------------------------------------------------------


def run_ops_bench(args: argparse.Namespace) -> int:
    """`tunefarm bench ops`: run the plan, print the table, write --json. Exit code 0."""
    plan = plan_from_args(args)
    _stderr(f"bench ops: {len(plan.ops)} ops x {plan.trials} trials; work dir {plan.work_dir}")
    _stderr("plan " + json.dumps(plan.as_dict(), separators=(",", ":")))
    rows = run_bench(plan)
    summary = summarize(rows)
    print(render(rows, summary, trials=plan.trials, header=_header(plan)), flush=True)
    if args.json:
        write_json(args.json, plan, rows, summary)
        _stderr(f"bench ops: JSON written to {args.json}")
    return 0


def plan_from_args(args: argparse.Namespace) -> BenchPlan:
    from tunefarm.target import parse_target

    if args.trials < 1:
        raise UsageError("--trials must be at least 1")
    target = parse_target(args.target)
    if is_gpu(target):
        from tunefarm.cuda import require_local_gpu

        require_local_gpu(target)  # TargetError: this machine cannot run the target's kernels
    return BenchPlan(
        ops=tuple(select_ops(args.ops)),
        trials=args.trials,
        seed=args.seed,
        work_dir=args.work_dir or fresh_work_dir(),
        target=target,
        metaschedule=not args.no_metaschedule,
    )


def fresh_work_dir(root: Path = DEFAULT_WORK_ROOT) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, n = root / stamp, 1
    while path.exists():
        n += 1
        path = root / f"{stamp}-{n}"
    return path


def run_bench(plan: BenchPlan, log: Log = _stderr) -> list[OpRow]:
    """One row per op of the plan, in order, each with the FMA peak measured beside its
    final timing (`bench_op`)."""
    rows = []
    with KernelTimer(plan.cores) as timer:
        for i, op in enumerate(plan.ops, 1):
            prefix = f"[{i}/{len(plan.ops)} {op.id}]"
            rows.append(bench_op(op, plan, timer, lambda msg, p=prefix: log(f"{p} {msg}")))
    return rows


def _fma_peak(plan: BenchPlan, log: Log) -> float | None:
    from tunefarm_app.bench.fma_peak import measure_fma_peak

    if plan.on_gpu:
        log("FMA peak: n/a for a GPU target (PyTorch's cuBLAS/cuDNN on the same GPU is the peer)")
        return None
    try:
        peak = measure_fma_peak(plan.target, plan.work_dir / "fma")
    except Exception as exc:  # the column is n/a; the bench goes on
        log(f"FMA peak: n/a ({_first_line(exc)})")
        return None
    log(f"FMA peak: {peak.gflops:.0f} GFLOPS on {peak.cores} cores ({peak.library})")
    return peak.gflops


def write_json(path: Path, plan: BenchPlan, rows: list[OpRow], summary: Summary) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"plan": plan.as_dict(), "ops": [r.as_dict() for r in rows], "summary": summary.as_dict()}
    path.write_text(json.dumps(data, indent=1))


def _header(plan: BenchPlan) -> list[str]:
    from tunefarm.target import describe

    return [
        f"tunefarm bench ops: {plan.trials} trials per op and tuner, seed {plan.seed}, {describe(plan.target)}",
        f"work dir {plan.work_dir}",
        "speeds in GFLOPS (GB/s for memory-bound ops); ours/X > 1 means tunefarm is faster",
    ]


# -- one op --------------------------------------------------------------------------------


def bench_op(op: BenchOp, plan: BenchPlan, timer: KernelTimer, log: Log) -> OpRow:
    """Tune `op` with both tuners, run the vendor peers, time both best kernels, score the model."""
    from tunefarm.measure.task_data import write_task_data

    workload = op.workload()
    task_data = Path(write_task_data(plan.work_dir / "data" / f"{op.id}.npz", workload, seed=0))
    ours = _guard("tunefarm", lambda: tune_ours(op, workload, plan, log), log)
    ms = _guard("MetaSchedule", lambda: tune_metaschedule(op, plan, log), log) if plan.metaschedule else None
    numpy_secs, numpy_note = (None, "") if plan.on_gpu else vendor_secs("numpy", op, task_data, plan, log)
    torch_secs, torch_note = vendor_secs("torch", op, task_data, plan, log)
    # The peak is measured right before and right after the final timing, the higher
    # counting (noise only slows a loop down): a shared host's speed drifts over minutes
    # (one run read 216 GFLOPS before tuning and 112 after), so a peak read minutes away
    # from the kernel's timing says little about the kernel's share of it.
    peaks = [_fma_peak(plan, log)]
    ours, ms = time_best_kernels(ours, ms, workload, task_data, timer, log)
    peaks.append(_fma_peak(plan, log))
    held, heldout_notes = _guard_value("held-out accuracy", lambda: _held_out(op, workload, plan, log), log)
    heldout, rolling = held if held is not None else (None, None)
    notes = [*ours.notes, *(ms.notes if ms else ()), numpy_note, torch_note, *heldout_notes]
    return OpRow(
        op=op.id,
        workload=workload.name,
        unit=workload.throughput_unit,
        work=float(workload.moved_bytes if workload.memory_bound else workload.flops),
        ours=ours.run if isinstance(ours.run, OursRun) else None,
        ms=ms.run if ms and isinstance(ms.run, MetaScheduleRun) else None,
        numpy_secs=numpy_secs,
        torch_secs=torch_secs,
        heldout=heldout,
        heldout_rolling=rolling,
        notes=tuple(n for n in notes if n),
        peak_gflops=max((p for p in peaks if p), default=None),
    )


def tune_ours(op: BenchOp, workload: Workload, plan: BenchPlan, log: Log) -> _Tuned:
    from tunefarm.search.config import TuneConfig
    from tunefarm.tune import tune_workload
    from tunefarm_app.apply import build_best, find_best
    from tunefarm_app.report import stop_reason

    records = plan.work_dir / "ours" / f"{op.id}.jsonl"
    log(f"tunefarm: tuning {workload.name}, {plan.trials} trials, records {records}")
    config = TuneConfig(trials=plan.trials, seed=plan.seed)
    result = tune_workload(workload, plan.target, config, records=records, log=log)
    _, state, _ = result.single()
    new = state.trials - state.resumed
    errors = sum(state.errors.values())
    best = state.best
    run = OursRun(
        secs=None,
        recorded_secs=best.cost if best else None,
        trials=new,
        errors=errors,
        wall_secs=result.stats.wall_secs,
        search_secs=result.stats.search_secs,
    )
    notes = []
    if errors:
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(state.errors.items()))
        notes.append(f"ours: {errors} of {state.trials} measurements failed ({kinds})")
    reason = stop_reason(result)
    if reason != "budget":
        notes.append(f"ours: stopped after {state.trials} trials ({reason})")
    if best is None:
        return _Tuned(run, None, (*notes, "ours: no valid kernel"))
    library = build_best(find_best(records), plan.work_dir / "ours" / f"{op.id}{artifact_suffix(plan.target)}")
    return _Tuned(run, library, tuple(notes))


def tune_metaschedule(op: BenchOp, plan: BenchPlan, log: Log) -> _Tuned:
    out_dir = plan.work_dir / "ms"
    log(f"MetaSchedule: tuning, {plan.trials} trials, log {out_dir / (op.id + '.log')}")
    peer = peers.run_metaschedule(
        op, target=plan.target, trials=plan.trials, out_dir=out_dir, seed=plan.seed, threads=plan.cores,
        timeout=plan.ms_timeout,
    )
    if peer.result is None:
        log(f"MetaSchedule: failed: {peer.note}")
        return _Tuned(None, None, (f"MS: {peer.note}",))
    r = peer.result
    run = MetaScheduleRun(
        secs=None,
        recorded_secs=r.get("best_recorded_secs"),
        trials=int(r["trials"]),
        valid_trials=int(r["valid_trials"]),
        tune_secs=float(r["tune_secs"]),
        setup_secs=float(r["setup_secs"]),
    )
    log(
        f"MetaSchedule: {run.trials} trials ({run.trials - run.valid_trials} failed) in {run.tune_secs:.0f} s"
        f" (+ {run.setup_secs:.0f} s start-up)"
    )
    notes = [f"MS: {r['note']}"] if r.get("note") else []
    if run.trials - run.valid_trials:
        notes.append(f"MS: {run.trials - run.valid_trials} of {run.trials} measurements failed")
    if r.get("layout_rewrite"):
        notes.append("MS: best kernel takes a weight in a rewritten layout (timed on the pre-transformed weight)")
    library = Path(r["library"]) if r.get("library") else None
    return _Tuned(run, library, tuple(notes))


def vendor_secs(
    lib: str, op: BenchOp, task_data: Path, plan: BenchPlan, log: Log
) -> tuple[float | None, str]:
    device = "cuda" if plan.on_gpu else "cpu"
    log(f"{lib}: timing on the {device}")
    peer = peers.run_vendor(
        lib, op, task_data=task_data, threads=plan.cores, out_dir=plan.work_dir / lib, device=device
    )
    if peer.result is None:
        return None, f"{lib}: {peer.note}"
    return float(peer.result["median_secs"]), ""


def time_best_kernels(
    ours: _Tuned, ms: _Tuned | None, workload: Workload, task_data: Path, timer: KernelTimer, log: Log
) -> tuple[_Tuned, _Tuned | None]:
    """Time both libraries with the same runner; a wrong or failing kernel gets secs None and a note."""
    kernels = {"ours": ours.library, "MS": ms.library if ms else None}
    present = {name: lib for name, lib in kernels.items() if lib is not None}
    if not present:
        return ours, ms
    log(f"timing the best kernels: {', '.join(present)}")
    timings = timer.time(present, workload, task_data)

    def with_timing(name: str, tuned: _Tuned) -> _Tuned:
        t = timings.get(name)
        if t is None or tuned.run is None:
            return tuned
        notes = tuned.notes + ((f"{name}: best kernel failed the bench timing: {t.note}",) if t.note else ())
        return _Tuned(replace(tuned.run, secs=t.secs), tuned.library, notes)

    return with_timing("ours", ours), with_timing("MS", ms) if ms else None


def _held_out(
    op: BenchOp, workload: Workload, plan: BenchPlan, log: Log
) -> tuple[tuple[HeldOutAccuracy, HeldOutAccuracy], tuple[str, ...]]:
    """The model's k-fold and rolling (round by round, in the tuning's batches: `tune_ours`
    tunes with `TuneConfig`'s batch size) held-out accuracy on this op's records."""
    from tunefarm.search.config import TuneConfig

    records = plan.work_dir / "ours" / f"{op.id}.jsonl"
    acc = held_out_accuracy(records, workload, plan.target, seed=plan.seed)
    rolling = held_out_accuracy(records, workload, plan.target, seed=plan.seed,
                                rolling_batch=TuneConfig(trials=plan.trials).batch_size)  # fmt: skip
    log(
        f"held-out cost model ({FOLDS}-fold over distinct programs): pairwise {acc.pairwise:.3f} over {acc.pairs} "
        f"pairs ({acc.dropped} within the noise dropped), Spearman {acc.spearman:.3f}, on {acc.n_test} "
        f"measurements (trained on {acc.n_train} per fold); rolling (each round ranked by a model of the rounds "
        f"before it): pairwise {rolling.pairwise:.3f} over {rolling.pairs} pairs"
    )
    note = "" if math.isfinite(acc.pairwise) else f"held-out: too few valid measurements ({acc.n_test})"
    return (acc, rolling), (note,) if note else ()


# -- failure containment -------------------------------------------------------------------


def _guard(what: str, step: Callable[[], _Tuned], log: Log) -> _Tuned:
    """Run a tuning step; an exception becomes an empty result with a note."""
    try:
        return step()
    except Exception as exc:
        msg = _first_line(exc)
        log(f"{what}: failed: {msg}")
        return _Tuned(None, None, (f"{what}: failed: {msg}",))


def _guard_value(what: str, step: Callable[[], tuple[T, tuple[str, ...]]], log: Log) -> tuple[T | None, tuple[str, ...]]:
    try:
        return step()
    except Exception as exc:
        msg = _first_line(exc)
        log(f"{what}: failed: {msg}")
        return None, (f"{what}: failed: {msg}",)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:300]
