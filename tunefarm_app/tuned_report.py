"""`tunefarm report DIR [--html]`: what a tuned model directory's `report.json` says, for
a person.

The terminal view (rich) shows the run (target, trials, stop reason, time), per model its
measured latency against TVM's untuned build and onnxruntime, the output check, the
estimated latency at the start and at the end, the per-task table, and a summary of the
task scheduler's rounds. `--html` writes the same as one self-contained HTML file
(inline CSS and SVG, no script, nothing fetched) with the estimated latency over trials
drawn by `tunefarm.display.latency_curve_svg`, the plot the farm's dashboard shows.

The report is read as plain data (`load_report`), validated only as far as this view
needs: a missing file, bad JSON or another report version is a `UsageError`.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunefarm.display import PAGE_CSS, PLOT_CSS, CurveSeries, format_cost, latency_curve_svg, printable
from tunefarm.errors import UsageError
from tunefarm.models.peers import ONNXRUNTIME, OPENVINO, latency_key
from tunefarm.models.timing import round_ratios, speedup

TEMPLATES = Path(__file__).with_name("templates")

PEER_LABELS = {ONNXRUNTIME: "ORT", OPENVINO: "OpenVINO"}
"""The peers a report shows, with their short label in the terminal."""


def load_report(path: Path) -> tuple[Path, dict[str, Any]]:
    """The report of a tuned model directory (or the report file itself): its path and data."""
    from tunefarm.models.finish import REPORT_NAME, REPORT_VERSION

    file = path / REPORT_NAME if path.is_dir() else path
    if not file.is_file():
        raise UsageError(f"no {REPORT_NAME} in {path} (a directory written by `tunefarm tune` or `tunefarm fetch`)")
    try:
        report = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"{file}: not a readable JSON report ({exc})") from None
    if not isinstance(report, dict) or report.get("version") != REPORT_VERSION or not isinstance(report.get("models"), list):
        found = report.get("version") if isinstance(report, dict) else None
        raise UsageError(f"{file}: not a tunefarm report of version {REPORT_VERSION} (version {found!r})")
    return file, report


# -- what both views show -----------------------------------------------------------------------


@dataclass(frozen=True)
class TaskLine:
    name: str
    shapes: str
    weight: int
    trials: int
    best_secs: float | None
    gflops: float | None
    share: float | None  # of the model's estimated latency
    tuned: bool
    errors: int
    errors_text: str
    note: str  # why the search stopped giving it trials, or why it kept the default build


def task_lines(model: Mapping[str, Any]) -> list[TaskLine]:
    total = sum(t["weighted_seconds"] or 0.0 for t in model["tasks"]) or None
    out = []
    for t in model["tasks"]:
        errors = t.get("errors") or {}
        tuned = t["schedule"] == "tuned"
        out.append(
            TaskLine(
                name=t["name"],
                shapes=t["shapes"],
                weight=t["weight"],
                trials=t["trials"],
                best_secs=t["best_seconds"],
                gflops=t["gflops"],
                share=(t["weighted_seconds"] / total) if total and t["weighted_seconds"] is not None else None,
                tuned=tuned,
                errors=sum(errors.values()),
                errors_text=", ".join(f"{k} {v}" for k, v in sorted(errors.items())),
                note="; ".join(n for n in (t["dead_reason"] or ("" if tuned else t["schedule"]),
                                           algorithm_note(t)) if n),
            )
        )
    return out


def algorithm_note(task: Mapping[str, Any]) -> str:
    """For a task with alternatives (a convolution Winograd can compute): the algorithm its
    model computes it by, and the others' best times, e.g. "winograd4 (direct 0.21 ms,
    winograd2 0.15 ms)"; "" for a task without."""
    alternatives = task.get("alternatives") or []
    if not alternatives:
        return ""
    others = ", ".join(f"{a['algorithm']} {format_cost(a['best_seconds'])}" for a in alternatives if not a["chosen"])
    return f"{task.get('algorithm', 'direct')} ({others})"


