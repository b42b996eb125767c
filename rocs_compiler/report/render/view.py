"""The drawing model: a graph of role-coloured nodes and edges, built from a compiled model.

Two sources:

- :func:`view_from_pipeline`: the graph as captured (``graph="captured"``: the model as written,
  roles of the first analysis) or the *logical* graph (after defer, before share) with the roles
  of the analysis and the FLOPs of the cost model. Broadcast edges are the data edges from a
  REQUEST node into a CANDIDATE node (or the output): where the shared graph gathers request rows.
- :func:`view_from_exported`: an exported shared-layout program (``rocs.export`` or a saved
  ``.pt2``). Roles follow from the row count of each value: R rows is REQUEST, N rows is
  CANDIDATE, neither is CONST; FLOPs come from running every node on fake tensors at three
  (R, N) sizes, since each node's cost is affine in R and N.

Sizes (``x.size(0)``) are not drawn as nodes; an edge that reaches a node only through sizes is
*shape-only* (``ViewEdge.shape_only``): the consumer reads the producer's shape, not its values,
so a request-side ``view`` sized from a candidate input does not depend on the candidate. Shape
edges are never broadcasts. Shapes name the batch symbol: ``[B, 13]`` (``[R, 13]`` and
``[N, 13]`` in a shared-layout program).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import sympy
import torch
from torch import fx

from ...analysis.driver import op_name, source_module
from ...analysis.flops import flops_at
from ...ir.graph_meta import BATCH_AXIS, INDEX_NAME, REASON, ROLE
from ...ir.roles import Role

ROLES = ("REQUEST", "CANDIDATE", "CONST")
UNIT = {"REQUEST": "/req", "CANDIDATE": "/cand", "CONST": ""}


@dataclass
class ViewNode:
    id: str  # unique, safe in DOT, SVG ids and HTML
    name: str
    op: str  # full op name, e.g. "aten.linear.default" or "input"
    role: str  # "REQUEST" | "CANDIDATE" | "CONST"
    module: str = ""
    flops: float = 0.0  # per request (REQUEST), per candidate (CANDIDATE), once (CONST)
    shape: str = ""
    broadcast: bool = False  # its value is read by candidate computation (gathered by request)
    fused: bool = False  # a rocs:: fused op
    axis: str = ""  # where a request value holds its requests, e.g. "requests along dim 1"
    reason: str = ""  # why a node that saw only request inputs runs per candidate

    @property
    def short_op(self) -> str:
        """``linear`` for ``aten.linear.default``; ``rocs.broadcast_linear`` for rocs ops."""
        parts = self.op.split(".")
        if len(parts) >= 2 and parts[0] in ("aten", "prims"):
            return parts[1]
        if len(parts) >= 2 and parts[0] == "rocs":
            return "rocs." + parts[1]
        return self.op


@dataclass
class ViewEdge:
    src: str
    dst: str
    broadcast: bool = False
    shape_only: bool = False  # the consumer reads only sizes of the producer


@dataclass
class GraphView:
    title: str
    nodes: list[ViewNode] = field(default_factory=list)
    edges: list[ViewEdge] = field(default_factory=list)
    kind: str = "logical"  # "captured" | "logical" | "shared"

    def node(self, node_id: str) -> ViewNode:
        return self._by_id()[node_id]

    def _by_id(self) -> dict[str, ViewNode]:
        return {n.id: n for n in self.nodes}

    def roles(self) -> set[str]:
        return {n.role for n in self.nodes}


def _ident(name: str) -> str:
    return "n_" + "".join(c if c.isalnum() or c == "_" else "_" for c in name)


def shape_text(val: Any, names: Optional[dict] = None) -> str:
    """``[B, 13]``: the shape of ``val`` with the symbols in ``names`` renamed (symbol -> name)."""
    shape = getattr(val, "shape", None)
    if shape is None:
        return ""
    rename = {k: sympy.Symbol(v) for k, v in (names or {}).items() if k is not None}

    def size(s: Any) -> str:
        if isinstance(s, torch.SymInt) and rename:
            return str(s.node.expr.xreplace(rename))
        return str(s)

    return "[" + ", ".join(size(s) for s in shape) + "]"


def axis_text(axis: Any) -> str:
    """``requests along dim 1`` for a :class:`~rocs_compiler.analysis.batch_axis.BatchAxis`."""
    if axis is None:
        return ""
    if isinstance(axis, tuple):
        parts = [axis_text(a) for a in axis]
        return "; ".join(f"item {i}: {p}" for i, p in enumerate(parts) if p)
    text = str(axis)  # "dim 1" or "dim 0 (4*B)"
    return f"requests along {text}"


def _has_tensor(val: Any) -> bool:
    if isinstance(val, torch.Tensor):
        return True
    return isinstance(val, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in val)


def _connect(view: GraphView, graph: fx.Graph, keep: dict[fx.Node, ViewNode]) -> None:
    """Edges between kept nodes. A dropped node (a size, a weight) is looked through; what is
    reached only through a dropped computation (a size) is a shape-only edge."""
    for node in graph.nodes:
        if node not in keep:
            continue
        data: dict[fx.Node, None] = {}
        sizes: dict[fx.Node, None] = {}
        stack = [(arg, False) for arg in node.all_input_nodes]
        seen: set = set()
        while stack:
            arg, through_size = stack.pop()
            if (arg, through_size) in seen:
                continue
            seen.add((arg, through_size))
            if arg in keep:
                (sizes if through_size else data)[arg] = None
            elif arg.op == "call_function":
                stack.extend((a, True) for a in arg.all_input_nodes)
        dst = keep[node]
        for arg in data:
            src = keep[arg]
            crosses = src.role == "REQUEST" and dst.role == "CANDIDATE"
            view.edges.append(ViewEdge(src.id, dst.id, crosses))
            if crosses:
                src.broadcast = True
        for arg in sizes:
            if arg not in data:
                view.edges.append(ViewEdge(keep[arg].id, dst.id, shape_only=True))


def node_flops(role: Role, cost: Any) -> float:
    """A node's FLOPs as reported: per row (request or candidate), or once for CONST."""
    if cost is None:
        return 0.0
    return cost.fixed if role == Role.CONST else cost.per_row


