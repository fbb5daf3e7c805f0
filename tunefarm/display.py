"""How numbers are shown to people: latencies and durations as short text, and latencies
over trials as an SVG plot (one series, or several overlaid with a legend); and text a
peer sent, made safe to print (`printable`).

One rendering for every view: the terminal (`tunefarm tune`, `submit --follow`,
`tunefarm report`), the dashboard the farm's API serves and the HTML report of a tuned
model directory all use these functions, so the same curve looks the same everywhere.
The SVG is plain markup (no script, no external resource): it can be inlined into a
server-rendered page or a self-contained HTML file.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape


def printable(text: str, limit: int = 500) -> str:
    """`text` safe to print to a terminal or a log: control characters (an ANSI escape
    that would rewrite the screen, a newline that would forge a log line) are shown
    escaped, and it is cut at `limit` characters. For what a peer sent (a server's
    message to an agent, an agent's capabilities)."""
    out = "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text[:limit])
    return out + ("..." if len(text) > limit else "")


def format_duration(secs: float | None) -> str:
    if secs is None or not math.isfinite(secs):
        return "--"
    secs = int(round(secs))
    if secs < 60:
        return f"{secs}s"
    if secs < 3600:
        return f"{secs // 60}m{secs % 60:02d}s"
    return f"{secs // 3600}h{(secs % 3600) // 60:02d}m"


def format_cost(secs: float | None) -> str:
    if secs is None or not math.isfinite(secs):
        return "--"
    if secs < 1e-3:
        return f"{secs * 1e6:.1f} us"
    if secs < 1:
        return f"{secs * 1e3:.3f} ms"
    return f"{secs:.3f} s"


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About `count` round values (1, 2 or 5 times a power of ten apart) covering [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo]
    raw = (hi - lo) / max(1, count - 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    ticks = []
    v = first
    while v <= hi + step * 1e-9:
        ticks.append(round(v, 12))
        v += step
    return ticks


@dataclass(frozen=True)
class CurveSeries:
    """One line of a latency plot: (trials, seconds) `points`, in any order (a point
    without a finite positive latency is left out), named `label` in the legend."""

    label: str
    points: Sequence[tuple[float, float | None]]

    def kept(self) -> list[tuple[float, float]]:
        return sorted((float(t), float(s)) for t, s in self.points if s is not None and math.isfinite(s) and s > 0)


SERIES_STYLES = 8
"""Series get styles `series-0` .. `series-7` (a colour and a dash each, PLOT_CSS), then again."""

LEGEND_LINE = 18
"""Height of one legend entry in the viewBox; the legend is one entry a line."""


def latency_curve_svg(
    series: Sequence[CurveSeries],
    *,
    width: int = 720,
    height: int = 300,
    target_secs: float | None = None,
    title: str = "estimated latency",
    empty: str = "no estimate yet",
) -> str:
    """Latencies (seconds) over trials as an SVG step plot: one line per series, each in
    its own colour and dash, on the same axes; with more than one series, a legend under
    the plot names each (one entry a line).

    The SVG scales to its container's width (`width="100%"`; a `viewBox` of `width` by
    `height` and the legend's lines). Each kept point is a `<circle class="point">` in its
    series' `<g class="series" data-label=... data-points=...>`; the root element carries
    the count of them all in `data-points` and the number of series in `data-series`.
    With no point at all, a frame that says `empty`."""
    kept = [(s.label, s.kept()) for s in series]
    legend = [label for label, _ in kept] if len(kept) > 1 else []
    left, right, top, bottom = 84, 16, 28, 40
    pw, ph = width - left - right, height - top - bottom
    full_height = height + (LEGEND_LINE * len(legend) + 6 if legend else 0)
    n_points = sum(len(pts) for _, pts in kept)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="curve" width="100%" viewBox="0 0 {width} {full_height}" '
        f'role="img" aria-label="{escape(title)}" data-points="{n_points}" data-series="{len(kept)}">',
        f'<text x="{left}" y="18" class="title">{escape(title)}</text>',
        f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" class="frame"/>',
    ]
    if n_points:
        latencies = [s for _, pts in kept for _, s in pts] + ([target_secs] if target_secs else [])
        y_lo, y_hi = _latency_range(latencies)
        x_hi = max(pts[-1][0] for _, pts in kept if pts)
        frame = _PlotFrame(left, top, pw, ph, x_hi=max(x_hi, 1.0), y_lo=y_lo, y_hi=y_hi)
        out += _axis_ticks(frame)
        out.append(f'<text x="{left + pw / 2}" y="{height - 6}" text-anchor="middle" class="axis">trials</text>')
        if target_secs:
            out += _target_line(frame, target_secs)
        for i, (label, pts) in enumerate(kept):
            out += _series(frame, i, label, pts)
    else:
        out.append(f'<text x="{left + pw / 2}" y="{top + ph / 2}" text-anchor="middle" class="empty">'
                   f"{escape(empty)}</text>")
    out += _legend(legend, x=left, y=height + 6)
    out.append("</svg>")
    return "\n".join(out)


@dataclass(frozen=True)
class _PlotFrame:
    """Where a plot's frame lies in the SVG (pixels) and what it shows: trials from 0 to
    `x_hi` across, seconds from `y_lo` to `y_hi` up."""

    left: int
    top: int
    width: int
    height: int
    x_hi: float
    y_lo: float
    y_hi: float

    def x_of(self, t: float) -> float:
        return self.left + self.width * t / self.x_hi

    def y_of(self, s: float) -> float:
        return self.top + self.height * (1 - (s - self.y_lo) / (self.y_hi - self.y_lo))


def _latency_range(latencies: Sequence[float]) -> tuple[float, float]:
    """The seconds a plot of `latencies` spans: their range padded by a tenth of it (of the
    highest, when all are equal), from 0 when it would start below 30% of its top."""
    y_lo, y_hi = min(latencies), max(latencies)
    pad = (y_hi - y_lo) * 0.1 or y_hi * 0.1
    y_lo = 0.0 if y_lo - pad < y_hi * 0.3 else y_lo - pad
    return y_lo, y_hi + pad


def _axis_ticks(frame: _PlotFrame) -> list[str]:
    """Grid lines labelled with their latency up the left, trial counts along the bottom."""
    left, pw = frame.left, frame.width
    out = []
    for v in nice_ticks(frame.y_lo, frame.y_hi):
        if frame.y_lo <= v <= frame.y_hi:
            y = frame.y_of(v)
            out.append(f'<line x1="{left}" x2="{left + pw}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>')
            out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end" class="tick">{format_cost(v)}</text>')
    for v in nice_ticks(0.0, frame.x_hi):
        if 0 <= v <= frame.x_hi:
            x = frame.x_of(v)
            out.append(f'<text x="{x:.1f}" y="{frame.top + frame.height + 16}" text-anchor="middle" class="tick">{v:g}</text>')
    return out


def _series_style(i: int) -> str:
    return f"series-{i % SERIES_STYLES}"


def _series(frame: _PlotFrame, i: int, label: str, pts: Sequence[tuple[float, float]]) -> list[str]:
    """Series `i`'s step line and points (none when it has none), in its style."""
    out = [f'<g class="series {_series_style(i)}" data-label="{escape(label)}" data-points="{len(pts)}">']
    if pts:
        out += _step_line(frame, pts)
    out.append("</g>")
    return out


def _legend(labels: Sequence[str], *, x: int, y: int) -> list[str]:
    """One entry a line from `y` down: a stretch of the series' line, then its label."""
    if not labels:
        return []
    out = ['<g class="legend">']
    for i, label in enumerate(labels):
        mid = y + LEGEND_LINE * i + LEGEND_LINE / 2
        out.append(
            f'<g class="legend-item {_series_style(i)}" data-label="{escape(label)}">'
            f'<line x1="{x}" x2="{x + 28}" y1="{mid:.1f}" y2="{mid:.1f}" class="line"/>'
            f'<text x="{x + 36}" y="{mid + 4:.1f}" class="label">{escape(label)}</text></g>'
        )
    out.append("</g>")
    return out


def _target_line(frame: _PlotFrame, target_secs: float) -> list[str]:
    y = frame.y_of(target_secs)
    return [
        f'<line x1="{frame.left}" x2="{frame.left + frame.width}" y1="{y:.1f}" y2="{y:.1f}" class="target"/>',
        f'<text x="{frame.left + frame.width - 4}" y="{y - 4:.1f}" text-anchor="end" class="tick">'
        f"target {format_cost(target_secs)}</text>",
    ]


def _step_line(frame: _PlotFrame, pts: Sequence[tuple[float, float]]) -> list[str]:
    """The curve through `pts` (sorted by trials) as a step line: the estimate holds until
    the next round changes it; a circle on each point, titled with its value."""
    x_of, y_of = frame.x_of, frame.y_of
    path = [f"M{x_of(pts[0][0]):.1f},{y_of(pts[0][1]):.1f}"]
    for t, s in pts[1:]:
        path.append(f"H{x_of(t):.1f}V{y_of(s):.1f}")
    out = [f'<path d="{"".join(path)}" class="line"/>']
    for t, s in pts:
        out.append(f'<circle cx="{x_of(t):.1f}" cy="{y_of(s):.1f}" r="3" class="point">'
                   f"<title>{t:g} trials: {format_cost(s)}</title></circle>")
    return out


PLOT_CSS = """
svg.curve { display: block; width: 100%; height: auto; background: #fff;
            font: 12px -apple-system, "Segoe UI", "Liberation Sans", "DejaVu Sans", Arial, sans-serif; }
svg.curve .frame { fill: none; stroke: #c8ccd2; }
svg.curve .grid { stroke: #eceef1; }
svg.curve .tick, svg.curve .axis { fill: #5b6470; }
svg.curve .title, svg.curve .label { fill: #1f2933; }
svg.curve .title { font-weight: 600; }
svg.curve .empty { fill: #5f6b7a; }
svg.curve .line { fill: none; stroke: #2563eb; stroke-width: 2; }
svg.curve .point { fill: #2563eb; }
svg.curve .target { stroke: #d97706; stroke-dasharray: 6 4; }
svg.curve .series-1 .line { stroke: #c2410c; stroke-dasharray: 8 4; }
svg.curve .series-1 .point { fill: #c2410c; }
svg.curve .series-2 .line { stroke: #047857; stroke-dasharray: 2 3; }
svg.curve .series-2 .point { fill: #047857; }
svg.curve .series-3 .line { stroke: #7c3aed; stroke-dasharray: 8 3 2 3; }
svg.curve .series-3 .point { fill: #7c3aed; }
svg.curve .series-4 .line { stroke: #be185d; }
svg.curve .series-4 .point { fill: #be185d; }
svg.curve .series-5 .line { stroke: #0e7490; stroke-dasharray: 8 4; }
svg.curve .series-5 .point { fill: #0e7490; }
svg.curve .series-6 .line { stroke: #4d7c0f; stroke-dasharray: 2 3; }
svg.curve .series-6 .point { fill: #4d7c0f; }
svg.curve .series-7 .line { stroke: #374151; stroke-dasharray: 8 3 2 3; }
svg.curve .series-7 .point { fill: #374151; }
"""
"""The plot's style: part of every page or file that inlines `latency_curve_svg`."""

PAGE_CSS = """
:root { color-scheme: light; }
*, *::before, *::after { box-sizing: border-box; }
body { font: 14px/1.45 -apple-system, "Segoe UI", "Liberation Sans", "DejaVu Sans", Arial, sans-serif; color: #1f2933; background: #f5f6f8;
       margin: 0; }
header.bar { background: #1f2933; color: #fff; padding: 10px 24px; display: flex; flex-wrap: wrap; gap: 8px 24px;
             align-items: center; }
header.bar a { color: #cbd2d9; text-decoration: none; }
header.bar a.here, header.bar a:hover { color: #fff; }
header.bar .brand { font-weight: 700; color: #fff; margin-right: 12px; }
header.bar form { margin-left: auto; }
main { max-width: 1120px; margin: 0 auto; padding: 20px 24px 40px; }
h1 { font-size: 22px; margin: 8px 0 14px; overflow-wrap: anywhere; }
h2 { font-size: 17px; margin: 26px 0 10px; }
.card { background: #fff; border: 1px solid #dde1e6; border-radius: 6px; padding: 14px 16px; margin-bottom: 16px; }
.card.plot { padding: 8px; overflow-x: auto; }
.table-scroll { max-width: 100%; overflow-x: auto; margin-bottom: 16px; }
.table-scroll > table.data { margin: 0; }
.curves { display: grid; grid-template-columns: repeat(auto-fill, minmax(min(100%, 320px), 1fr)); gap: 12px; }
.curves figure { margin: 0; background: #fff; border: 1px solid #dde1e6; border-radius: 6px; padding: 6px; min-width: 0; }
.curves figcaption { font-size: 13px; padding: 2px 4px 4px; overflow-wrap: anywhere; }
button { font: inherit; padding: 4px 12px; border-radius: 4px; border: 1px solid #9aa5b1; background: #fff;
         cursor: pointer; }
button.danger { border-color: #b91c1c; color: #b91c1c; }
header.bar button { background: transparent; color: #cbd2d9; border-color: #52606d; }
form.inline { display: inline; }
input[type=password] { font: 14px ui-monospace, monospace; padding: 6px 8px; border: 1px solid #9aa5b1;
                       border-radius: 4px; max-width: 100%; }
table.data { border-collapse: collapse; width: 100%; background: #fff; border: 1px solid #dde1e6; }
table.data th, table.data td { padding: 6px 10px; border-bottom: 1px solid #eceef1; text-align: left;
                               vertical-align: middle; }
table.data thead th { background: #f0f2f5; font-weight: 600; font-size: 13px; color: #3e4c59; }
table.data tbody th { font-weight: 600; }
table.data td.num, table.data th.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
table.data thead th { white-space: nowrap; }
table.data tr:last-child td, table.data tr:last-child th { border-bottom: none; }
.facts { display: grid; grid-template-columns: max-content minmax(0, 1fr); gap: 4px 18px; margin: 0; }
.facts dt { color: #616e7c; }
.facts dd { margin: 0; overflow-wrap: anywhere; }
.bar-outer { background: #e4e7eb; border-radius: 3px; height: 10px; min-width: 140px; }
.bar-outer.inline { display: inline-block; width: 360px; max-width: 100%; min-width: 0; vertical-align: middle;
                    margin-right: 10px; }
.bar-inner { background: #2563eb; border-radius: 3px; height: 10px; }
.state { display: inline-block; padding: 1px 8px; border-radius: 10px; font-size: 12px; font-weight: 600;
         background: #e4e7eb; color: #3e4c59; }
.state-running, .state-busy, .state-finishing { background: #dbeafe; color: #1d4ed8; }
.state-succeeded, .state-idle, .state-tuned, .state-trusted { background: #dcfce7; color: #15803d; }
.state-failed, .state-offline, .state-flagged, .state-quarantined { background: #fee2e2; color: #b91c1c; }
.state-cancelled, .state-disabled, .state-queued, .state-default, .state-unconfirmed { background: #f3f4f6; color: #4b5563; }
.muted { color: #5f6b7a; }
.error { color: #b91c1c; }
.better { color: #15803d; font-weight: 600; }
a { color: #1d4ed8; }
code { font: 12px ui-monospace, monospace; overflow-wrap: anywhere; }
@media (max-width: 600px) {
  header.bar { padding: 8px 12px; gap: 6px 16px; }
  header.bar .brand { margin-right: 0; }
  main { padding: 12px 12px 32px; }
  .card { padding: 10px 12px; }
  .facts { grid-template-columns: minmax(0, 1fr); gap: 0; }
  .facts dd { margin-bottom: 6px; }
  .card.plot svg.curve { min-width: 480px; }  /* readable ticks: the plot scrolls in its card */
}
"""
"""The style of the HTML views (the dashboard's pages, `tunefarm report --html`)."""
