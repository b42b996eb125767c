"""share: run the request-only region once per request.

Identity: for a row-wise op f, ``f(x[idx]) == f(x)[idx]``. Request inputs arrive with R rows;
every REQUEST node is computed on them (R rows), and ``index_select(x, 0, idx)`` (a *broadcast*)
is inserted on every edge from a REQUEST value into a CANDIDATE consumer and on REQUEST graph
outputs. CANDIDATE nodes compute exactly what the original graph computed, on N rows, so every
node of the new graph equals the original node gathered by ``idx`` (REQUEST) or equals it
outright (CANDIDATE, CONST).

Batch sizes are re-derived per consumer: an int that involves the batch symbol is emitted as an
expression in R (``size(request_input, 0)``) for REQUEST consumers and in N
(``size(candidate_to_request, 0)``) for CANDIDATE consumers.
"""

from __future__ import annotations

from typing import Any

import sympy
import torch
from torch import fx

from ..analysis import ROLE
from ..errors import CompileError
from ..roles import Role
from ..symbolic import emit_expr, expr_of

aten = torch.ops.aten
INDEX_NAME = "candidate_to_request"
DOMAIN = "rocs_domain"  # "R", "N" or "C": how many rows a node of the shared graph has
DOMAIN_ORDER = {"C": 0, "R": 1, "N": 2}  # a node never reads a value of a later domain
BROADCAST = "rocs_broadcast"


class _Emitter:
    def __init__(self, graph: fx.Graph, symbol: sympy.Symbol):
        self.graph = graph
        self.symbol = symbol
        self.env = {"C": {}, "R": {}, "N": {}}
        self.broadcasts: dict[fx.Node, fx.Node] = {}
        self.scalars: dict[tuple[fx.Node, str], Any] = {}
        self.index: fx.Node | None = None
        self.request_source: fx.Node | None = None
        self.sizes: dict[str, fx.Node] = {}

    def size(self, domain: str) -> fx.Node:
        if domain not in self.sizes:
            source = self.index if domain == "N" else self.request_source
            node = self.graph.call_function(aten.sym_size.int, (source, 0))
            node.meta[DOMAIN] = domain
            self.sizes[domain] = node
        return self.sizes[domain]

    def get(self, node: fx.Node, domain: str) -> Any:
        role = node.meta[ROLE]
        if role == Role.CONST:
            return self.env["C"][node]
        if role == Role.CANDIDATE:
            assert domain == "N", f"{node.name} is CANDIDATE but wanted in domain {domain}"
            return self.env["N"][node]
        if is_scalar_node(node):
            return self.scalar(node, "N" if domain == "N" else "R")
        if domain == "R":
            return self.env["R"][node]
        if node not in self.broadcasts:
            source = self.env["R"][node]
            out = self.graph.call_function(aten.index_select.default, (source, 0, self.index))
            out.meta.update({k: v for k, v in source.meta.items() if k in ("val", "nn_module_stack")})
            out.meta[DOMAIN] = "N"
            out.meta[BROADCAST] = True
            self.broadcasts[node] = out
        return self.broadcasts[node]

    def scalar(self, node: fx.Node, domain: str) -> Any:
        """A batch-size value for ``domain``: sizes of tensors are re-derived from their sympy
        expression; arithmetic on sizes is copied with its operands taken in ``domain``."""
        key = (node, domain)
        if key not in self.scalars:
            if any(isinstance(a.meta.get("val"), torch.Tensor) for a in node.all_input_nodes):

                def call(fn, args):
                    new = self.graph.call_function(fn, args)
                    new.meta[DOMAIN] = domain
                    return new

                expr = expr_of(node.meta["val"])
                value = emit_expr(expr, self.symbol, self.size(domain), call)
            else:
                value = self.graph.node_copy(node, lambda a: self.get(a, domain))
                value.meta[DOMAIN] = domain
            self.scalars[key] = value
        return self.scalars[key]


def is_scalar_node(node: fx.Node) -> bool:
    """A node whose value is a number (a batch size, say) rather than tensors."""
    return not isinstance(node.meta.get("val"), (torch.Tensor, list, tuple))


def share(gm: fx.GraphModule, symbol: sympy.Symbol) -> fx.GraphModule:
    """Return the shared-layout graph; it takes one more input, ``candidate_to_request``."""
    graph = fx.Graph()
    emit = _Emitter(graph, symbol)
    names = {n.name for n in gm.graph.nodes if n.op == "placeholder"}
    if INDEX_NAME in names:
        raise CompileError(f"the model has an input named {INDEX_NAME!r}, which rocs reserves")
    domain_of = {Role.CONST: "C", Role.REQUEST: "R", Role.CANDIDATE: "N"}
    nodes = list(gm.graph.nodes)
    for node in (n for n in nodes if n.op == "placeholder"):
        role = node.meta[ROLE]
        new = graph.placeholder(node.name)
        new.meta.update(node.meta)
        new.meta[DOMAIN] = domain_of[role]
        emit.env[domain_of[role]][node] = new
        if role == Role.REQUEST and emit.request_source is None:
            emit.request_source = new
    emit.index = graph.placeholder(INDEX_NAME)
    emit.index.meta[DOMAIN] = "N"
    for node in (n for n in nodes if n.op not in ("placeholder", "output")):
        role = node.meta[ROLE]
        if role == Role.REQUEST and is_scalar_node(node):
            continue  # batch sizes are emitted per consumer domain
        domain = domain_of[role]
        new = graph.node_copy(node, lambda a, d=domain: emit.get(a, d))
        new.meta[DOMAIN] = domain
        emit.env[domain][node] = new
    output = nodes[-1]
    graph.output(fx.map_arg(output.args[0], lambda a: emit.get(a, "N")))
    graph.eliminate_dead_code()
    out = fx.GraphModule(gm, graph)
    out.graph.lint()
    return out
