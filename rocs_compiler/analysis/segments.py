"""Lanes: which columns of a value's last dim depend on request inputs only.

The role analysis gives a whole value one role. A GLM model's hidden states are CANDIDATE as a
whole while some of their last-dim columns (*request lanes*) are functions of request inputs only;
this module finds those columns on a captured graph, for the transforms that put GLM masks in.

The analysis runs the graph on the example batch and, beside each value ``v``, keeps a *taint*:
a bool tensor of ``v``'s shape, True where the element depends on a candidate input. Sizes and
positions are not inputs: a batch size carries no taint, nor does an ``arange`` over it (the
offsets of an embedding bag). Node by node:

- a node the role analysis calls CONST or REQUEST: no taint (the lane rules below give none
  either: ``tests/analysis/test_lane_rules.py`` checks that they agree);
- elementwise ops: the OR of the operands' taints, broadcast to the output;
- data movement (views, slices, ``cat``, permutes, ``index_select``, ...): the op itself applied
  to the taint, exact because these ops move elements without combining them;
- contractions (``linear``, ``mm``, ``bmm``, ``matmul``, ``einsum``): the op applied to 0/1 taints
  with all-ones in place of the other operand, ``> 0``. No weight value is read, so an incidental
  zero in a weight never makes a lane request-only (structural zeros only: a GLM layer's masked
  block is not computed at all by its forward, so its graph carries the lanes);
- reductions and ops along one dim: OR over the reduced dims; trailing norms: OR over the
  normalized dims; attention: a query row's taint is that of its query and mask rows and of all
  keys and values of its batch index;
- table lookups (``embedding``, ``one_hot``, ``rocs::embedding_bag_rows``): an output row's taint
  is that of its ids;
- any other op with a role rule: tainted everywhere when any input is; a random op or one without
  a role rule: tainted everywhere.

Which rule an op follows is its :class:`~rocs_compiler.analysis.role_rules.Lane`, declared with
its role rule; this module keeps one taint rule per lane.

Every rule over-approximates the true dependence, so a lane called request is request-only. The
request lanes of ``v`` are the columns ``j`` with ``taint[..., j]`` False at every index.
A *visitor* may replace a node's taint (the GLM planner predicts the lanes of a layer it is about
to transform); it sees each node after its inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from . import op_groups, role_rules
from .role_rules import Lane, bind_arguments
from ..ir.graph_meta import ROLE
from ..ir.roles import Role

__all__ = ["Ranges", "lane_ranges", "request_columns", "run_taints"]

# (start, stop) column ranges, sorted and disjoint.
Ranges = tuple[tuple[int, int], ...]

Visitor = Callable[[fx.Node, Any, dict], Any | None]


def request_columns(taint: torch.Tensor) -> torch.Tensor:
    """Bool [D]: the last-dim columns of a value with no tainted element."""
    if taint.dim() == 0:
        return ~taint.reshape(1)
    return ~taint.reshape(-1, taint.shape[-1]).any(0)


def lane_ranges(columns: torch.Tensor) -> Ranges:
    """The True runs of a bool [D] vector as (start, stop) ranges."""
    ranges, start = [], None
    for j, flag in enumerate(columns.tolist() + [False]):
        if flag and start is None:
            start = j
        elif not flag and start is not None:
            ranges.append((start, j))
            start = None
    return tuple(ranges)


def run_taints(
    gm: fx.GraphModule,
    inputs: Sequence[torch.Tensor],
    visitor: Visitor | None = None,
    trust_roles: bool = True,
) -> tuple[dict[fx.Node, Any], dict[fx.Node, Any]]:
    """Run ``gm`` (roles in its meta) on ``inputs``; return (values, taints) per node.

    ``visitor(node, value, taints)`` may return a taint that replaces the rules' answer.
    ``trust_roles=False`` takes only the inputs' roles and derives every op's taint from the lane
    rules (to check the two analyses against each other).
    """
    values: dict[fx.Node, Any] = {}

    class _Record(fx.Interpreter):
        def run_node(self, n):
            values[n] = super().run_node(n)
            return values[n]

    with torch.no_grad():
        _Record(gm).run(*inputs)
    taints: dict[fx.Node, Any] = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        value = values[node]
        taint = visitor(node, value, taints) if visitor is not None else None
        if taint is None:
            request_side = node.meta.get(ROLE, Role.CANDIDATE) <= Role.REQUEST
            if request_side and (trust_roles or node.op != "call_function"):
                taint = _clean(value)
            else:
                taint = _node_taint(node, value, taints, values)
        taints[node] = taint
    return values, taints


def _clean(value: Any) -> Any:
    return pytree.tree_map(
        lambda v: torch.zeros(v.shape, dtype=torch.bool) if isinstance(v, torch.Tensor) else None,
        value,
    )


def _dirty(value: Any) -> Any:
    return pytree.tree_map(
        lambda v: torch.ones(v.shape, dtype=torch.bool) if isinstance(v, torch.Tensor) else None,
        value,
    )


def _node_taint(node: fx.Node, value: Any, taints: dict, values: dict) -> Any:
    lane = role_rules.lane_of(node.target) if node.op == "call_function" else None
    if lane is None or op_groups.is_random(node.target):
        return _dirty(value)
    if lane not in _ANY_VALUE and not isinstance(value, torch.Tensor):
        return _dirty(value)
    try:
        taint = _TAINTS[lane](node, value, taints, values)
    except Exception:  # noqa: BLE001 - a rule that cannot apply falls back to "all tainted"
        taint = None
    return _dirty(value) if taint is None else taint


def _arg(a: Any, taints: dict, values: dict, as_taint: bool) -> Any:
    """An argument with nodes replaced by their taints (``as_taint``) or their values."""
    return fx.node.map_arg(a, lambda n: taints[n] if as_taint else values[n])


def _tainted(nodes: Sequence[fx.Node], taints: dict) -> bool:
    return any(
        isinstance(t, torch.Tensor) and bool(t.any())
        for n in nodes
        for t in pytree.tree_leaves(taints[n])
    )


# -- taint rules, one per lane (``role_rules.Lane``); an op's lane comes with its role rule ------


def _whole_taint(node: fx.Node, value: Any, taints: dict, values: dict) -> Any:
    tensors = [n for n in node.all_input_nodes if isinstance(values[n], torch.Tensor)]
    return _dirty(value) if _tainted(tensors, taints) else _clean(value)


def _item_taint(node: fx.Node, value: Any, taints: dict, values: dict) -> Any | None:
    parent = taints[node.args[0]]
    return parent[node.args[1]] if isinstance(parent, (list, tuple)) else None


def _elementwise_taint(node: fx.Node, value: Any, taints: dict, values: dict) -> Any:
    tensors = [n for n in node.all_input_nodes if isinstance(values[n], torch.Tensor)]
    # The taints' shapes, not the value's: a planned layer may have widened an operand.
    shapes = [taints[n].shape for n in tensors]
    shape = torch.broadcast_shapes(*shapes) if shapes else value.shape
    out = torch.zeros(shape, dtype=torch.bool)
    for n in tensors:
        out = out | torch.broadcast_to(taints[n], shape)
    return out


def _movement_taint(node: fx.Node, value: Any, taints: dict, values: dict) -> Any | None:
    data, moved = node.args[0], []
    fx.node.map_arg(data, moved.append)
    tensors = [n for n in node.all_input_nodes if isinstance(values[n], torch.Tensor)]
    if not tensors:
        return _clean(value)  # a factory (``zeros(B, D)``): its values read no input
    if _tainted([n for n in tensors if n not in moved], taints):
        return None
    args = (_arg(data, taints, values, True), *_arg(node.args[1:], taints, values, False))
    return node.target(*args, **_arg(node.kwargs, taints, values, False))


def _lookup_taint(node: fx.Node, value: Any, taints: dict, values: dict) -> Any | None:
    """``table[ids]`` (``[*I, D]``), or pooled over trailing id dims (``[B, L]`` ids -> ``[B, D]``):
    an output row reads the ids at its position and any row of the table."""
    arguments = bind_arguments(node)
    ids, table = arguments.get("indices", arguments.get("self")), arguments.get("weight")
    if isinstance(table, fx.Node) and _tainted([table], taints):
        return None
    taint = taints[ids]
    if taint.dim() >= value.dim():
        taint = taint.flatten(value.dim() - 1).any(-1)
    return taint.unsqueeze(-1).expand(value.shape).clone()


def _linear_taint(node: fx.Node, value: Any, taints: dict, values: dict) -> Any | None:
    x, rest = node.args[0], node.all_input_nodes[1:]
    if _tainted([n for n in rest if n is not x], taints):
        return None
    return taints[x].any(-1, keepdim=True).expand(value.shape).clone()


def _product_taint(node: fx.Node, value: Any, taints: dict, values: dict) -> Any:
    a, b = node.args[:2]
    ta, tb = taints[a].float(), taints[b].float()
    ones_a, ones_b = torch.ones(ta.shape), torch.ones(tb.shape)
    return (node.target(ta, ones_b) + node.target(ones_a, tb)) > 0


def _biased_product_taint(node: fx.Node, value: Any, taints: dict, values: dict) -> Any:
    bias, a, b = node.args[:3]
    product = (
        torch.matmul(taints[a].float(), torch.ones(taints[b].shape))
        + torch.matmul(torch.ones(taints[a].shape), taints[b].float())
    ) > 0
    return product | torch.broadcast_to(taints[bias], value.shape)


def _einsum_taint(node: fx.Node, value: Any, taints: dict, values: dict) -> Any:
    equation, operands = node.args[0], node.args[1]
    total = torch.zeros(value.shape)
    for i in range(len(operands)):
        terms = [
            taints[o].float() if j == i else torch.ones(taints[o].shape)
            for j, o in enumerate(operands)
        ]
        total = total + torch.einsum(equation, *terms)
    return total > 0


def _reduction_taint(node: fx.Node, value: Any, taints: dict, values: dict) -> Any | None:
    if len(node.args) < 2:
        return None
    dim = node.args[1] or None
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    source = taints[node.args[0]].float()
    return (source.sum(dim=dim, keepdim=keepdim) if dim else source.sum()) > 0


def _along_dim_taint(node: fx.Node, value: Any, taints: dict, values: dict) -> Any:
    return taints[node.args[0]].any(node.args[1], keepdim=True).expand(value.shape).clone()


def _trailing_norm_taint(node: fx.Node, value: Any, taints: dict, values: dict) -> Any | None:
    x, shape = node.args[0], node.args[1]
    if _tainted(node.all_input_nodes[1:], taints):
        return None
    dims = tuple(range(-len(shape), 0))
    return taints[x].any(dim=dims, keepdim=True).expand(value.shape).clone()


def _attention_taint(node: fx.Node, value: Any, taints: dict, values: dict) -> Any | None:
    """``sdpa(q, k, v, mask)`` [..., Lq, Dv]: query row ``i`` reads row ``i`` of ``q`` and of the
    mask and every key and value of its batch index."""
    q, k, v = node.args[:3]
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    # With grouped queries a query head reads another key head: OR over every head.
    first = -3 if node.kwargs.get("enable_gqa") else -2
    out = taints[q].any(-1, keepdim=True)  # [..., Lq, 1]
    for kv in (k, v):
        kv_taint = taints[kv].flatten(first).any(-1)
        out = out | kv_taint.reshape(*kv_taint.shape, *[1] * -first)
    if isinstance(mask, fx.Node):
        out = out | taints[mask].any(-1, keepdim=True)
    return torch.broadcast_to(out, value.shape).clone()


_TAINTS: dict[Lane, Callable[[fx.Node, Any, dict, dict], Any]] = {
    Lane.WHOLE: _whole_taint,
    Lane.ITEM: _item_taint,
    Lane.ELEMENTWISE: _elementwise_taint,
    Lane.MOVEMENT: _movement_taint,
    Lane.LOOKUP: _lookup_taint,
    Lane.LINEAR: _linear_taint,
    Lane.PRODUCT: _product_taint,
    Lane.BIASED_PRODUCT: _biased_product_taint,
    Lane.EINSUM: _einsum_taint,
    Lane.ATTENTION: _attention_taint,
    Lane.REDUCTION: _reduction_taint,
    Lane.ALONG_DIM: _along_dim_taint,
    Lane.TRAILING_NORM: _trailing_norm_taint,
}
# Lanes whose rule handles an output that is not one tensor (a tuple, a list of pieces).
_ANY_VALUE = frozenset({Lane.WHOLE, Lane.ITEM, Lane.MOVEMENT})
