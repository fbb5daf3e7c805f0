"""The `--json` report and the closing summary of a single-operator run (`tune-op`)."""

from __future__ import annotations

from typing import Any

from tunefarm.search.run import TaskOutcome
from tunefarm.search.task import SearchTask
from tunefarm.tune import TuneResult
from tunefarm_app.tuned_report import cost_model_line


def report_dict(result: TuneResult) -> dict[str, Any]:
    task, state, outcome = result.single()
    wl = task.workload
    best = state.best
    best_secs = best.cost if best else None
    stats = result.stats
    n = state.trials
    new = n - state.resumed
    return {
        "workload": wl.name,
        "task": task.key,
        "target": task.target,
        "flops": wl.flops,
        "memory_bound": wl.memory_bound,
        "trials": n,
        "resumed_trials": state.resumed,
        "invalid_programs": state.invalid,
        "errors": dict(state.errors),
        "best_seconds": best_secs,
        "gflops": wl.flops / best_secs / 1e9 if best_secs else None,
        "gbytes_per_second": wl.moved_bytes / best_secs / 1e9 if best_secs else None,
        "throughput_unit": wl.throughput_unit,
        "wall_seconds": round(stats.wall_secs, 3),
        "search_seconds": round(stats.search_secs, 3),
        "train_seconds": round(stats.train_secs, 3),
        "measure_seconds": round(stats.measure_secs, 3),
        "build_cpu_seconds": round(sum(r.build_secs for r in state.records[state.resumed :]), 3),
        "seconds_per_trial": round(stats.wall_secs / max(1, new), 4),
        "search_share": round(stats.search_secs / stats.wall_secs, 4) if stats.wall_secs else None,
        "stop_reason": stop_reason(result),
        "cost_model": result.cost_model.as_report() if result.cost_model else None,
        "curve": [[t, s] for t, s in state.curve],
        "rounds": state.rounds,
        "best_schedule": best_schedule(task, outcome),
        "verified": bool(best and best.verified),
        "reference_available": outcome.verify_available,
    }


def best_schedule(task: SearchTask, outcome: TaskOutcome) -> dict[str, Any] | None:
    """The best program: its sketch, decisions, our instructions and the TVM trace."""
    best = outcome.best
    if best is None:
        return None
    sketch_ok = 0 <= best.sketch < len(task.sketches) and task.sketch_signature(best.sketch) == best.sketch_sig
    instructions = None
    if sketch_ok:
        built = task.space.rebuild(best.candidate)
        instructions = [ins.describe() for ins in built.program.instructions] if built is not None else None
    return {
        "sketch": best.sketch,
        "sketch_steps": task.sketches[best.sketch].describe() if sketch_ok else None,
        "decisions": {k: list(v) if isinstance(v, tuple) else v for k, v in best.decisions},
        "instructions": instructions,
        "tvm_trace": best.trace,
    }


def stop_reason(result: TuneResult) -> str:
    """Why the run ended: the budget, or why its (only) task stopped getting rounds."""
    if result.stats.stop_reason == "budget":
        return "budget"
    reasons = sorted({o.dead_reason for o in result.outcomes if o.dead_reason})
    if reasons == ["exhausted"]:
        return "search space exhausted"
    if reasons == ["early-stopped"]:
        return "early stopping"
    return ", ".join(reasons) or result.stats.stop_reason


def summary_lines(result: TuneResult) -> list[str]:
    task, state, outcome = result.single()
    wl = task.workload
    best = state.best
    stats = result.stats
    lines = [f"workload   {wl.name}"]
    if best is None:
        lines.append("best       no valid kernel was measured")
    else:
        check = "yes" if best.verified else "no"
        if not outcome.verify_available:
            check += " (no reference: kernels checked against each other)"
        lines.append(
            f"best       {best.cost * 1e3:.4f} ms  {wl.throughput(best.cost):.2f} {wl.throughput_unit}"
            f"  (verified: {check})"
        )
    n = state.trials - state.resumed
    errs = ", ".join(f"{k} {v}" for k, v in sorted(state.errors.items())) or "none"
    lines.append(f"trials     {state.trials} ({n} this run, {state.resumed} resumed); errors: {errs}")
    reason = stop_reason(result)
    if reason != "budget":
        lines.append(f"stopped    before the trial budget: {reason}")
    if stats.wall_secs:
        share = stats.search_secs / stats.wall_secs
        lines.append(
            f"time       {stats.wall_secs:.1f} s wall = search {stats.search_secs:.1f} s ({share:.0%})"
            f" + build and measure {stats.measure_secs:.1f} s; {stats.wall_secs / max(1, n):.2f} s per trial"
        )
    lines.append(f"invalid    {state.invalid} sampled programs rejected before measurement")
    if result.cost_model is not None:
        lines.append(cost_model_line(result.cost_model.as_report()))
    return lines

