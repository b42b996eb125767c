"""Plain-text tables of graphs with roles and placements, for debugging and the CLI."""

from __future__ import annotations

from torch import fx

from ..analysis.driver import op_name, source_module
from ..ir.graph_meta import PLACEMENT, ROLE


def graph_table(gm: fx.GraphModule, width: int = 100) -> str:
    rows = []
    for node in gm.graph.nodes:
        role = node.meta.get(ROLE)
        placement = node.meta.get(PLACEMENT)
        target = op_name(node.target) if node.op == "call_function" else node.op
        shape = _shape(node.meta.get("val"))
        rows.append(
            f"{node.name[:28]:<28} {target[:36]:<36} {role.name if role is not None else '':<9} "
            f"{placement.name if placement is not None else '':<9} {shape[:30]:<30} {source_module(node)}"
        )
    return "\n".join(r[:width + 40] for r in rows)


def _shape(val) -> str:
    shape = getattr(val, "shape", None)
    if shape is None:
        return ""
    return "[" + ", ".join(str(s) for s in shape) + "]"