def view_from_pipeline(result, report=None, title: str = "", graph: str = "logical") -> GraphView:
    """The logical graph (``graph="logical"``) or the graph as captured (``"captured"``) of a
    :class:`~rocs_compiler.pipeline.PipelineResult`, with FLOPs from the cost model."""
    if graph == "captured":
        gm, costs = result.captured_graph, result.captured_costs
        default_title = "as written (captured, before rewrites)"
    else:
        gm, costs = result.logical_graph, result.costs
        default_title = "after rewrites (logical graph)"
    names = {result.captured.batch_symbol: "B"}
    view = GraphView(title or default_title, kind=graph)
    keep: dict[fx.Node, ViewNode] = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            item = ViewNode(_ident(node.name), "output", "output", "CANDIDATE")
        elif node.op in ("placeholder", "call_function") and _has_tensor(node.meta.get("val")):
            role = node.meta[ROLE]
            op = "input" if node.op == "placeholder" else op_name(node.target)
            item = ViewNode(
                _ident(node.name),
                node.name,
                op,
                role.name,
                source_module(node),
                node_flops(role, costs.get(node.name)),
                shape_text(node.meta.get("val"), names),
                fused=getattr(node.target, "namespace", "") == "rocs",
                axis=axis_text(node.meta.get(BATCH_AXIS)) if role == Role.REQUEST else "",
                reason=node.meta.get(REASON) or "",
            )
        else:
            continue
        keep[node] = item
        view.nodes.append(item)
    _connect(view, gm.graph, keep)
    return view


# -- exported programs ----------------------------------------------------------------------------


@dataclass
class ExportedCosts:
    """Per-node roles and affine FLOP costs ``per_request * R + per_candidate * N + fixed``."""

    roles: dict[str, str]
    per_request: dict[str, float]
    per_candidate: dict[str, float]
    fixed: dict[str, float]
    modules: dict[str, str]