def breakdown_lines(model: Mapping[str, Any], top: int = 12) -> list[str]:
    """Where the tuned model's time goes (the report's `breakdown` and each task's
    `in_model` row): the latency against its kernel calls, then the tasks that take most
    of it with what holds each back. Empty when the report has no breakdown."""
    b = model.get("breakdown")
    if not b:
        return []
    outside = max(0.0, b["latency"] - b["kernel_seconds"])
    lines = [
        f"in the model ({b['threads']} threads): {format_cost(b['latency'])} = {format_cost(b['kernel_seconds'])} in "
        f"{b['kernel_calls']} kernel calls{_warm_note(b)} + {format_cost(outside)} outside them "
        f"({format_cost(b['overhead_per_call'])} per call; {b['builtin_calls']} VM builtin calls); "
        f"copy bandwidth {b['copy_bandwidth'] / 1e9:.1f} GB/s from memory, "
        f"{b.get('cached_copy_bandwidth', 0.0) / 1e9:.1f} GB/s from cache"
    ]
    rows = [(t["name"], t["in_model"]) for t in model["tasks"] if t.get("in_model")]
    rows.sort(key=lambda r: -r[1]["seconds"])
    for name, r in rows[:top]:
        share = f"{r['share']:.1%}" if r.get("share") is not None else "--"
        lines.append(f"  {share:>6}  {format_cost(r['seconds']):>9}  x{r['calls']}  {name}: {'; '.join(r['holds_back'])}")
    if len(rows) > top:
        lines.append(f"  ({len(rows) - top} more tasks)")
    return lines


def _warm_note(breakdown: Mapping[str, Any]) -> str:
    """The kernels' time with each one's data in cache, for the breakdown's first line
    (empty for a report made before it was measured)."""
    warm = breakdown.get("warm_kernel_seconds")
    return f" ({format_cost(warm)} with each kernel's data in cache)" if warm else ""


def curve_points(report: Mapping[str, Any], model_name: str) -> list[tuple[float, float]]:
    """(trials, estimated seconds) of `model_name` after each round whose estimate covers
    every task (the same rule as the report's `estimated_seconds_at_start`)."""
    return [
        (p["trials"], p["estimated_seconds"][model_name])
        for p in report.get("timeline", ())
        if not p["unknown_tasks"] and p["estimated_seconds"].get(model_name) is not None
    ]


def rounds_summary(report: Mapping[str, Any]) -> tuple[int, list[tuple[str, int]], list[tuple[str, int]]]:
    """Rounds in all, rounds per task (most first), rounds per reason."""
    rounds = report.get("task_scheduler", {}).get("rounds", [])
    per_task = Counter(r["task_name"] for r in rounds).most_common()
    per_reason = Counter(r["reason"] for r in rounds).most_common()
    return len(rounds), per_task, per_reason


def latency_text(lat: Mapping[str, Any]) -> str:
    """'40.1 us mean, 39.8 us p50, 41.0 us p90, 55.2 us p99 (1000 runs, 2 threads)'; a
    report of an older version has only the median and p90."""
    parts = [f"{format_cost(lat[k])} {label}" for k, label in
             (("mean", "mean"), ("median", "p50"), ("p90", "p90"), ("p99", "p99")) if lat.get(k) is not None]
    extra = [f"{lat['runs']} runs" if lat.get("runs") else "", f"{lat['threads']} threads" if lat.get("threads") else ""]
    extra = [e for e in extra if e]
    return ", ".join(parts) + (f" ({', '.join(extra)})" if extra else "")


def peer_lines(result: Mapping[str, Any], where: str = "") -> list[str]:
    """A farm job's peers as timed beside its tuned model (`where`: " on <agent>"), and the
    peers its agent could not time, with why."""
    lines = []
    notes = result.get("peer_notes") or {}
    for peer, short in PEER_LABELS.items():
        theirs = result.get(latency_key(peer))
        if theirs:
            lines.append(f"{short:<10} {latency_text(theirs)}{where}, same input and threads")
        elif notes.get(peer):
            lines.append(f"{short:<10} not timed{where}: {printable(str(notes[peer]))}")
    return lines


ROUNDS_DISAGREE = 1.25
"""The spread of the rounds' ratios (the highest over the lowest) from which a comparison
with a peer is called noisy: the same builds read 0.68x and 1.19x OpenVINO in two rounds
of one run on a busy machine, and 1.06-1.11x on a quiet one."""


def rounds_disagree(per_round: list[float]) -> bool:
    """Whether the alternating rounds' ratios spread by `ROUNDS_DISAGREE` or more."""
    return len(per_round) > 1 and min(per_round) > 0 and max(per_round) / min(per_round) >= ROUNDS_DISAGREE


