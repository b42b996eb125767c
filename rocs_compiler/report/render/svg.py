"""The speedup plot as inline SVG (the graph itself is drawn in the page, ``viewer.js``)."""

from __future__ import annotations

import html
import math
from typing import Sequence


def _esc(text: str) -> str:
    return html.escape(str(text), quote=True)


def _svg_open(cls: str, width: float, height: float, font_size: int) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="{cls}" width="{width:.0f}" '
        f'height="{height:.0f}" viewBox="0 0 {width:.0f} {height:.0f}" '
        f'font-family="Helvetica, Arial, sans-serif" font-size="{font_size}">'
    )


# -- speedup plot ---------------------------------------------------------------------------------


def speedup_svg(
    request_flops: float,
    candidate_flops: float,
    num_requests: int = 1,
    measured: Sequence[tuple[int, float]] = (),
    max_candidates: int = 4096,
    width: int = 640,
    height: int = 360,
) -> str:
    """Ideal speedup ``(F_req + F_cand) N / (F_req R + F_cand N)`` against N (log scale).

    ``measured`` adds points ``(N, measured speedup)``.
    """

    def ideal(n: float) -> float:
        after = request_flops * num_requests + candidate_flops * n
        return (request_flops + candidate_flops) * n / after if after else 1.0

    left, right, top, bottom = 60.0, 20.0, 40.0, 50.0
    plot_w, plot_h = width - left - right, height - top - bottom
    log_max = math.log2(max_candidates)
    xs = [2 ** (i / 8) for i in range(int(8 * log_max) + 1)]
    xs = [n for n in xs if n >= num_requests] or [float(num_requests)]
    limit = (request_flops + candidate_flops) / candidate_flops if candidate_flops else None
    top_value = max([ideal(n) for n in xs] + [s for _, s in measured] + [2.0])
    y_max = _nice_ceiling(top_value * 1.05)

    def px(n: float) -> float:
        return left + plot_w * (math.log2(max(n, 1.0)) / log_max)

    def py(s: float) -> float:
        return top + plot_h * (1 - s / y_max)

    out = [
        _svg_open("speedup-plot", width, height, 11),
        f"<title>ideal speedup vs number of candidates (R = {num_requests})</title>",
        (
            f'<text x="{width / 2}" y="20" text-anchor="middle" font-size="13" '
            f'font-weight="bold">Ideal speedup vs candidates N (R = {num_requests})</text>'
        ),
        (
            f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="white" '
            'stroke="#999"/>'
        ),
    ]
    exponent = 0
    while 2**exponent <= max_candidates:
        n = 2**exponent
        x = px(n)
        out.append(
            f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{top + plot_h}" stroke="#eee"/>'
        )
        out.append(f'<text x="{x:.1f}" y="{top + plot_h + 16}" text-anchor="middle">{n}</text>')
        exponent += 2
    step = _nice_step(y_max)
    value = 0.0
    while value <= y_max + 1e-9:
        y = py(value)
        out.append(
            f'<line x1="{left}" y1="{y:.1f}" x2="{left + plot_w}" y2="{y:.1f}" stroke="#eee"/>'
        )
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{value:g}x</text>')
        value += step
    out.append(
        f'<text x="{left + plot_w / 2}" y="{height - 12}" text-anchor="middle">'
        "candidates N (log scale)</text>"
    )
    out.append(
        f'<text x="16" y="{top + plot_h / 2}" text-anchor="middle" '
        f'transform="rotate(-90 16 {top + plot_h / 2})">speedup over the original model</text>'
    )
    if limit is not None and limit <= y_max:
        y = py(limit)
        out.append(
            f'<line class="limit" x1="{left}" y1="{y:.1f}" x2="{left + plot_w}" y2="{y:.1f}" '
            'stroke="#1f5fbf" stroke-dasharray="4,4"/>'
            f'<text x="{left + plot_w - 4}" y="{y - 4:.1f}" text-anchor="end" fill="#1f5fbf">'
            f"limit {limit:.2f}x (N to infinity)</text>"
        )
    points = " ".join(f"{px(n):.1f},{py(ideal(n)):.1f}" for n in xs)
    out.append(
        f'<polyline class="ideal" points="{points}" fill="none" stroke="#c86a12" stroke-width="2"/>'
    )
    for n, s in measured:
        out.append(
            f'<circle class="measured" cx="{px(n):.1f}" cy="{py(s):.1f}" r="4" fill="#2b8a3e">'
            f"<title>measured {s:.2f}x at N={n}</title></circle>"
        )
    legend_y = top + 14
    out.append(
        f'<line x1="{left + 10}" y1="{legend_y}" x2="{left + 34}" y2="{legend_y}" stroke="#c86a12" '
        f'stroke-width="2"/><text x="{left + 40}" y="{legend_y + 4}">ideal (FLOPs)</text>'
    )
    if measured:
        out.append(
            f'<circle cx="{left + 22}" cy="{legend_y + 16}" r="4" fill="#2b8a3e"/>'
            f'<text x="{left + 40}" y="{legend_y + 20}">measured</text>'
        )
    out.append("</svg>")
    return "\n".join(out)


def _nice_step(span: float) -> float:
    raw = span / 5
    magnitude = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    for m in (1, 2, 2.5, 5, 10):
        if raw <= m * magnitude:
            return m * magnitude
    return 10 * magnitude


def _nice_ceiling(value: float) -> float:
    step = _nice_step(value)
    return max(step, math.ceil(value / step) * step)