def _size_symbols(program) -> tuple[Optional[sympy.Symbol], Optional[sympy.Symbol]]:
    """(R, N): N is the size of ``candidate_to_request``; R the other input batch size."""
    users = set(program.graph_signature.user_inputs)
    num_requests = num_candidates = None
    free = []
    for node in program.graph.nodes:
        if node.op != "placeholder" or node.name not in users:
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or not val.dim():
            continue
        size = val.shape[0]
        expr = size.node.expr if isinstance(size, torch.SymInt) else None
        if not isinstance(expr, sympy.Symbol):
            continue
        if node.name == INDEX_NAME:
            num_candidates = expr
        else:
            free.append(expr)
    others = [s for s in dict.fromkeys(free) if s != num_candidates]
    num_requests = others[0] if others else None
    return num_requests, num_candidates


def _role_of(val: Any, num_requests, num_candidates) -> str:
    tensors = (
        [val]
        if isinstance(val, torch.Tensor)
        else [
            v
            for v in (val if isinstance(val, (list, tuple)) else [])
            if isinstance(v, torch.Tensor)
        ]
    )
    symbols: set = set()
    for tensor in tensors:
        if tensor.dim():
            size = tensor.shape[0]
            if isinstance(size, torch.SymInt):
                symbols |= size.node.expr.free_symbols
    if num_candidates is not None and num_candidates in symbols:
        return "CANDIDATE"
    if num_requests is not None and num_requests in symbols:
        return "REQUEST"
    return "CONST"


def exported_costs(program) -> ExportedCosts:
    """Roles and FLOPs of every node of an exported shared-layout program."""
    num_requests, num_candidates = _size_symbols(program)
    base = {num_requests: 2, num_candidates: 2}
    base = {k: v for k, v in base.items() if k is not None}
    at_base = flops_at(program, base)
    more_requests = flops_at(program, {**base, num_requests: 3}) if num_requests else at_base
    more_candidates = flops_at(program, {**base, num_candidates: 3}) if num_candidates else at_base
    roles, per_req, per_cand, fixed, modules = {}, {}, {}, {}, {}
    for node in program.graph.nodes:
        if node.op not in ("placeholder", "call_function"):
            continue
        roles[node.name] = _role_of(node.meta.get("val"), num_requests, num_candidates)
        modules[node.name] = source_module(node)
        if node.name in at_base:
            a = float(more_requests[node.name] - at_base[node.name])
            b = float(more_candidates[node.name] - at_base[node.name])
            per_req[node.name], per_cand[node.name] = a, b
            fixed[node.name] = at_base[node.name] - 2 * a - 2 * b
    return ExportedCosts(roles, per_req, per_cand, fixed, modules)


def view_from_exported(
    program, costs: Optional[ExportedCosts] = None, title: str = ""
) -> GraphView:
    """The shared-layout graph of an exported program (weights and sizes left out)."""
    costs = costs or exported_costs(program)
    num_requests, num_candidates = _size_symbols(program)
    names = {num_requests: "R", num_candidates: "N"}
    users = set(program.graph_signature.user_inputs)
    view = GraphView(title or "shared-layout graph", kind="shared")
    keep: dict[fx.Node, ViewNode] = {}
    for node in program.graph.nodes:
        if node.op == "output":
            item = ViewNode(_ident(node.name), "output", "output", "CANDIDATE")
        elif node.op == "placeholder" and node.name in users:
            item = ViewNode(
                _ident(node.name),
                node.name,
                "input",
                costs.roles[node.name],
                "",
                0.0,
                shape_text(node.meta.get("val"), names),
            )
        elif node.op == "call_function" and _has_tensor(node.meta.get("val")):
            role = costs.roles[node.name]
            flops = {"REQUEST": costs.per_request, "CANDIDATE": costs.per_candidate}.get(
                role, costs.fixed
            ).get(node.name, 0.0)
            item = ViewNode(
                _ident(node.name),
                node.name,
                op_name(node.target),
                role,
                costs.modules.get(node.name, ""),
                flops,
                shape_text(node.meta.get("val"), names),
                fused=getattr(node.target, "namespace", "") == "rocs",
            )
        else:
            continue
        keep[node] = item
        view.nodes.append(item)
    _connect(view, program.graph, keep)
    return view
