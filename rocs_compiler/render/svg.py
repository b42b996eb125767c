"""SVG drawn without Graphviz: a layered graph layout and the speedup plot.

The layout puts every node on the layer of its longest path from an input (its topological
depth), orders each layer by role (REQUEST left, CONST middle, CANDIDATE right, so the three
regions form columns) and then by the mean position of its predecessors, which removes most
crossings in these mostly chain-like graphs. Edges are cubic curves; broadcast edges are red and
dashed. Node groups carry the classes ``node role-<ROLE>`` like the Graphviz output.
"""

from __future__ import annotations

import html
import math
from typing import Sequence

from .dot import BROADCAST_COLOR, COLORS, ROLE_TITLES, node_lines
from .view import GraphView

CHAR_W, LINE_H, PAD, GAP_X, GAP_Y = 6.3, 13.0, 6.0, 18.0, 42.0
ROLE_ORDER = {"REQUEST": 0, "CONST": 1, "CANDIDATE": 2}
LEGEND_W = 900.0


def _esc(text: str) -> str:
    return html.escape(str(text), quote=True)


def _layers(view: GraphView) -> list[list[str]]:
    preds: dict[str, list[str]] = {n.id: [] for n in view.nodes}
    for edge in view.edges:
        preds[edge.dst].append(edge.src)
    succs: dict[str, list[str]] = {n.id: [] for n in view.nodes}
    for edge in view.edges:
        succs[edge.src].append(edge.dst)
    depth: dict[str, int] = {}
    for node in view.nodes:  # graph order is topological
        depth[node.id] = 1 + max((depth[p] for p in preds[node.id] if p in depth), default=-1)
    for node in reversed(view.nodes):
        # A weight-only source (a slice of a weight) sits just above its first consumer, not at
        # the top next to the model inputs.
        if node.op != "input" and not preds[node.id] and succs[node.id]:
            depth[node.id] = max(0, min(depth[s] for s in succs[node.id]) - 1)
    layers: list[list[str]] = [[] for _ in range(max(depth.values(), default=-1) + 1)]
    for node in view.nodes:
        layers[depth[node.id]].append(node.id)
    layers = [layer for layer in layers if layer]
    roles = {n.id: n.role for n in view.nodes}
    position: dict[str, float] = {}
    for layer in layers:

        def key(node_id: str) -> tuple:
            above = [position[p] for p in preds[node_id] if p in position]
            return (ROLE_ORDER[roles[node_id]], sum(above) / len(above) if above else 0.0)

        layer.sort(key=key)
        for i, node_id in enumerate(layer):
            position[node_id] = i / max(len(layer), 1)
    return layers


