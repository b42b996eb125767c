"""share: run the request-only region once per request.

Identity: for a row-wise op f, ``f(gather(x, idx)) == gather(f(x), idx)``, gathering along the
values' batch axes (``analysis/batch_axis.py``). Request inputs arrive with R rows; every REQUEST node is
computed on them (R rows along its batch axis), and a *broadcast* is inserted on every edge
from a REQUEST value into a CANDIDATE consumer and on REQUEST graph outputs:
``index_select(x, axis.dim, idx)``, with a reshape on either side when the axis merges the
batch with other dims (``[R*H, L, d]`` is split to ``[R, H, L, d]``, gathered, and merged back).
CANDIDATE nodes compute exactly what the original graph computed, on N rows, so every node of
the new graph equals the original node gathered by ``idx`` (REQUEST) or equals it outright
(CANDIDATE, CONST). An op whose rows depend on which requests the candidates reference
(``rocs::nested_padding``: whether every referenced row is left aligned) is row-wise only with
the index given: its REQUEST copy takes ``candidate_to_request`` in the argument its role rule
names (``role_rules.request_index_argument``), and ``op(x[idx]) == op(x, idx)[idx]``.

Each node of the shared graph records its placement (``graph_meta.PLACEMENT``), a role: CONST
nodes are computed once, REQUEST nodes at R rows, CANDIDATE nodes (and broadcasts) at N rows.
Batch sizes are re-derived per consumer: an int that involves the batch symbol is emitted as an
expression in R (``size(request_input, 0)``) for REQUEST consumers and in N
(``size(candidate_to_request, 0)``) for CANDIDATE consumers.
"""

from __future__ import annotations

import operator
from typing import Any

import sympy
import torch
from torch import fx

from ..analysis.batch_axis import BatchAxis, row_dim, split_shape
from ..analysis.role_rules import request_index_argument
from ..errors import CompileError
from ..ir.graph_meta import BATCH_AXIS, BROADCAST, INDEX_NAME, PLACEMENT, ROLE
from ..ir.roles import Role
from ..ir.symbolic import emit_expr, expr_of

aten = torch.ops.aten


class _Emitter:
    def __init__(self, graph: fx.Graph, symbol: sympy.Symbol):
        self.graph = graph
        self.symbol = symbol
        self.env: dict[Role, dict[fx.Node, fx.Node]] = {role: {} for role in Role}
        self.broadcasts: dict[fx.Node, fx.Node] = {}
        self.scalars: dict[tuple[fx.Node, Role], Any] = {}
        self.index: fx.Node | None = None
        self.request_source: fx.Node | None = None
        self.sizes: dict[Role, fx.Node] = {}

    def size(self, placement: Role) -> fx.Node:
        """R (rows of a request input) or N (length of the index) as a graph value."""
        if placement not in self.sizes:
            source = self.index if placement == Role.CANDIDATE else self.request_source
            node = self.graph.call_function(aten.sym_size.int, (source, 0))
            node.meta[PLACEMENT] = placement
            self.sizes[placement] = node
        return self.sizes[placement]

    def get(self, node: fx.Node, placement: Role) -> Any:
        """``node``'s value as read by a consumer placed at ``placement``."""
        role = node.meta[ROLE]
        if role == Role.CONST:
            return self.env[Role.CONST][node]
        if role == Role.CANDIDATE:
            assert placement == Role.CANDIDATE, f"{node.name} is CANDIDATE, read at {placement.name}"
            return self.env[Role.CANDIDATE][node]
        if is_scalar_node(node):
            return self.scalar(node, Role.CANDIDATE if placement == Role.CANDIDATE else Role.REQUEST)
        if placement == Role.REQUEST:
            return self.env[Role.REQUEST][node]
        if node not in self.broadcasts:
            self.broadcasts[node] = self.broadcast(node)
        return self.broadcasts[node]

    def broadcast(self, node: fx.Node) -> fx.Node:
        """``node``'s R-row value gathered to N rows along its batch axis."""
        source = self.env[Role.REQUEST][node]
        axis: BatchAxis = node.meta[BATCH_AXIS]
        inherited = {k: v for k, v in source.meta.items() if k in ("val", "nn_module_stack")}
        shape = list(node.meta["val"].shape)
        if not axis.plain:
            rows = split_shape(shape, axis, self.size(Role.REQUEST))
            source = self.reshape(source, rows, Role.REQUEST, inherited)
        out = self.graph.call_function(
            aten.index_select.default, (source, row_dim(axis), self.index)
        )
        out.meta.update(inherited)
        out.meta[PLACEMENT] = Role.CANDIDATE
        out.meta[BROADCAST] = axis
        if not axis.plain:
            merged = shape[: axis.dim] + [self.merged_size(axis)] + shape[axis.dim + 1:]
            out = self.reshape(out, merged, Role.CANDIDATE, inherited)
        return out

    def merged_size(self, axis: BatchAxis) -> fx.Node:
        """``outer * N * inner`` as a graph value."""
        node = self.graph.call_function(
            operator.mul, (self.size(Role.CANDIDATE), axis.outer * axis.inner)
        )
        node.meta[PLACEMENT] = Role.CANDIDATE
        return node

    def reshape(self, x: fx.Node, shape: list, placement: Role, meta: dict) -> fx.Node:
        out = self.graph.call_function(aten.reshape.default, (x, [_size_arg(s) for s in shape]))
        out.meta.update(meta)
        out.meta[PLACEMENT] = placement
        return out

    def scalar(self, node: fx.Node, placement: Role) -> Any:
        """A batch-size value at ``placement``: sizes of tensors are re-derived from their sympy
        expression; arithmetic on sizes is copied with its operands taken at ``placement``."""
        key = (node, placement)
        if key not in self.scalars:
            if any(isinstance(a.meta.get("val"), torch.Tensor) for a in node.all_input_nodes):

                def call(fn, args):
                    new = self.graph.call_function(fn, args)
                    new.meta[PLACEMENT] = placement
                    return new

                expr = expr_of(node.meta["val"])
                value = emit_expr(expr, self.symbol, self.size(placement), call)
            else:
                value = self.graph.node_copy(node, lambda a: self.get(a, placement))
                value.meta[PLACEMENT] = placement
            self.scalars[key] = value
        return self.scalars[key]