def latency_lines(model: Mapping[str, Any]) -> list[str]:
    """The tuned model's latency, the peers' (onnxruntime, OpenVINO) and TVM's untuned
    build's, and the ratios."""
    lat = model.get("latency")
    if not lat:
        return []
    lines = [f"latency    {latency_text(lat)}"]
    for peer, short in PEER_LABELS.items():
        theirs = model.get(latency_key(peer))
        if not theirs:
            continue
        lines.append(f"{short:<10} {latency_text(theirs)}")
        x = speedup(theirs, lat)
        if x is not None:
            per_round = round_ratios(theirs, lat)
            if per_round:
                text = (f"{'vs ' + short:<10} {x:.2f}x the speed of {peer} (median over {len(per_round)} alternating"
                        f" rounds of their p50s, {min(per_round):.2f}-{max(per_round):.2f}x; same input and threads")
            else:
                text = f"{'vs ' + short:<10} {x:.2f}x the speed of {peer} (p50, same input and threads"
            lines.append(text + ")")
            if rounds_disagree(per_round):
                lines.append(f"{'':<10} the rounds disagree ({min(per_round):.2f}-{max(per_round):.2f}x): the machine's"
                             f" speed changed while timing; time it again on a quiet machine (`tunefarm run`)")  # fmt: skip
    x = speedup(model.get("untuned_latency"), lat)
    if x is not None:
        lines.append(f"vs untuned {x:.2f}x the speed of TVM's untuned build ({format_cost(model['untuned_latency']['median'])} p50)")
    notes = model.get("peer_notes") or {}
    lines += [f"{short:<10} not timed: {printable(str(notes[peer]))}" for peer, short in PEER_LABELS.items() if notes.get(peer)]
    return lines


def check_lines(check: Mapping[str, Any]) -> list[str]:
    """The output check: verdict and tolerance, then per input kind and output its
    errors (a report of an older version: one line)."""
    if check.get("ok") is None:
        return [f"check      not done: {check.get('problem', 'unknown')}"]
    verdict = "matches" if check["ok"] else "DOES NOT match"
    rows = check.get("outputs")
    tol = check.get("tolerance")
    if not rows or not tol:
        return [f"check      {verdict} {check.get('reference', 'the reference')} (max abs error {check['max_abs_error']:.2g})"]
    kinds = tol.get("inputs", {})
    lines = [
        f"check      {verdict} {check.get('reference', 'the reference')} on {len(kinds)} input kinds; "
        f"tolerance |out - ref| <= {tol['atol_of_scale']:g} x max|ref| + {tol['rtol']:g} x |ref| per element"
        + (f" ({tol['precision']}: float16's rounding)" if tol.get("precision") else "")
    ]
    for r in rows:
        if r.get("problem"):
            lines.append(f"  {r['input']:<8} {r['output']}: {r['problem']}")
            continue
        text = (f"  {r['input']:<8} {r['output']}: max abs error {r['max_abs_error']:.2g}, "
                f"max rel error {r['max_rel_error']:.2g} (of max|ref| {r['scale']:.3g})")
        if r["mismatched"]:
            text += f"; {r['mismatched']} of {r['elements']} elements differ"
            if r.get("worst"):
                w = r["worst"]
                text += f", worst at {w['index']}: {w['got']:.6g} vs {w['reference']:.6g}"
        if r.get("exact_error") is not None:
            verdict = "summation noise (accepted)" if r["within_noise"] else "beyond noise"
            text += (f"; vs float64 {r['exact_error']:.2g}, {check.get('reference', 'the reference')}'s own"
                     f" {r['reference_noise']:.2g}: {verdict}")
        lines.append(text)
    for name, desc in kinds.items():
        lines.append(f"  {name:<8} = {desc}")
    if tol.get("noise_rule") and any(r.get("exact_error") is not None for r in rows):
        lines.append(f"  noise    = {tol['noise_rule']} ({check.get('exact_reference', 'float64')})")
    suspects = check.get("suspects")
    if suspects:
        named = ", ".join(suspects["tasks"]) or "no task"
        lines.append(f"suspect    {named}: {suspects['reason']}")
    if check.get("kept_library"):
        lines.append(f"kept       {check['kept_library']} (the failed model, for inspection; not the tuned model)")
    return lines


# -- the terminal -----------------------------------------------------------------------------


def cost_model_line(start: Mapping[str, Any]) -> str:
    """Which cost model a run started from (`CostModelStart.as_report`), as a summary line."""
    return f"cost model {start['start']}" + (f" ({start['file']})" if start.get("file") else "")


