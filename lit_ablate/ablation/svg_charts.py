"""Charts for ``report.html``: plain inline SVG, every point and bar with its value on hover.

A self-contained report cannot load a plotting library from a CDN, and embedding one costs megabytes
per report; these charts are a few kilobytes of SVG drawn from the summary, and a browser shows each
mark's ``<title>`` (the variant, the step, the value) when the pointer rests on it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from html import escape

WIDTH, HEIGHT = 720, 320
LEFT, RIGHT, TOP, BOTTOM = 70, 20, 20, 60
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
"""The categorical palette of matplotlib's default cycle: the PNG plots and these charts colour alike."""


def _ticks(low: float, high: float, count: int = 5) -> list[float]:
    """About ``count`` round values spanning ``low .. high``."""
    if high <= low:
        return [low]
    raw = (high - low) / count
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 5, 10) if m * step >= raw)
    first = math.ceil(low / step) * step
    return [first + i * step for i in range(int((high - first) / step) + 1)]


def _frame(title: str, y_label: str, y_low: float, y_high: float, fmt: Callable[[float], str]) -> list[str]:
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
        f'aria-label="{escape(title)}" class="chart">',
        f'<text x="{WIDTH / 2}" y="14" text-anchor="middle" class="chart-title">{escape(title)}</text>',
        f'<text x="14" y="{TOP + (HEIGHT - TOP - BOTTOM) / 2}" transform="rotate(-90 14 '
        f'{TOP + (HEIGHT - TOP - BOTTOM) / 2})" text-anchor="middle">{escape(y_label)}</text>',
    ]
    for tick in _ticks(y_low, y_high):
        y = _y(tick, y_low, y_high)
        parts.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>')
        parts.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{escape(fmt(tick))}</text>')
    return parts


def _y(value: float, low: float, high: float) -> float:
    span = high - low or 1.0
    return TOP + (HEIGHT - TOP - BOTTOM) * (1 - (value - low) / span)


def line_chart(
    title: str,
    y_label: str,
    series: Sequence[tuple[str, Sequence[float], Sequence[float]]],
    fmt: Callable[[float], str],
) -> str:
    """Lines of ``(name, xs, ys)``, one colour each (``COLORS`` in order: the page's legend), every point
    titled ``name, step x: y``."""
    xs = [x for _, steps, _ in series for x in steps]
    ys = [y for _, _, values in series for y in values]
    if not xs:
        return ""
    x_low, x_high = min(xs), max(xs)
    pad = (max(ys) - min(ys)) * 0.05 or abs(max(ys)) * 0.05 or 1.0
    y_low, y_high = min(ys) - pad, max(ys) + pad

    def x_of(x: float) -> float:
        return LEFT + (WIDTH - LEFT - RIGHT) * ((x - x_low) / ((x_high - x_low) or 1.0))

    parts = _frame(title, y_label, y_low, y_high, fmt)
    for tick in _ticks(x_low, x_high):
        parts.append(f'<text x="{x_of(tick):.1f}" y="{HEIGHT - BOTTOM + 16}" text-anchor="middle">{tick:g}</text>')
    parts.append(f'<text x="{(LEFT + WIDTH - RIGHT) / 2}" y="{HEIGHT - 24}" text-anchor="middle">step</text>')
    for index, (name, steps, values) in enumerate(series):
        color = COLORS[index % len(COLORS)]
        points = " ".join(f"{x_of(x):.1f},{_y(y, y_low, y_high):.1f}" for x, y in zip(steps, values))
        parts.append(f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="1.5"/>')
        for x, y in zip(steps, values):
            parts.append(
                f'<circle cx="{x_of(x):.1f}" cy="{_y(y, y_low, y_high):.1f}" r="3" fill="{color}">'
                f"<title>{escape(name)}, step {x:g}: {escape(fmt(y))}</title></circle>"
            )
    return "\n".join([*parts, "</svg>"])


def bar_chart(
    title: str, y_label: str, bars: Sequence[tuple[str, float, float, float]], fmt: Callable[[float], str]
) -> str:
    """Bars of ``(name, median, low, high)`` from zero, a whisker from low to high, each titled with its values."""
    if not bars:
        return ""
    y_high = max(high for _, _, _, high in bars) * 1.08 or 1.0
    parts = _frame(title, y_label, 0.0, y_high, fmt)
    slot = (WIDTH - LEFT - RIGHT) / len(bars)
    for index, (name, median, low, high) in enumerate(bars):
        x = LEFT + slot * index + slot * 0.15
        width = slot * 0.7
        top = _y(median, 0.0, y_high)
        values = fmt(median) if low == high else f"{fmt(median)} [{fmt(low)}–{fmt(high)}]"
        parts.append(
            f'<rect x="{x:.1f}" y="{top:.1f}" width="{width:.1f}" height="{_y(0, 0, y_high) - top:.1f}" '
            f'fill="{COLORS[index % len(COLORS)]}"><title>{escape(name)}: {escape(values)}</title></rect>'
        )
        middle = x + width / 2
        parts.append(
            f'<line x1="{middle:.1f}" x2="{middle:.1f}" y1="{_y(low, 0, y_high):.1f}" y2="{_y(high, 0, y_high):.1f}" '
            'class="whisker"/>'
        )
        label = name if len(name) <= 18 else name[:17] + "…"
        parts.append(
            f'<text x="{middle:.1f}" y="{HEIGHT - BOTTOM + 16}" text-anchor="middle">{escape(label)}'
            f"<title>{escape(name)}</title></text>"
        )
    return "\n".join([*parts, "</svg>"])
