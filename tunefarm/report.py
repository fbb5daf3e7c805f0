"""The `--json` report of a tuning run."""

from __future__ import annotations

import math
from typing import Any

from services.scheduler.tuner import TuneResult


def report_dict(result: TuneResult) -> dict[str, Any]:
    task = result.task
    wl = task.workload
    best = result.best
    best_secs = best.cost if best else None
    schedule = None
    if best is not None:
        sketch_ok = 0 <= best.sketch < len(task.sketches) and task.sketch_signature(best.sketch) == best.sketch_sig
        schedule = {
            "sketch": best.sketch,
            "sketch_steps": task.sketches[best.sketch].describe() if sketch_ok else None,
            "decisions": {k: list(v) if isinstance(v, tuple) else v for k, v in best.decisions},
            "instructions": _instructions(result, best) if sketch_ok else None,
            "tvm_trace": best.trace,
        }
    n = len(result.records)
    return {
        "workload": wl.name,
        "task": task.key,
        "target": task.target,
        "flops": wl.flops,
        "memory_bound": wl.memory_bound,
        "trials": n,
        "resumed_trials": result.resumed,
        "invalid_programs": result.invalid,
        "errors": dict(result.errors),
        "best_seconds": best_secs,
        "gflops": wl.flops / best_secs / 1e9 if best_secs else None,
        "gbytes_per_second": wl.moved_bytes / best_secs / 1e9 if best_secs else None,
        "throughput_unit": wl.throughput_unit,
        "wall_seconds": round(result.wall_secs, 3),
        "search_seconds": round(result.search_secs, 3),
        "build_seconds": round(result.build_secs, 3),
        "measure_seconds": round(result.measure_secs, 3),
        "seconds_per_trial": round(result.wall_secs / max(1, n - result.resumed), 4),
        "search_share": round(result.search_secs / result.wall_secs, 4) if result.wall_secs else None,
        "stop_reason": result.stop_reason,
        "curve": [[t, s] for t, s in result.curve],
        "rounds": result.rounds,
        "best_schedule": schedule,
        "verified": bool(best and best.verified),
        "reference_available": result.verify_available,
    }


def _instructions(result: TuneResult, best) -> list[str] | None:
    built = result.task.space.rebuild(best.candidate)
    if built is None:
        return None
    return [ins.describe() for ins in built.program.instructions]


def summary_lines(result: TuneResult) -> list[str]:
    task = result.task
    wl = task.workload
    best = result.best
    lines = [f"workload   {wl.name}"]
    if best is None:
        lines.append("best       no valid kernel was measured")
    else:
        lines.append(
            f"best       {best.cost * 1e3:.4f} ms  {wl.throughput(best.cost):.2f} {wl.throughput_unit}"
            f"  (verified: {'yes' if best.verified else 'no'})"
        )
    n = len(result.records) - result.resumed
    errs = ", ".join(f"{k} {v}" for k, v in sorted(result.errors.items())) or "none"
    lines.append(f"trials     {len(result.records)} ({n} this run, {result.resumed} resumed); errors: {errs}")
    if result.stop_reason != "budget":
        lines.append(f"stopped    before the trial budget: {result.stop_reason}")
    if result.wall_secs:
        share = result.search_secs / result.wall_secs
        lines.append(
            f"time       {result.wall_secs:.1f} s wall = search {result.search_secs:.1f} s ({share:.0%})"
            f" + build {result.build_secs:.1f} s + measure {result.measure_secs:.1f} s"
            f"; {result.wall_secs / max(1, n):.2f} s per trial"
        )
    if not math.isnan(result.invalid):
        lines.append(f"invalid    {result.invalid} sampled programs rejected before measurement")
    return lines
