"""Minimal inline-SVG charts (bars, scatter/lines): no plotting library, nothing fetched."""

from __future__ import annotations

from html import escape

W, H = 460, 260
LEFT, RIGHT, TOP, BOTTOM = 56, 14, 30, 46
COLORS = ("#3b6fb6", "#e08a2c", "#4a9a5b", "#b6443b", "#7a5bb0")


def _frame(title: str, ylabel: str, ymax: float, xlabel: str = "") -> list[str]:
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
        'font-family="sans-serif" font-size="11">',
        f'<text x="{W / 2}" y="16" text-anchor="middle" font-size="13" font-weight="bold">{escape(title)}</text>',
        f'<text x="12" y="{TOP + (H - TOP - BOTTOM) / 2}" transform="rotate(-90 12 {TOP + (H - TOP - BOTTOM) / 2})" '
        f'text-anchor="middle">{escape(ylabel)}</text>',
    ]
    if xlabel:
        out.append(
            f'<text x="{LEFT + (W - LEFT - RIGHT) / 2}" y="{H - 6}" text-anchor="middle">{escape(xlabel)}</text>'
        )
    for i in range(5):
        v = ymax * i / 4
        y = _y(v, ymax)
        out.append(f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{LEFT - 4}" y="{y + 4:.1f}" text-anchor="end">{_fmt(v)}</text>')
    return out


def _y(v: float, ymax: float) -> float:
    return H - BOTTOM - (v / ymax if ymax else 0) * (H - TOP - BOTTOM)


def _fmt(v: float) -> str:
    return f"{v:.2g}" if abs(v) < 10 else f"{v:.0f}"


def bar_chart(
    title: str,
    labels: list[str],
    series: dict[str, list[float]],
    ylabel: str = "",
    ymax: float | None = None,
    xlabel: str = "",
) -> str:
    """Grouped bars: one group per label, one bar per series."""
    top = ymax if ymax is not None else max([v for vals in series.values() for v in vals] + [1e-9]) * 1.1
    out = _frame(title, ylabel, top, xlabel)
    n_groups, n_series = max(1, len(labels)), max(1, len(series))
    group_w = (W - LEFT - RIGHT) / n_groups
    bar_w = group_w * 0.8 / n_series
    for g, label in enumerate(labels):
        x0 = LEFT + g * group_w + group_w * 0.1
        for s, (name, vals) in enumerate(series.items()):
            v = vals[g] if g < len(vals) else 0.0
            y = _y(min(v, top), top)
            out.append(
                f'<rect x="{x0 + s * bar_w:.1f}" y="{y:.1f}" width="{bar_w * 0.95:.1f}" '
                f'height="{H - BOTTOM - y:.1f}" fill="{COLORS[s % len(COLORS)]}"><title>{escape(name)} '
                f"{escape(label)}: {v:.3g}</title></rect>"
            )
        out.append(
            f'<text x="{x0 + group_w * 0.4:.1f}" y="{H - BOTTOM + 14}" text-anchor="middle">{escape(label)}</text>'
        )
    out += _legend(list(series)) if len(series) > 1 else []
    return "\n".join(out + ["</svg>"])


def xy_chart(
    title: str,
    series: dict[str, list[tuple[float, float]]],
    ylabel: str = "",
    xlabel: str = "",
    lines: frozenset[str] = frozenset(),
) -> str:
    """Scatter points per series; series named in ``lines`` are drawn as polylines."""
    pts = [p for vals in series.values() for p in vals] or [(0.0, 0.0)]
    xmin, xmax = min(p[0] for p in pts), max(p[0] for p in pts)
    xmax = xmax if xmax > xmin else xmin + 1
    top = max(p[1] for p in pts) * 1.1 or 1.0
    out = _frame(title, ylabel, top, xlabel)

    def px(x: float) -> float:
        return LEFT + (x - xmin) / (xmax - xmin) * (W - LEFT - RIGHT)

    for i in range(5):
        x = xmin + (xmax - xmin) * i / 4
        out.append(f'<text x="{px(x):.1f}" y="{H - BOTTOM + 14}" text-anchor="middle">{_fmt(x)}</text>')
    for s, (name, vals) in enumerate(series.items()):
        color = COLORS[s % len(COLORS)]
        if name in lines:
            path = " ".join(f"{px(x):.1f},{_y(min(y, top), top):.1f}" for x, y in vals)
            out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
        else:
            out += [
                f'<circle cx="{px(x):.1f}" cy="{_y(min(y, top), top):.1f}" r="2" fill="{color}" fill-opacity="0.5"/>'
                for x, y in vals
            ]
    out += _legend(list(series)) if len(series) > 1 else []
    return "\n".join(out + ["</svg>"])


def _legend(names: list[str]) -> list[str]:
    out = []
    for i, name in enumerate(names):
        x = LEFT + 8 + i * 120
        out.append(f'<rect x="{x}" y="{TOP - 6}" width="10" height="10" fill="{COLORS[i % len(COLORS)]}"/>')
        out.append(f'<text x="{x + 14}" y="{TOP + 3}">{escape(name)}</text>')
    return out
