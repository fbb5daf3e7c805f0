"""How numbers are shown to people: latencies and durations as short text, and the
estimated latency over trials as an SVG plot; and text a peer sent, made safe to print
(`printable`).

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


def latency_curve_svg(
    points: Sequence[tuple[float, float]],
    *,
    width: int = 1040,
    height: int = 300,
    target_secs: float | None = None,
    title: str = "estimated latency",
) -> str:
    """The estimated end-to-end latency (seconds) over trials as an SVG step plot.

    `points` are (trials, seconds) pairs, in any order; pairs without a finite latency are
    left out. Each kept point is a `<circle class="point">`; the root element carries the
    count in `data-points`. With no point, a frame that says so."""
    pts = sorted((float(t), float(s)) for t, s in points if s is not None and math.isfinite(s) and s > 0)
    left, right, top, bottom = 84, 16, 28, 40
    pw, ph = width - left - right, height - top - bottom
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="curve" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}" data-points="{len(pts)}">',
        f'<text x="{left}" y="18" class="title">{escape(title)}</text>',
        f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" class="frame"/>',
    ]
    if not pts:
        out.append(f'<text x="{left + pw / 2}" y="{top + ph / 2}" text-anchor="middle" class="empty">'
                   "no estimate yet</text></svg>")
        return "\n".join(out)
    y_lo, y_hi = _latency_range([s for _, s in pts] + ([target_secs] if target_secs else []))
    frame = _PlotFrame(left, top, pw, ph, x_hi=max(pts[-1][0], 1.0), y_lo=y_lo, y_hi=y_hi)
    out += _axis_ticks(frame)
    out.append(f'<text x="{left + pw / 2}" y="{height - 6}" text-anchor="middle" class="axis">trials</text>')
    if target_secs:
        out += _target_line(frame, target_secs)
    out += _step_line(frame, pts)
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
svg.curve { font: 12px -apple-system, "Segoe UI", "Liberation Sans", "DejaVu Sans", Arial, sans-serif; background: #fff; }
svg.curve .frame { fill: none; stroke: #c8ccd2; }
svg.curve .grid { stroke: #eceef1; }
svg.curve .tick, svg.curve .axis { fill: #5b6470; }
svg.curve .title { fill: #1f2933; font-weight: 600; }
svg.curve .empty { fill: #8a939e; }
svg.curve .line { fill: none; stroke: #2563eb; stroke-width: 2; }
svg.curve .point { fill: #2563eb; }
svg.curve .target { stroke: #d97706; stroke-dasharray: 6 4; }
"""
"""The plot's style: part of every page or file that inlines `latency_curve_svg`."""

PAGE_CSS = """
:root { color-scheme: light; }
body { font: 14px/1.45 -apple-system, "Segoe UI", "Liberation Sans", "DejaVu Sans", Arial, sans-serif; color: #1f2933; background: #f5f6f8;
       margin: 0; }
header.bar { background: #1f2933; color: #fff; padding: 10px 24px; display: flex; gap: 24px; align-items: center; }
header.bar a { color: #cbd2d9; text-decoration: none; }
header.bar a.here, header.bar a:hover { color: #fff; }
header.bar .brand { font-weight: 700; color: #fff; margin-right: 12px; }
header.bar form { margin-left: auto; }
main { max-width: 1120px; margin: 0 auto; padding: 20px 24px 40px; }
h1 { font-size: 22px; margin: 8px 0 14px; }
h2 { font-size: 17px; margin: 26px 0 10px; }
.card { background: #fff; border: 1px solid #dde1e6; border-radius: 6px; padding: 14px 16px; margin-bottom: 16px; }
.card.plot { padding: 8px; overflow-x: auto; }
button { font: inherit; padding: 4px 12px; border-radius: 4px; border: 1px solid #9aa5b1; background: #fff;
         cursor: pointer; }
header.bar button { background: transparent; color: #cbd2d9; border-color: #52606d; }
input[type=password] { font: 14px ui-monospace, monospace; padding: 6px 8px; border: 1px solid #9aa5b1;
                       border-radius: 4px; }
table.data { border-collapse: collapse; width: 100%; background: #fff; border: 1px solid #dde1e6; }
table.data th, table.data td { padding: 6px 10px; border-bottom: 1px solid #eceef1; text-align: left;
                               vertical-align: middle; }
table.data th { background: #f0f2f5; font-weight: 600; font-size: 13px; color: #3e4c59; }
table.data td.num, table.data th.num { text-align: right; font-variant-numeric: tabular-nums; }
table.data tr:last-child td { border-bottom: none; }
.facts { display: grid; grid-template-columns: max-content 1fr; gap: 4px 18px; margin: 0; }
.facts dt { color: #616e7c; }
.facts dd { margin: 0; }
.bar-outer { background: #e4e7eb; border-radius: 3px; height: 10px; min-width: 140px; }
.bar-outer.inline { display: inline-block; width: 360px; vertical-align: middle; margin-right: 10px; }
.bar-inner { background: #2563eb; border-radius: 3px; height: 10px; }
.state { display: inline-block; padding: 1px 8px; border-radius: 10px; font-size: 12px; font-weight: 600;
         background: #e4e7eb; color: #3e4c59; }
.state-running, .state-busy, .state-finishing { background: #dbeafe; color: #1d4ed8; }
.state-succeeded, .state-idle, .state-tuned, .state-trusted { background: #dcfce7; color: #15803d; }
.state-failed, .state-offline, .state-flagged, .state-quarantined { background: #fee2e2; color: #b91c1c; }
.state-cancelled, .state-disabled, .state-queued, .state-default, .state-unconfirmed { background: #f3f4f6; color: #4b5563; }
.muted { color: #7b8794; }
.error { color: #b91c1c; }
.better { color: #15803d; font-weight: 600; }
a { color: #1d4ed8; }
code { font: 12px ui-monospace, monospace; }
"""
"""The style of the HTML views (the dashboard's pages, `tunefarm report --html`)."""