def print_report(report: Mapping[str, Any], file: Path, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(highlight=False)
    p = console.print
    target = report["target"]
    target_text = target if isinstance(target, str) else json.dumps(target)
    p(f"[bold]report[/bold]     {file}")
    p(f"target     {target_text}", markup=False)
    if report.get("conv_layout"):
        layout = "NHWC" if report["conv_layout"] == "nhwc" else "the model's own layout"
        p(f"layout     convolutions in {layout}")
    p(f"trials     {report['trials']} of {report['trials_budget']} ({report['resumed_trials']} resumed); "
      f"stopped: {report['stop_reason']}")
    share = report.get("search_share")
    p(f"time       {report['tuning_seconds']:.0f} s tuning ({report['wall_seconds']:.0f} s in all), "
      f"search {share or 0:.0%}, {report['seconds_per_trial']:.2f} s per trial")
    if report.get("cost_model"):  # reports before the pretrained model have none
        p(cost_model_line(report["cost_model"]), markup=False)
    for m in report["models"]:
        p()
        p(f"[bold]model      {m['name']}[/bold]")
        if m.get("error"):
            p(f"error      {m['error']}", style="red", markup=False)
        for line in latency_lines(m):
            p(line, markup=False)
        check = m.get("check")
        if check:
            for line in check_lines(check):
                p(line, style="red" if check.get("ok") is False else None, markup=False)
        p(f"estimate   {format_cost(m['estimated_seconds'])} now, {format_cost(m['estimated_seconds_at_start'])} "
          "at the start (sum of weighted task bests)")
        lines = task_lines(m)
        columns = [("#", "right"), ("task", "left"), ("weight", "right"), ("trials", "right"), ("best", "right"),
                   ("GFLOPS", "right"), ("share", "right"), ("tuned", "left")]
        has_errors, has_notes = any(t.errors for t in lines), any(t.note for t in lines)
        columns += [("errors", "right")] * has_errors + [("note", "left")] * has_notes
        table = Table(show_edge=False, pad_edge=False, box=None, header_style="bold")
        for col, justify in columns:
            table.add_column(col, justify=justify, no_wrap=True)
        # the task's name gives way on a narrow terminal (the other columns take ~60)
        room = max(20, console.width - 60 - 8 * has_errors - 16 * has_notes)
        for i, t in enumerate(lines):
            cells = [
                str(i), t.name if len(t.name) <= room else t.name[: room - 1] + "…", str(t.weight), str(t.trials), format_cost(t.best_secs),
                f"{t.gflops:.1f}" if t.gflops else "--", f"{t.share:.0%}" if t.share is not None else "--",
                "yes" if t.tuned else "[yellow]no[/yellow]",
            ]
            cells += [str(t.errors) if t.errors else ""] * has_errors + [t.note] * has_notes
            table.add_row(*cells)
        p(table)
        for line in breakdown_lines(m):
            p(line, markup=False)
    total, per_task, per_reason = rounds_summary(report)
    p()
    p(f"[bold]rounds[/bold]     {total} ({report.get('task_scheduler', {}).get('strategy', '?')} task scheduler): "
      + ", ".join(f"{reason} {n}" for reason, n in per_reason))
    for name, n in per_task[:8]:
        p(f"  {n:>4}  {name}", markup=False)
    if len(per_task) > 8:
        p(f"  ({len(per_task) - 8} more tasks)")


# -- HTML -------------------------------------------------------------------------------------


def html_report(report: Mapping[str, Any], file: Path) -> str:
    """The report as one self-contained HTML page."""
    from jinja2 import Environment, FileSystemLoader, select_autoescape

    env = Environment(loader=FileSystemLoader(TEMPLATES), autoescape=select_autoescape(["html"]))
    env.filters["cost"] = format_cost
    models = [
        {
            "data": m,
            "tasks": task_lines(m),
            "plot": latency_curve_svg([CurveSeries(m["name"], curve_points(report, m["name"]))],
                                      title=f"{m['name']}: estimated latency"),
            "vs_untuned": speedup(m.get("untuned_latency"), m.get("latency")),
            "latency": latency_text(m["latency"]) if m.get("latency") else "",
            "peers": [
                {"name": peer, "latency": latency_text(m[latency_key(peer)]), "median": m[latency_key(peer)]["median"],
                 "speedup": speedup(m[latency_key(peer)], m.get("latency"))}
                for peer in PEER_LABELS if m.get(latency_key(peer))
            ],
            "check": [line.strip() for line in check_lines(m["check"])] if m.get("check") else [],
        }
        for m in report["models"]
    ]
    total, per_task, per_reason = rounds_summary(report)
    target = report["target"]
    return env.get_template("report.html").render(
        report=report,
        file=str(file),
        target=target if isinstance(target, str) else json.dumps(target),
        models=models,
        rounds_total=total,
        rounds_per_task=per_task,
        rounds_per_reason=per_reason,
        css=PAGE_CSS + PLOT_CSS,
    )
