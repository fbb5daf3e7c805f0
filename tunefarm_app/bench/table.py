"""Plain-text rendering of the bench results: the per-op table, the notes, the summary and
the targets. Missing numbers print as "n/a"; the notes say why."""

from __future__ import annotations

import math
from collections.abc import Callable

from tunefarm_app.bench.results import TARGET_TRIALS, OpRow, Summary

NA = "n/a"


def _num(value: float | None, fmt: str) -> str:
    return format(value, fmt) if value is not None and math.isfinite(value) else NA


def _ratio(value: float | None) -> str:
    return _num(value, ".2f") + "x" if value is not None and math.isfinite(value) else NA


def _pct(value: float | None) -> str:
    return _num(value, ".0%")


COLUMNS: tuple[tuple[str, Callable[[OpRow], str]], ...] = (
    ("op", lambda r: r.op),
    ("unit", lambda r: r.unit),
    ("ours", lambda r: _num(r.throughput(r.ours_secs), ".1f")),
    ("MS", lambda r: _num(r.throughput(r.ms_secs), ".1f")),
    ("numpy", lambda r: _num(r.throughput(r.numpy_secs), ".1f")),
    ("torch", lambda r: _num(r.throughput(r.torch_secs), ".1f")),
    ("ours/MS", lambda r: _ratio(r.ratio(r.ms_secs))),
    ("ours/np", lambda r: _ratio(r.ratio(r.numpy_secs))),
    ("ours/torch", lambda r: _ratio(r.ratio(r.torch_secs))),
    ("ours/vendor", lambda r: _ratio(r.ratio(r.vendor_secs))),
    ("%peak", lambda r: _pct(r.peak_share(r.ours_secs))),
    ("MS %peak", lambda r: _pct(r.peak_share(r.ms_secs))),
    ("s/trial", lambda r: _num(r.ours.secs_per_trial if r.ours else None, ".2f")),
    ("MS s/trial", lambda r: _num(r.ms.secs_per_trial if r.ms else None, ".2f")),
    ("search", lambda r: _pct(r.ours.search_share if r.ours else None)),
    ("pairwise", lambda r: _num(r.heldout.pairwise if r.heldout else None, ".2f")),
    ("rho", lambda r: _num(r.heldout.spearman if r.heldout else None, ".2f")),
    ("rolling", lambda r: _num(r.heldout_rolling.pairwise if r.heldout_rolling else None, ".2f")),
)
"""Header and cell of each column, left to right."""


def render_table(rows: list[OpRow]) -> list[str]:
    cells = [[name for name, _ in COLUMNS]] + [[cell(r) for _, cell in COLUMNS] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    lines = []
    for k, line in enumerate(cells):
        parts = [
            c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths, strict=True))
        ]
        lines.append("  ".join(parts).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def render_notes(rows: list[OpRow]) -> list[str]:
    notes = [f"  {r.op}: {n}" for r in rows for n in r.notes]
    return ["notes:", *notes, ""] if notes else []


def render_summary(summary: Summary, trials: int) -> list[str]:
    s = summary
    min_op = f" ({s.min_vs_ms_op})" if s.min_vs_ms_op else ""
    lines = [
        "summary:",
        f"  geomean ours/MS          {_ratio(s.geomean_vs_ms)}",
        f"  min ours/MS              {_ratio(s.min_vs_ms)}{min_op}",
        f"  GEMM 1024 ours/numpy     {_ratio(s.gemm_vs_numpy)}",
        f"  mean search share        {_pct(s.mean_search_share)}",
        f"  wall s/trial ours / MS   {_num(s.ours_secs_per_trial, '.2f')} / {_num(s.ms_secs_per_trial, '.2f')}"
        f" = {_ratio(s.per_trial_ratio)}"
        f" (MS start-up not counted: {_num(s.ms_setup_secs, '.0f')} s in all)",
        f"  geomean ours/best vendor {_ratio(s.geomean_vs_vendor)}",
        f"  min ours/best vendor     {_ratio(s.min_vs_vendor)}{f' ({s.min_vs_vendor_op})' if s.min_vs_vendor_op else ''}",
        f"  conv ours/torch (min)    {_ratio(s.conv_vs_torch)}",
        f"  GEMM 1024 share of peak  {_pct(s.gemm_peak_share)} (FMA peak measured: {_num(s.peak_gflops, '.0f')} GFLOPS)",
        f"  lowest share of peak     {_pct(s.min_peak_share)}{f' ({s.min_peak_share_op})' if s.min_peak_share_op else ''}"
        " (GEMM 1024, conv 3x3 and 1x1 in NHWC)",
        f"  held-out pairwise acc.   {_num(s.mean_heldout_pairwise, '.3f')} (mean over ops, 5-fold in random"
        f" order over distinct programs, pairs within the measurement noise dropped: {s.heldout_pairs_dropped} of"
        f" {s.heldout_pairs_dropped + s.heldout_pairs}; Spearman {_num(s.mean_heldout_spearman, '.2f')};"
        f" recall@8 {_num(s.mean_heldout_recall, '.2f')})",
        f"  rolling pairwise acc.    {_num(s.mean_rolling_pairwise, '.3f')} (each round of the search ranked by a"
        f" model trained on the rounds before it: what the search sees)",
        f"targets (set for {TARGET_TRIALS} trials; this run: {trials}):",
    ]
    width = max(len(t.name) for t in s.targets) if s.targets else 0
    for t in s.targets:
        lines.append(f"  {t.status:<4}  {t.name.ljust(width)}  ({_target_value(t.name, t.value)})")
    return lines


def _target_value(name: str, value: float | None) -> str:
    if value is None:
        return NA
    return _pct(value) if "search" in name or "peak" in name else _ratio(value)


def render(rows: list[OpRow], summary: Summary, *, trials: int, header: list[str]) -> str:
    return "\n".join(
        [*header, "", *render_table(rows), "", *render_notes(rows), *render_summary(summary, trials)]
    )
