"""Small, dependency-free SVG line charts for the self-contained HTML report."""

from __future__ import annotations

import math
from html import escape

PALETTE = ("#1f6feb", "#d1242f", "#1a7f37", "#8250df", "#bf8700", "#0a7ea4")


def _nice_step(span: float, target: int = 5) -> float:
    if span <= 0 or not math.isfinite(span):
        return 1.0
    raw = span / target
    mag = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 2.5, 5, 10):
        if raw <= m * mag:
            return m * mag
    return 10 * mag


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e4 or a < 1e-3:
        return f"{v:.0e}"
    if a >= 100:
        return f"{v:.0f}"
    return f"{v:.3g}"


def line_chart(series: list[dict], *, title: str, xlabel: str = "", ylabel: str = "", log_y: bool = False,
               width: int = 680, height: int = 260, hlines: list[dict] | None = None,
               zeros_on_axis: bool = False) -> str:
    """``series``: [{"label", "x": [...], "y": [...], "dashed"?}]; non-finite points are skipped, and
    on a log scale so are non-positive ones unless ``zeros_on_axis`` draws them on the bottom edge.
    ``hlines``: [{"label", "y"}] dashed reference lines."""
    left, right, top, bottom = 64, 16, 28, 44
    pw, ph = width - left - right, height - top - bottom
    pts_all = []
    for s in series:
        for x, y in zip(s["x"], s["y"]):
            if y is None or not math.isfinite(y) or (log_y and y <= 0):
                continue
            pts_all.append((x, y))
    for h in hlines or ():
        if h["y"] is not None and math.isfinite(h["y"]) and (not log_y or h["y"] > 0):
            pts_all.append((None, h["y"]))
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}" class="chart">',
           f'<text x="{left}" y="18" class="chart-title">{escape(title)}</text>']
    xs = [p[0] for p in pts_all if p[0] is not None]
    if not xs:
        out.append(f'<text x="{left + 10}" y="{top + ph / 2}">no data</text></svg>')
        return "".join(out)
    x0, x1 = min(xs), max(xs)
    if x0 == x1:
        x0, x1 = x0 - 1, x1 + 1
    ys = [p[1] for p in pts_all]
    if log_y:
        y0, y1 = math.floor(math.log10(min(ys))), math.ceil(math.log10(max(ys)))
        if y0 == y1:
            y1 += 1

        def ty(v):
            return top + ph - (math.log10(v) - y0) / (y1 - y0) * ph
        ticks = [10.0 ** e for e in range(int(y0), int(y1) + 1)]
    else:
        lo, hi = min(ys), max(ys)
        if lo > 0 and lo < hi * 0.5:
            lo = 0.0
        if lo == hi:
            lo, hi = lo - (abs(lo) or 1) * 0.5, hi + (abs(hi) or 1) * 0.5
        step = _nice_step(hi - lo)
        y0, y1 = math.floor(lo / step) * step, math.ceil(hi / step) * step

        def ty(v):
            return top + ph - (v - y0) / (y1 - y0) * ph
        ticks = [y0 + i * step for i in range(int(round((y1 - y0) / step)) + 1)]

    def tx(v):
        return left + (v - x0) / (x1 - x0) * pw

    out.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" class="plot"/>')
    for t in ticks:
        y = ty(t)
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>')
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end" class="tick">{_fmt(t)}</text>')
    xstep = max(1, int(_nice_step(x1 - x0, 8)))
    xt = math.ceil(x0 / xstep) * xstep
    while xt <= x1:
        out.append(f'<text x="{tx(xt):.1f}" y="{top + ph + 16}" text-anchor="middle" class="tick">{xt:g}</text>')
        xt += xstep
    if xlabel:
        out.append(f'<text x="{left + pw / 2}" y="{height - 8}" text-anchor="middle" class="label">'
                   f'{escape(xlabel)}</text>')
    if ylabel:
        out.append(f'<text x="14" y="{top + ph / 2}" text-anchor="middle" class="label" '
                   f'transform="rotate(-90 14 {top + ph / 2})">{escape(ylabel)}</text>')
    for h in hlines or ():
        if h["y"] is None or not math.isfinite(h["y"]) or (log_y and h["y"] <= 0):
            continue
        y = ty(h["y"])
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{y:.1f}" y2="{y:.1f}" class="ref"/>'
                   f'<text x="{left + pw - 4}" y="{y - 4:.1f}" text-anchor="end" class="tick">'
                   f'{escape(h["label"])}</text>')
    for i, s in enumerate(series):
        color = s.get("color") or PALETTE[i % len(PALETTE)]
        pts = [(tx(x), ty(y) if not (log_y and y <= 0) else top + ph) for x, y in zip(s["x"], s["y"])
               if y is not None and math.isfinite(y) and not (log_y and y <= 0 and not zeros_on_axis)]
        if not pts:
            continue
        if len(pts) > 1:
            d = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
            dash = ' stroke-dasharray="6 4"' if s.get("dashed") else ""
            out.append(f'<polyline points="{d}" fill="none" stroke="{color}" stroke-width="1.8"{dash}/>')
        if len(pts) <= 60:
            out.extend(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.6" fill="{color}"/>' for x, y in pts)
        lx = left + 8 + i * 170
        out.append(f'<rect x="{lx}" y="{top + 6}" width="10" height="10" fill="{color}"/>'
                   f'<text x="{lx + 14}" y="{top + 15}" class="legend">{escape(s["label"])}</text>')
    out.append("</svg>")
    return "".join(out)