def _own_placement(node: fx.Node) -> Role:
    """Where ``node``'s value is read from as it is: a constant anywhere."""
    return node.meta[ROLE]


def _size_arg(size: Any) -> Any:
    """A size for a reshape's shape list: graph values stay, concrete sizes become ints (a merged
    axis's other dims are concrete; ``batch_axis`` refuses the rest)."""
    return size if isinstance(size, fx.Node) else int(size)


def _pass_index(node: fx.Node, index: fx.Node) -> None:
    """A request-placed op that reads which requests the call's candidates reference
    (``role_rules.request_index_argument``) gets ``candidate_to_request`` in that argument,
    positionally (the runtime calls ``rocs::`` ops with positional arguments)."""
    name = request_index_argument(node.target)
    if name is None:
        return
    schema = node.target._schema.arguments
    names = [a.name for a in schema]
    bound = {**dict(zip(names, node.args)), **node.kwargs, name: index}
    count = max(len(node.args), names.index(name) + 1)
    node.args = tuple(bound.get(a.name, a.default_value) for a in schema[:count])
    node.kwargs = {k: v for k, v in node.kwargs.items() if names.index(k) >= count}


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
    nodes = list(gm.graph.nodes)
    for node in (n for n in nodes if n.op == "placeholder"):
        role = node.meta[ROLE]
        new = graph.placeholder(node.name)
        new.meta.update(node.meta)
        new.meta[PLACEMENT] = role
        emit.env[role][node] = new
        if role == Role.REQUEST and emit.request_source is None:
            emit.request_source = new
    emit.index = graph.placeholder(INDEX_NAME)
    emit.index.meta[PLACEMENT] = Role.CANDIDATE
    for node in (n for n in nodes if n.op not in ("placeholder", "output")):
        role = node.meta[ROLE]
        if role == Role.REQUEST and is_scalar_node(node):
            continue  # batch sizes are emitted per consumer placement
        if role == Role.CONST and is_scalar_node(node) and node.all_input_nodes:
            # A size of the call (a history's width), read off its inputs where they are.
            new = graph.node_copy(node, lambda a: emit.get(a, _own_placement(a)))
            new.meta[PLACEMENT] = max(map(_own_placement, node.all_input_nodes))
            emit.env[role][node] = new
            continue
        new = graph.node_copy(node, lambda a, r=role: emit.get(a, r))
        new.meta[PLACEMENT] = role
        if role == Role.REQUEST:
            _pass_index(new, emit.index)
        emit.env[role][node] = new
    output = nodes[-1]
    graph.output(fx.map_arg(output.args[0], lambda a: emit.get(a, Role.CANDIDATE)))
    graph.eliminate_dead_code()
    out = fx.GraphModule(gm, graph)
    out.graph.lint()
    return out
