"""The shared graph cut in two at the request boundary, for the request cache.

The request program computes, from the request inputs alone, the *boundary values*: the
request-placed values that the rest of the graph reads. The rest program is the shared graph
with those values taken as inputs; it still receives every input of the shared graph (request
inputs included, for sizes and for the few request-side reshapes it recomputes).

Identity: a value placed REQUEST is row-wise along its batch axis (the analysis gave it that
axis, ``graph_meta.BATCH_AXIS``, only after its rule said the op commutes with gathering rows),
so row r of a boundary value is a function of request r's inputs alone. Hence boundary values
computed for any subset of requests, put together row by row, equal the boundary values of the
whole batch, and the rest program on them computes the shared graph's outputs.

Only values that carry a batch axis can be cut row by row. A request-placed value read by the
rest without one (a reshape that a fusion made after the analysis, e.g. history keys merged
with their positions for a fused GEMM) is recomputed by the rest program from its own inputs,
walking up until every value read across the cut has an axis. A request-placed node of the
request program without an axis has no row-wise guarantee: the split is refused, with the node
named, and the model runs without the cache.

A request-placed node that reads an input other than the request inputs
(``rocs::nested_padding`` reads ``candidate_to_request``: whether it zeroes depends on every
request of the call) is no function of its request's inputs alone: it and what it feeds stay in
the rest program, which computes them at R rows from the boundary values of the call's requests.

A request program that draws random numbers (a dropout in training mode placed per request,
``Options.request_dropout == "per_request"``) is refused too: its rows are no function of the
request's inputs, and a cached row would replay the draws of the call that computed it.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch
from torch import fx

from ...analysis.batch_axis import BatchAxis
from ...analysis.op_groups import dropout_in_training, is_random
from ...ir.graph_meta import BATCH_AXIS, PLACEMENT
from ...ir.roles import Role
from ...ir.symbolic import expr_of


class SplitRefused(Exception):
    """The graph cannot be cut into a request program and the rest (the message says why)."""


@dataclass
class RequestSplit:
    """The two programs' graphs and what crosses between them.

    ``request_graph`` takes the shared graph's request inputs (in the shared graph's order, at
    ``request_positions`` of its inputs) and returns a tuple of the boundary values;
    ``rest_graph`` takes the shared graph's inputs followed by the boundary values.
    """

    request_graph: fx.Graph
    rest_graph: fx.Graph
    request_positions: list[int]
    axes: list[BatchAxis]  # per boundary value, where its request rows lie
    names: list[str]  # per boundary value, its node in the shared graph (for reports)
    recomputed: list[str]  # request-placed nodes the rest program computes again


def split_request_region(gm: fx.GraphModule) -> RequestSplit:
    """Cut ``gm`` (a shared graph: every node has a ``PLACEMENT``) at the request boundary;
    raises :class:`SplitRefused` when it has no request region or one without row guarantees."""
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    requests = [n for n in placeholders if n.meta.get(PLACEMENT) == Role.REQUEST]
    if not requests:
        raise SplitRefused("the model has no request inputs")
    symbol = _batch_symbol(requests)
    on_request = _request_region(nodes, requests)
    crossing = [n for n in nodes if n in on_request and any(u not in on_request for u in n.users)]
    boundary: dict[fx.Node, BatchAxis] = {}
    recomputed: set[fx.Node] = set()
    todo = list(crossing)
    while todo:
        node = todo.pop()
        if node in boundary or node in recomputed:
            continue
        axis = _axis(node, symbol)
        if axis is not None:
            boundary[node] = axis
            continue
        recomputed.add(node)
        todo.extend(a for a in node.all_input_nodes if a in on_request)
    if not boundary:
        raise SplitRefused("no request-side value with a batch axis reaches the candidates")
    order = {n: i for i, n in enumerate(nodes)}
    cut = sorted(boundary, key=order.__getitem__)
    request_graph = _request_graph(nodes, requests, cut, symbol)
    rest_graph = _rest_graph(gm.graph, cut)
    return RequestSplit(
        request_graph,
        rest_graph,
        [placeholders.index(n) for n in requests],
        [boundary[n] for n in cut],
        [n.name for n in cut],
        sorted(n.name for n in recomputed),
    )


def _request_region(nodes: list[fx.Node], requests: list[fx.Node]) -> set[fx.Node]:
    """The request-placed nodes computed from the request inputs alone. A request-placed node
    that reads another input (``candidate_to_request``, which ``rocs::nested_padding`` reads to
    know which requests the call holds) depends on the call's other requests too: it stays in
    the rest program, which runs it on the boundary values of all the call's requests."""
    reads_others = {n for n in nodes if n.op == "placeholder" and n not in requests}
    for node in nodes:
        if any(a in reads_others for a in node.all_input_nodes):
            reads_others.add(node)
    return {
        n for n in nodes
        if n.meta.get(PLACEMENT) == Role.REQUEST and n.op != "placeholder" and n not in reads_others
    }  # fmt: skip


