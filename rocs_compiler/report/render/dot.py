"""Graphviz output: DOT text written by hand, SVG by running the ``dot`` program.

REQUEST, CANDIDATE and CONST nodes sit in three clusters with distinct colours; broadcast edges
(a request value read by candidate computation) are red and dashed; fused rocs:: ops get a
double border; shape-only edges are left out. Every SVG node group carries the class
``role-<ROLE>`` (Graphviz copies the ``class`` attribute into its SVG output).
"""

from __future__ import annotations

import shutil
import subprocess

from .view import ROLES, UNIT, GraphView, ViewNode

# (fill, border, cluster background) per role
COLORS = {
    "REQUEST": ("#cfe2ff", "#1f5fbf", "#eef4ff"),
    "CANDIDATE": ("#ffe2bf", "#c86a12", "#fff6ec"),
    "CONST": ("#e9ecef", "#6c757d", "#f7f7f8"),
}
BROADCAST_COLOR = "#d62728"
ROLE_TITLES = {
    "REQUEST": "REQUEST: once per request (R rows)",
    "CANDIDATE": "CANDIDATE: once per candidate (N rows)",
    "CONST": "CONST: weights only, once",
}


class DotNotFound(RuntimeError):
    """Graphviz's ``dot`` program is not installed."""


def format_flops(flops: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(flops) >= scale:
            return f"{flops / scale:.2f}{unit}"
    return f"{flops:.0f}"


def node_lines(node: ViewNode) -> list[str]:
    """The text of a node box: op, source module, FLOPs."""
    lines = [node.short_op if node.op != "input" else f"input {node.name}"]
    if node.module:
        lines.append(node.module)
    if node.flops:
        lines.append(f"{format_flops(node.flops)} FLOPs{UNIT[node.role]}")
    return lines


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def to_dot(view: GraphView) -> str:
    out = [
        f"digraph {_quote(view.title)} {{",
        "  rankdir=TB; newrank=true; nodesep=0.25; ranksep=0.35;",
        f"  label={_quote(view.title)}; labelloc=t; fontname=Helvetica;",
        '  node [shape=box, style="rounded,filled", fontname=Helvetica, fontsize=10];',
        '  edge [color="#555555", arrowsize=0.6];',
    ]
    for role in ROLES:
        members = [n for n in view.nodes if n.role == role]
        if not members:
            continue
        fill, border, background = COLORS[role]
        out.append(f"  subgraph cluster_{role} {{")
        out.append(
            f"    label={_quote(ROLE_TITLES[role])}; style=filled; color={_quote(border)}; "
            f"fillcolor={_quote(background)}; fontcolor={_quote(border)};"
        )
        for node in members:
            attrs = {
                "label": "\n".join(node_lines(node)),
                "fillcolor": fill,
                "color": border,
                "class": f"role-{role}" + (" fused" if node.fused else ""),
                "tooltip": f"{node.name} {node.op} {node.shape}".strip(),
            }
            if node.fused:
                attrs["peripheries"] = "2"
                attrs["penwidth"] = "1.6"
            text = ", ".join(f"{k}={_quote(v)}" for k, v in attrs.items())
            out.append(f"    {node.id} [{text}];")
        out.append("  }")
    for edge in view.edges:
        if edge.shape_only:
            continue  # the consumer reads only a size: no data flows (see view.py)
        if edge.broadcast:
            style = f' [color="{BROADCAST_COLOR}", style=dashed, penwidth=1.6, class="broadcast"]'
        else:
            style = ""
        out.append(f"  {edge.src} -> {edge.dst}{style};")
    out.append("}")
    return "\n".join(out) + "\n"


def dot_available() -> bool:
    return shutil.which("dot") is not None


def run_dot(dot_text: str, fmt: str = "svg", timeout: float = 120.0) -> str:
    """Render DOT text with Graphviz; raises :class:`DotNotFound` when ``dot`` is missing."""
    exe = shutil.which("dot")
    if exe is None:
        raise DotNotFound(
            "Graphviz 'dot' was not found on PATH; install Graphviz (e.g. apt-get install "
            "graphviz, brew install graphviz) or use --format dot or --format html"
        )
    proc = subprocess.run(
        [exe, f"-T{fmt}"], input=dot_text, capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise RuntimeError(f"dot failed: {proc.stderr.strip()[:500]}")
    return proc.stdout
