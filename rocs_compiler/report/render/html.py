"""One self-contained HTML page: summary, interactive graph, speedup plot and tables.

Nothing is loaded from outside the file: the graphs are embedded as JSON and drawn by an inline
script (``viewer.js``: layered layout, module groups that collapse, zoom, pan, search and a
detail panel per node); the speedup plot is inline SVG and the styles inline CSS. The page
shows the graph as the user wrote it and after rewrites, switchable, a per-module summary next
to the ATen-level node table, and explains measured speedups that differ from the ideal.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Optional, Sequence

from .dot import BROADCAST_COLOR, COLORS, ROLE_TITLES, format_flops
from .view import UNIT, GraphView

# Graphs with more nodes open with their top-level modules collapsed.
COLLAPSE_ABOVE = 150

_CSS = """
body { font-family: Helvetica, Arial, sans-serif; margin: 24px; color: #222; }
h1 { font-size: 20px; } h2 { font-size: 16px; margin-top: 28px; }
h3 { font-size: 14px; margin: 4px 0; }
table { border-collapse: collapse; font-size: 12px; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f3f3f3; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.summary td:first-child { font-weight: bold; }
.note { color: #555; font-size: 12px; max-width: 900px; }
#rocs-toolbar { display: flex; flex-wrap: wrap; gap: 6px; align-items: center; margin: 6px 0;
  font-size: 12px; }
#rocs-toolbar button, #rocs-tabs button, .action, .toggle { font-size: 12px; cursor: pointer; }
#rocs-tabs button.active { background: #1f5fbf; color: white; border-color: #1f5fbf; }
#rocs-layout { display: flex; gap: 8px; }
#rocs-canvas { flex: 1; height: 72vh; min-height: 360px; border: 1px solid #ddd; overflow: hidden;
  position: relative; background: #fcfcfc; cursor: grab; }
#rocs-svg { width: 100%; height: 100%; display: block; user-select: none; }
#rocs-side { width: 320px; flex: none; display: flex; flex-direction: column; gap: 8px; }
#rocs-details, #rocs-modules { border: 1px solid #ddd; padding: 6px; font-size: 12px;
  overflow: auto; }
#rocs-details { max-height: 42vh; } #rocs-modules { max-height: 28vh; }
#rocs-details table { width: 100%; } #rocs-details th { width: 80px; }
.action { margin: 4px 4px 0 0; }
.module-row { white-space: nowrap; } .module-row.hidden-by-parent { color: #aaa; }
.toggle { width: 22px; padding: 0; margin-right: 4px; }
g.node { cursor: pointer; } g.node text { font-size: 10px; text-anchor: middle; }
g.node text.head { font-weight: bold; }
g.node.group rect { stroke-dasharray: 4,2; stroke-width: 1.6; }
g.node.fused rect { stroke-width: 1.6; } g.node.fused rect.inner { fill: none; }
g.node.match rect { stroke: #e0a800; stroke-width: 3; }
g.node.selected rect { stroke: #111; stroke-width: 3; }
path.edge { fill: none; stroke: #888; stroke-width: 1; }
path.edge.shape { stroke: #aaa; stroke-dasharray: 1,3; }
table.modules td.name { white-space: pre; font-family: monospace; }
""" + "".join(
    f"g.node.role-{role} rect {{ fill: {fill}; stroke: {border}; }}\n"
    f"tr.role-{role} td.role {{ background: {fill}; color: {border}; font-weight: bold; }}\n"
    for role, (fill, border, _) in COLORS.items()
) + (
    f"path.edge.broadcast {{ stroke: {BROADCAST_COLOR}; stroke-dasharray: 5,3; "
    "stroke-width: 1.6; }\n"
)

_SCRIPT = (Path(__file__).with_name("viewer.js")).read_text()


def _esc(text) -> str:
    return html.escape(str(text), quote=True)


def _ideal_text(report, num_candidates: int, num_requests: int) -> str:
    speedup = report.ideal_speedup(num_candidates, num_requests)
    return f"{speedup:.2f}x at N = {num_candidates}, R = {num_requests}"


def _summary_rows(report, num_candidates: int, num_requests: int) -> list[tuple[str, str]]:
    rows = [
        ("FLOPs per request", format_flops(report.request_flops)),
        ("FLOPs per candidate", format_flops(report.candidate_flops)),
        ("request share of FLOPs", f"{report.request_share:.1%}"),
        ("ideal speedup", _ideal_text(report, num_candidates, num_requests)),
    ]
    fired = {k: v for k, v in sorted(getattr(report, "pass_counts", {}).items()) if v}
    if fired:
        rows.append(("rewrites fired", ", ".join(f"{k} x{v}" for k, v in fired.items())))
    rows.append(("fused ops", ", ".join(report.fused_ops) or "none"))
    rows.append(("per-candidate fallbacks", str(len(report.fallbacks))))
    if getattr(report, "route", ""):
        rows.append(("capture route", report.route))
    return rows


def _data(views: Sequence[GraphView], default_view: Optional[str]) -> dict:
    out = []
    for view in views:
        index = {n.id: i for i, n in enumerate(view.nodes)}
        nodes = [
            {
                "name": n.name, "op": n.op, "short": n.short_op, "role": n.role,
                "module": n.module, "flops": n.flops, "shape": n.shape, "axis": n.axis,
                "reason": n.reason, "fused": n.fused, "broadcast": n.broadcast,
            }
            for n in view.nodes
        ]  # fmt: skip
        edges = [
            [index[e.src], index[e.dst], 2 if e.shape_only else 1 if e.broadcast else 0]
            for e in view.edges
        ]
        out.append({"name": view.kind, "title": view.title, "nodes": nodes, "edges": edges})
    names = [v["name"] for v in out]
    return {
        "views": out,
        "default_view": default_view if default_view in names else (names[0] if names else None),
        "collapse_above": COLLAPSE_ABOVE,
        "role_titles": ROLE_TITLES,
    }


def _json_script(data: dict) -> str:
    text = json.dumps(data, separators=(",", ":"))
    # Inside <script>, only "</" can end the element early.
    return text.replace("</", "<\\/")


def _graph_section(views: Sequence[GraphView]) -> list[str]:
    shape_edges = sum(1 for v in views for e in v.edges if e.shape_only)
    return [
        '<section id="graph"><h2>Graph</h2>',
        '<p class="note">Blue nodes run once per request (R rows), orange nodes once per '
        "candidate (N rows), grey nodes depend on weights only. Red dashed edges are broadcasts: "
        "a request value read by candidate computation, gathered with "
        "<code>candidate_to_request</code> (inside a fused kernel where one was generated); a "
        "double border marks a fused <code>rocs::</code> op. Shapes name the batch dimension "
        "<code>B</code>. <b>As written</b> is the graph as captured from the model's code; "
        "<b>after rewrites</b> is the graph the cost model counts, after the algebraic rewrites "
        "that let more of it run once per request. Scroll to zoom, drag to pan, click a node "
        "for details, double-click a module box to expand it.</p>",
        '<div id="rocs-toolbar"><span id="rocs-tabs"></span>'
        '<input id="rocs-search" type="search" placeholder="search nodes, ops, modules (Enter)" '
        'size="32"><span id="rocs-search-info"></span>'
        '<button id="rocs-zoom-in" title="zoom in">+</button>'
        '<button id="rocs-zoom-out" title="zoom out">&minus;</button>'
        '<button id="rocs-fit">fit</button>'
        '<button id="rocs-collapse-all">collapse modules</button>'
        '<button id="rocs-expand-all">expand all</button>'
        '<label><input id="rocs-shape-edges" type="checkbox"> shape-only edges '
        f"({shape_edges})</label></div>",
        '<div id="rocs-layout"><div id="rocs-canvas"><svg id="rocs-svg" class="rocs-graph" '
        'xmlns="http://www.w3.org/2000/svg"><defs>'
        + _marker("rocs-arrow", "#888")
        + _marker("rocs-arrow-bc", BROADCAST_COLOR)
        + '</defs><g id="rocs-viewport"></g></svg></div>'
        '<div id="rocs-side"><div id="rocs-details"><p class="note">Click a node for its op, '
        "shapes, role, FLOPs, batch axis and the reason it runs where it does.</p></div>"
        '<div id="rocs-modules"></div></div></div>',
        '<p class="note">Shape-only edges (hidden unless ticked, dotted when shown) connect a '
        "node to one that reads only its size, e.g. a request-side <code>view</code> sized "
        "with <code>x.size(0)</code> of a candidate input: no candidate values flow there, and "
        "the compiled model evaluates such sizes per side.</p>",
        "</section>",
    ]


def _marker(marker_id: str, color: str) -> str:
    return (
        f'<marker id="{marker_id}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="6" '
        f'markerHeight="6" orient="auto-start-reverse">'
        f'<path d="M 0 0 L 10 5 L 0 10 z" fill="{color}"/></marker>'
    )


def measured_note(report, measured: Sequence[tuple[int, float]], num_requests: int) -> str:
    """Why measured speedups differ from the ideal one, for the directions that occur."""
    above = [n for n, s in measured if s > 1.1 * report.ideal_speedup(n, num_requests)]
    below = [n for n, s in measured if s < 0.9 * report.ideal_speedup(n, num_requests)]
    parts = [
        "The ideal speedup counts FLOPs only (matmuls, convolutions, attention): not "
        "element-wise work, embedding lookups, memory traffic or per-call costs."
    ]
    if above:
        parts.append(
            f"Measured exceeds it at N = {', '.join(map(str, above))}: the original model also "
            "repeats per candidate the uncounted work on request features (embedding lookups, "
            "element-wise ops, copies of replicated inputs, memory traffic of large request "
            "tensors), which the compiled model does once per request."
        )
    if below:
        parts.append(
            f"Measured falls short of it at N = {', '.join(map(str, below))}: per-call costs "
            "(framework overhead, kernel launches), gathering request rows per candidate and "
            "uncounted per-candidate work do not shrink with sharing, and dominate small "
            "models or few candidates."
        )
    return " ".join(parts)


def _read_by(row) -> str:
    """Where a module without nodes of its own has its work: the nodes reading its parameters."""
    return f"parameters read by {_esc(row.read_by)}" if row.read_by else ""


def _module_section(report) -> list[str]:
    rows = getattr(report, "modules", None) or []
    if not rows:
        return []
    out = [
        '<section id="modules"><h2>Modules</h2><p class="note">Per <code>nn.Module</code> '
        "(each row sums its submodules): parameters, and the FLOPs of its nodes that run once "
        "per request and once per candidate.</p><table class=\"modules\">",
        "<tr><th>module</th><th>parameters</th><th>FLOPs per request</th>"
        "<th>FLOPs per candidate</th><th>request nodes</th><th>candidate nodes</th>"
        "<th>nodes</th><th>work counted in</th></tr>",
    ]
    for m in rows:
        out.append(
            f'<tr><td class="name">{"  " * m.depth}{_esc(m.module)}</td>'
            f'<td class="num">{m.params:,}</td>'
            f'<td class="num">{format_flops(m.request_flops) if m.request_flops else "-"}</td>'
            f'<td class="num">{format_flops(m.candidate_flops) if m.candidate_flops else "-"}</td>'
            f'<td class="num">{m.request_nodes}</td><td class="num">{m.candidate_nodes}</td>'
            f'<td class="num">{m.nodes}</td><td>{_read_by(m)}</td></tr>'
        )
    out.append("</table></section>")
    return out


def html_page(
    title: str,
    views: Sequence[GraphView],
    report,
    plot_svg: str,
    num_candidates: int,
    num_requests: int,
    measured: Sequence[tuple[int, float]] = (),
    default_view: Optional[str] = None,
) -> str:
    """The page; ``views`` are the switchable drawings (``default_view``: the ``kind`` shown
    first, else the first)."""
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>rocs report: {_esc(title)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>rocs report: {_esc(title)}</h1>",
        '<section id="summary"><h2>Summary</h2><table class="summary">',
    ]
    for key, value in _summary_rows(report, num_candidates, num_requests):
        parts.append(f"<tr><td>{_esc(key)}</td><td>{_esc(value)}</td></tr>")
    parts.append("</table>")
    if getattr(report, "note", ""):
        parts.append(f'<p class="note">{_esc(report.note)}</p>')
    parts.append("</section>")
    parts.extend(_graph_section(views))

    parts.append('<section id="speedup"><h2>Ideal speedup</h2>')
    parts.append(
        '<p class="note">ideal speedup = (F_req + F_cand) &middot; N / (F_req &middot; R + '
        "F_cand &middot; N), from the FLOP counts of the original graph.</p>"
    )
    parts.append(plot_svg)
    if measured:
        parts.append(
            '<table class="measured"><tr><th>N</th><th>R</th><th>measured speedup</th>'
            "<th>ideal speedup</th></tr>"
        )
        for n, s in measured:
            parts.append(
                f'<tr><td class="num">{n}</td><td class="num">{num_requests}</td>'
                f'<td class="num">{s:.2f}x</td>'
                f'<td class="num">{report.ideal_speedup(n, num_requests):.2f}x</td></tr>'
            )
        parts.append("</table>")
        parts.append(f'<p class="note">{_esc(measured_note(report, measured, num_requests))}</p>')
    parts.append("</section>")
    parts.extend(_module_section(report))

    if report.fallbacks:
        parts.append(
            '<section id="fallbacks"><h2>Per-candidate fallbacks</h2><table>'
            "<tr><th>node</th><th>op</th><th>module</th><th>reason</th></tr>"
        )
        for fb in report.fallbacks:
            parts.append(
                f"<tr><td>{_esc(fb.node)}</td><td>{_esc(fb.op)}</td><td>{_esc(fb.module)}</td>"
                f"<td>{_esc(fb.reason)}</td></tr>"
            )
        parts.append("</table></section>")

    parts.append('<section id="nodes"><h2>Nodes</h2><table class="nodes">')
    lengths = bool(getattr(report, "lengths", None))  # a column when counted at given lengths
    parts.append(
        "<tr><th>node</th><th>op</th><th>role</th><th>module</th><th>shape</th>"
        "<th>FLOPs</th><th>broadcast</th>" + ("<th>grows with length</th>" if lengths else "")
        + "</tr>"
    )
    for node in report.nodes:
        flops = f"{format_flops(node.flops)}{UNIT[node.role]}" if node.flops else "-"
        grows = f"<td>{'yes' if node.grows else ''}</td>" if lengths else ""
        parts.append(
            f'<tr class="role-{node.role}"><td>{_esc(node.name)}</td><td>{_esc(node.op)}</td>'
            f'<td class="role">{node.role}</td><td>{_esc(node.module)}</td>'
            f'<td>{_esc(node.shape)}</td><td class="num">{flops}</td>'
            f"<td>{'yes' if node.broadcast else ''}</td>{grows}</tr>"
        )
    parts.append("</table></section>")
    parts.append('<pre id="rocs-selftest" hidden></pre>')
    parts.append(
        '<script type="application/json" id="rocs-data">'
        + _json_script(_data(views, default_view))
        + "</script>"
    )
    parts.append(f"<script>{_SCRIPT}</script></body></html>")
    return "\n".join(parts) + "\n"
