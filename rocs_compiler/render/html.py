"""One self-contained HTML page: summary, graph drawing, speedup plot and node table.

Nothing is loaded from outside the file: the drawing and the plot are inline SVG, the styles
inline CSS, and there is no script.
"""

from __future__ import annotations

import html
from typing import Optional, Sequence

from .dot import COLORS, format_flops
from .view import UNIT, GraphView

_CSS = """
body { font-family: Helvetica, Arial, sans-serif; margin: 24px; color: #222; }
h1 { font-size: 20px; } h2 { font-size: 16px; margin-top: 28px; }
table { border-collapse: collapse; font-size: 12px; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; }
th { background: #f3f3f3; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.drawing { overflow: auto; max-height: 900px; border: 1px solid #ddd; padding: 4px; }
.summary td:first-child { font-weight: bold; }
.note { color: #555; font-size: 12px; max-width: 900px; }
""" + "".join(
    f"tr.role-{role} td.role {{ background: {fill}; color: {border}; font-weight: bold; }}\n"
    for role, (fill, border, _) in COLORS.items()
)


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


def html_page(
    title: str,
    view: GraphView,
    report,
    graph_svg: str,
    plot_svg: str,
    num_candidates: int,
    num_requests: int,
    measured: Sequence[tuple[int, float]] = (),
    drawing_note: Optional[str] = None,
) -> str:
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>rocs inspect: {_esc(title)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>rocs inspect: {_esc(title)}</h1>",
        '<section id="summary"><h2>Summary</h2><table class="summary">',
    ]
    for key, value in _summary_rows(report, num_candidates, num_requests):
        parts.append(f"<tr><td>{_esc(key)}</td><td>{_esc(value)}</td></tr>")
    parts.append("</table>")
    if getattr(report, "note", ""):
        parts.append(f'<p class="note">{_esc(report.note)}</p>')
    parts.append("</section>")

    parts.append('<section id="graph"><h2>Graph</h2>')
    parts.append(
        '<p class="note">Blue nodes run once per request (R rows), orange nodes once per '
        "candidate (N rows), grey nodes depend on weights only. Red dashed edges are broadcasts: "
        "a request value read by candidate computation, gathered with "
        "<code>candidate_to_request</code> (inside a fused kernel where one was generated). "
        f"FLOPs are per request, per candidate, or once. Drawing: {_esc(view.kind)} graph"
        + (f"; {_esc(drawing_note)}" if drawing_note else "")
        + ".</p>"
    )
    parts.append(f'<div class="drawing">{graph_svg}</div></section>')

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
    parts.append("</section>")

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
    parts.append(
        "<tr><th>node</th><th>op</th><th>role</th><th>module</th><th>shape</th>"
        "<th>FLOPs</th><th>broadcast</th><th>fused</th></tr>"
    )
    for node in view.nodes:
        flops = f"{format_flops(node.flops)}{UNIT[node.role]}" if node.flops else "-"
        parts.append(
            f'<tr class="role-{node.role}"><td>{_esc(node.name)}</td><td>{_esc(node.op)}</td>'
            f'<td class="role">{node.role}</td><td>{_esc(node.module)}</td>'
            f'<td>{_esc(node.shape)}</td><td class="num">{flops}</td>'
            f"<td>{'yes' if node.broadcast else ''}</td><td>{'yes' if node.fused else ''}</td></tr>"
        )
    parts.append("</table></section></body></html>")
    return "\n".join(parts) + "\n"