def _batch_symbol(requests: list[fx.Node]) -> sympy.Symbol:
    for node in requests:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dim():
            expr = expr_of(val.shape[0])
            if expr is not None and isinstance(expr, sympy.Symbol):
                return expr
    raise SplitRefused("the request inputs' row count is not symbolic")


def _axis(node: fx.Node, symbol: sympy.Symbol) -> BatchAxis | None:
    """``node``'s batch axis when it is a tensor whose recorded axis agrees with its size."""
    axis, val = node.meta.get(BATCH_AXIS), node.meta.get("val")
    if not isinstance(axis, BatchAxis) or not isinstance(val, torch.Tensor):
        return None
    if axis.dim >= val.dim():
        return None
    expr = expr_of(val.shape[axis.dim])
    if expr is None or sympy.simplify(expr - axis.size(symbol)) != 0:
        return None
    return axis


def _request_graph(nodes, requests, cut, symbol) -> fx.Graph:
    """The nodes the boundary values need, each checked to be row-wise or constant."""
    needed: set[fx.Node] = set()
    todo = list(cut)
    while todo:
        node = todo.pop()
        if node not in needed:
            needed.add(node)
            todo.extend(node.all_input_nodes)
    stray = [n for n in needed if n.op == "placeholder" and n not in requests]
    if stray:
        raise SplitRefused(f"request values read non-request input(s) {[n.name for n in stray]}")
    # In graph order, every random draw before any other reason: the refusal names the same
    # node on every compile, and the reason a cache can never lift first.
    computed = [n for n in nodes if n in needed and n.op == "call_function"]
    for node in computed:
        if is_random(node.target) or dropout_in_training(node):
            raise SplitRefused(
                f"request node {node.name} ({node.target}) draws random numbers: a cached row "
                "would replay the draws of the call that computed it"
            )
    for node in computed:
        if node.meta.get(PLACEMENT) != Role.REQUEST:
            continue
        if node.meta.get(BATCH_AXIS) is None and _sized_by_batch(node, symbol):
            raise SplitRefused(
                f"request node {node.name} ({node.target}) has no batch axis, so nothing shows "
                "that it keeps requests apart"
            )
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in requests:
        env[node] = graph.placeholder(node.name)
        env[node].meta.update(node.meta)
    for node in nodes:
        if node in needed and node.op != "placeholder":
            env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[n] for n in cut))
    return graph


def _sized_by_batch(node: fx.Node, symbol: sympy.Symbol) -> bool:
    """Whether ``node``'s value (a tensor, or tensors) has a dim that involves the batch."""
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    for v in vals:
        if isinstance(v, torch.Tensor):
            for size in v.shape:
                expr = expr_of(size)
                if expr is not None and symbol in expr.free_symbols:
                    return True
    return False


def _rest_graph(graph: fx.Graph, cut: list[fx.Node]) -> fx.Graph:
    """``graph`` with every boundary value read from a new trailing input."""
    rest = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    nodes = list(graph.nodes)
    for node in nodes:
        if node.op == "placeholder":
            env[node] = rest.node_copy(node, env.__getitem__)
    for node in cut:
        new = rest.placeholder(f"boundary_{node.name}")
        new.meta.update(node.meta)
        env[node] = new
    for node in nodes:
        if node.op != "placeholder" and node not in env:
            env[node] = rest.node_copy(node, env.__getitem__)
    _drop_unread(rest)
    return rest


def _drop_unread(graph: fx.Graph) -> None:
    """Remove the nodes the output does not read. Not ``Graph.eliminate_dead_code``: it keeps
    ops tagged random (attention with a dropout argument), and the shared graph has value
    semantics (no mutation), so what the output does not read is dead."""
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    read, todo = set(), [output]
    while todo:
        node = todo.pop()
        if node not in read:
            read.add(node)
            todo.extend(node.all_input_nodes)
    for node in reversed(list(graph.nodes)):
        if node not in read and node.op != "placeholder":
            graph.erase_node(node)
