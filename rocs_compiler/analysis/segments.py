"""Lanes: which columns of a value's last dim depend on request inputs only.

The role analysis gives a whole value one role. A GLM model's hidden states are CANDIDATE as a
whole while some of their last-dim columns (*request lanes*) are functions of request inputs only;
this module finds those columns on a captured graph, for the transforms that put GLM masks in.

The analysis runs the graph on the example batch and, beside each value ``v``, keeps a *taint*:
a bool tensor of ``v``'s shape, True where the element depends on a candidate input. Node by node:

- a node the role analysis calls CONST or REQUEST: no taint;
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
- anything else: tainted everywhere when any input is.

Every rule over-approximates the true dependence, so a lane called request is request-only. The
request lanes of ``v`` are the columns ``j`` with ``taint[..., j]`` False at every index.
A *visitor* may replace a node's taint (the GLM planner predicts the lanes of a layer it is about
to transform); it sees each node after its inputs.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from . import op_groups
from ..ir.graph_meta import ROLE
from ..ir.roles import Role

__all__ = ["Ranges", "lane_ranges", "request_columns", "run_taints"]

aten = torch.ops.aten

# (start, stop) column ranges, sorted and disjoint.
Ranges = tuple[tuple[int, int], ...]

Visitor = Callable[[fx.Node, Any, dict], Any | None]

_MOVEMENT = op_groups.SHAPE_ONLY | frozenset(
    {
        aten.cat, aten.stack, aten.split, aten.split_with_sizes, aten.chunk, aten.unbind,
        aten.tensor_split, aten.repeat, aten.index_select, aten.squeeze, aten.hstack,
        aten.flip, aten.roll,
    }
)
_PRODUCTS = frozenset({aten.mm, aten.bmm, aten.matmul})
# Reductions over some dims: an output element depends on the reduced elements only.
_REDUCTIONS = op_groups.REDUCTIONS_DIM_KEEPDIM | frozenset({aten.any, aten.all})


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
    gm: fx.GraphModule, inputs: Sequence[torch.Tensor], visitor: Visitor | None = None
) -> tuple[dict[fx.Node, Any], dict[fx.Node, Any]]:
    """Run ``gm`` (roles in its meta) on ``inputs``; return (values, taints) per node.

    ``visitor(node, value, taints)`` may return a taint that replaces the rules' answer.
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
            taint = _clean(value) if node.meta.get(ROLE, Role.CANDIDATE) <= Role.REQUEST else (
                _node_taint(node, value, taints, values)
            )
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
    if node.op == "placeholder":
        return _dirty(value)
    if node.op != "call_function":
        return _dirty(value)
    if node.target is operator.getitem:
        parent = taints[node.args[0]]
        return parent[node.args[1]] if isinstance(parent, (list, tuple)) else _dirty(value)
    try:
        taint = _rule(node, value, taints, values)
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


def _rule(node: fx.Node, value: Any, taints: dict, values: dict) -> Any | None:
    family = op_groups.packet(node.target)
    tensors = [n for n in node.all_input_nodes if isinstance(values[n], torch.Tensor)]
    if not isinstance(value, torch.Tensor) and family not in _MOVEMENT:
        return None
    if op_groups.is_elementwise(node.target):
        # The taints' shapes, not the value's: a planned layer may have widened an operand.
        shapes = [taints[n].shape for n in tensors]
        shape = torch.broadcast_shapes(*shapes) if shapes else value.shape
        out = torch.zeros(shape, dtype=torch.bool)
        for n in tensors:
            out = out | torch.broadcast_to(taints[n], shape)
        return out
    if family in _MOVEMENT:
        data, moved = node.args[0], []
        fx.node.map_arg(data, moved.append)
        others = [n for n in tensors if n not in moved]
        if _tainted(others, taints):
            return None
        args = (_arg(data, taints, values, True), *_arg(node.args[1:], taints, values, False))
        return node.target(*args, **_arg(node.kwargs, taints, values, False))
    if family is aten.linear:
        x, rest = node.args[0], node.all_input_nodes[1:]
        if _tainted([n for n in rest if n is not x], taints):
            return None
        return taints[x].any(-1, keepdim=True).expand(value.shape).clone()
    if family in _PRODUCTS:
        a, b = node.args[:2]
        ta, tb = taints[a].float(), taints[b].float()
        ones_a, ones_b = torch.ones(ta.shape), torch.ones(tb.shape)
        return (node.target(ta, ones_b) + node.target(ones_a, tb)) > 0
    if family in (aten.addmm, aten.baddbmm):
        bias, a, b = node.args[:3]
        product = (
            torch.matmul(taints[a].float(), torch.ones(taints[b].shape))
            + torch.matmul(torch.ones(taints[a].shape), taints[b].float())
        ) > 0
        return product | torch.broadcast_to(taints[bias], value.shape)
    if family is aten.einsum:
        equation, operands = node.args[0], node.args[1]
        total = torch.zeros(value.shape)
        for i in range(len(operands)):
            terms = [
                taints[o].float() if j == i else torch.ones(taints[o].shape)
                for j, o in enumerate(operands)
            ]
            total = total + torch.einsum(equation, *terms)
        return total > 0
    if family is aten.scaled_dot_product_attention:
        return _attention_taint(node, value, taints)
    if family in _REDUCTIONS and len(node.args) >= 2:
        dim = node.args[1] or None
        keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        source = taints[node.args[0]].float()
        return (source.sum(dim=dim, keepdim=keepdim) if dim else source.sum()) > 0
    if family in op_groups.ALONG_DIM_SAME_SHAPE:
        return taints[node.args[0]].any(node.args[1], keepdim=True).expand(value.shape).clone()
    if family in op_groups.TRAILING_NORMS:
        x, shape = node.args[0], node.args[1]
        if _tainted(node.all_input_nodes[1:], taints):
            return None
        dims = tuple(range(-len(shape), 0))
        return taints[x].any(dim=dims, keepdim=True).expand(value.shape).clone()
    return None


def _attention_taint(node: fx.Node, value: torch.Tensor, taints: dict) -> torch.Tensor | None:
    """``sdpa(q, k, v, mask)`` [..., Lq, Dv]: query row ``i`` reads row ``i`` of ``q`` and of the
    mask and every key and value of its batch index."""
    q, k, v = node.args[:3]
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    if node.kwargs.get("enable_gqa"):
        return None
    out = taints[q].any(-1, keepdim=True)  # [..., Lq, 1]
    for kv in (k, v):
        out = out | taints[kv].flatten(-2).any(-1)[..., None, None]
    if isinstance(mask, fx.Node):
        out = out | taints[mask].any(-1, keepdim=True)
    return torch.broadcast_to(out, value.shape).clone()
