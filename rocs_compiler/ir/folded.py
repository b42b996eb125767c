"""Folded constants and the recipes that evaluate them again.

*cleanup* evaluates weight-only subgraphs once (the column slices of a weight that
``split_linear`` makes, a GLM weight times its mask) and stores each result in a buffer of the
graph module. The buffer is a copy: when the weights change, it must be evaluated again. So the
``get_attr`` node that reads it records, under ``graph_meta.FOLD``, a :class:`Fold`: the subgraph
as a small ``fx.Graph`` whose leaves are ``get_attr`` nodes naming the graph module's own
attributes (weights and constants, never another fold: a fold of folds inlines their recipes).
The runtime (``runtime/follow/weights.py``) evaluates it on the graph module's current attributes.

Identity: ``Fold.of(node).evaluate(gm)`` equals the value ``node`` computes in ``gm``, for every
value of ``gm``'s weights (it runs the same ops on the same attributes).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from .graph_meta import FOLD


@dataclass(frozen=True, eq=False)
class Fold:
    """The weight-only subgraph a folded constant was evaluated from."""

    graph: fx.Graph

    @property
    def sources(self) -> frozenset[str]:
        """The graph module attributes the recipe reads."""
        return frozenset(n.target for n in self.graph.nodes if n.op == "get_attr")

    def evaluate(self, module: torch.nn.Module) -> torch.Tensor:
        """The folded value from ``module``'s current attributes (contiguous, as folded)."""
        env: dict[fx.Node, object] = {}
        with torch.no_grad():
            for node in self.graph.nodes:
                if node.op == "get_attr":
                    env[node] = operator.attrgetter(node.target)(module)
                elif node.op == "call_function":
                    args, kwargs = fx.map_arg((node.args, node.kwargs), env.__getitem__)
                    env[node] = node.target(*args, **kwargs)
                elif node.op == "output":
                    return env[node.args[0]].contiguous()
        raise ValueError("a fold recipe without an output")

    @staticmethod
    def of(node: fx.Node) -> "Fold":
        """The recipe of ``node``, whose inputs all come from ``get_attr`` nodes."""
        order = {n: i for i, n in enumerate(node.graph.nodes)}
        needed, stack = {node}, [node]
        while stack:
            for arg in stack.pop().all_input_nodes:
                if arg not in needed:
                    needed.add(arg)
                    if arg.op != "get_attr":
                        stack.append(arg)
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for n in sorted(needed, key=order.__getitem__):
            if n.op == "get_attr":
                inner = n.meta.get(FOLD)
                if inner is not None:
                    env[n] = graph.graph_copy(inner.graph, {})
                else:
                    env[n] = graph.get_attr(n.target)
            else:
                env[n] = graph.node_copy(n, env.__getitem__)
                env[n].meta = {}
        graph.output(env[node])
        return Fold(graph)


def fresh_attr(gm: fx.GraphModule, base: str) -> str:
    """``base``, or ``base_1``, ``base_2``, ...: the first name ``gm`` has no attribute of (for a
    folded constant's buffer, or a weight moved in from an inlined subgraph)."""
    name, i = base, 0
    while hasattr(gm, name):
        i += 1
        name = f"{base}_{i}"
    return name
