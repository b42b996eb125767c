"""The cost of a call of a compiled graph as its direct program runs it (``direct.py``).

The graph's cost (``analysis/call_cost.py``: FLOPs, bytes and launches per node as expressions
over R, N and the lengths), with the nodes the program runs in place (``inplace.py``: an
elementwise op that overwrites a dying operand) allocating nothing.

Identity relied on: the program computes every call node of the graph once, with the same
arguments, through the op or its in-place variant; the plan here is ``inplace_plan`` on the
graph's order, the one the program takes unless it moves the request region first, which leaves
every node's last reader in place (request nodes only read request nodes).
"""

from __future__ import annotations

from typing import Mapping

from torch import fx

from rocs_compiler.analysis.call_cost import CallCost, call_cost
from rocs_compiler.runtime.program.direct import RUNNERS
from rocs_compiler.runtime.program.inplace import inplace_plan


def program_cost(gm: fx.GraphModule, placeholder_of: Mapping[str, str]) -> CallCost:
    """The :class:`CallCost` of a shared-layout call of ``gm`` (inputs named by
    ``placeholder_of``: input name -> placeholder name) as a direct program."""
    nodes = list(gm.graph.nodes)
    last_use = {arg: node for node in nodes for arg in node.all_input_nodes}
    in_place = {node.name for node in inplace_plan(nodes, last_use, set(RUNNERS))}
    return call_cost(gm, placeholder_of, in_place)