def graph_svg(view: GraphView) -> str:
    """The whole graph as one ``<svg>`` element."""
    boxes: dict[str, tuple[float, float, float, float]] = {}  # id -> x, y, w, h
    texts = {n.id: node_lines(n) for n in view.nodes}
    layers = _layers(view)
    sizes = {
        i: (
            min(240.0, max(len(t) for t in lines) * CHAR_W + 2 * PAD),
            len(lines) * LINE_H + 2 * PAD,
        )
        for i, lines in texts.items()
    }
    widths = [sum(sizes[i][0] for i in layer) + GAP_X * (len(layer) - 1) for layer in layers]
    total_w = max(max(widths, default=200.0) + 40, LEGEND_W)
    y = 70.0
    for layer, width in zip(layers, widths):
        x = (total_w - width) / 2
        height = max(sizes[i][1] for i in layer)
        for node_id in layer:
            w, h = sizes[node_id]
            boxes[node_id] = (x, y + (height - h) / 2, w, h)
            x += w + GAP_X
        y += height + GAP_Y
    total_h = y + 10
    out = [
        _svg_open("rocs-graph", total_w, total_h, 10),
        f"<title>{_esc(view.title)}</title>",
        f"<defs>{_marker('arrow', '#555')}{_marker('arrow-bc', BROADCAST_COLOR)}</defs>",
        _legend(),
    ]
    for edge in view.edges:
        if edge.src not in boxes or edge.dst not in boxes:
            continue
        sx, sy, sw, sh = boxes[edge.src]
        dx, dy, dw, _ = boxes[edge.dst]
        x1, y1, x2, y2 = sx + sw / 2, sy + sh, dx + dw / 2, dy
        bend = max(20.0, (y2 - y1) / 2)
        path = (
            f"M {x1:.1f} {y1:.1f} C {x1:.1f} {y1 + bend:.1f} "
            f"{x2:.1f} {y2 - bend:.1f} {x2:.1f} {y2:.1f}"
        )
        if edge.broadcast:
            attrs = (
                f'class="edge broadcast" stroke="{BROADCAST_COLOR}" stroke-dasharray="5,3" '
                'stroke-width="1.6" marker-end="url(#arrow-bc)"'
            )
        else:
            attrs = 'class="edge" stroke="#777" stroke-width="1" marker-end="url(#arrow)"'
        out.append(f'<path d="{path}" fill="none" {attrs}/>')
    for node in view.nodes:
        x, y0, w, h = boxes[node.id]
        fill, border, _ = COLORS[node.role]
        classes = (
            f"node role-{node.role}"
            + (" fused" if node.fused else "")
            + (" broadcast-source" if node.broadcast else "")
        )
        stroke_w = 2.4 if node.fused else 1.0
        out.append(f'<g class="{classes}" id="{node.id}">')
        out.append(f"<title>{_esc(node.name)} {_esc(node.op)} {_esc(node.shape)}</title>")
        out.append(
            f'<rect x="{x:.1f}" y="{y0:.1f}" width="{w:.1f}" height="{h:.1f}" rx="5" '
            f'fill="{fill}" stroke="{border}" stroke-width="{stroke_w}"/>'
        )
        for i, line in enumerate(texts[node.id]):
            ty = y0 + PAD + LINE_H * (i + 0.8)
            weight = ' font-weight="bold"' if i == 0 else ""
            out.append(
                f'<text x="{x + w / 2:.1f}" y="{ty:.1f}" text-anchor="middle"{weight}>'
                f"{_esc(line[:38])}</text>"
            )
        out.append("</g>")
    out.append("</svg>")
    return "\n".join(out)


def _svg_open(cls: str, width: float, height: float, font_size: int) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="{cls}" width="{width:.0f}" '
        f'height="{height:.0f}" viewBox="0 0 {width:.0f} {height:.0f}" '
        f'font-family="Helvetica, Arial, sans-serif" font-size="{font_size}">'
    )


def _marker(marker_id: str, color: str) -> str:
    return (
        f'<marker id="{marker_id}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="6" '
        f'markerHeight="6" orient="auto-start-reverse">'
        f'<path d="M 0 0 L 10 5 L 0 10 z" fill="{color}"/></marker>'
    )


def _legend() -> str:
    items = []
    x = 10.0
    for role in ("REQUEST", "CANDIDATE", "CONST"):
        fill, border, _ = COLORS[role]
        items.append(
            f'<rect x="{x}" y="10" width="14" height="14" rx="3" fill="{fill}" stroke="{border}"/>'
            f'<text x="{x + 20}" y="21">{_esc(ROLE_TITLES[role])}</text>'
        )
        x += 20 + len(ROLE_TITLES[role]) * CHAR_W + 16
    items.append(
        f'<path d="M {x} 17 L {x + 30} 17" stroke="{BROADCAST_COLOR}" stroke-dasharray="5,3" '
        f'stroke-width="1.6"/><text x="{x + 36}" y="21">broadcast (request value read per '
        "candidate)</text>"
    )
    return '<g class="legend">' + "".join(items) + "</g>"


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


def empty_svg(message: str, width: int = 400, height: int = 60) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">'
        f'<text x="10" y="30">{_esc(message)}</text></svg>'
    )
