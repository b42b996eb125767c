"""Dropout draws eager's mask: its input in eager's memory layout, and eager's dropout kernel.

A CPU dropout draws its mask into ``empty_like(input)`` (``aten::dropout``'s
``_dropout_impl``), so the mask element the k-th random number lands on depends on the input's
*memory order*, not only its shape: ``dropout(x)`` and ``dropout(x.t().contiguous().t())`` draw
the same numbers and put them on different elements. The shared graph may hand a dropout its
input in another layout than eager had (a broadcast ``index_select`` and fused ops return
contiguous tensors where eager held a transposed view), and functionalization turns
``aten.dropout`` into ``native_dropout``, whose CPU kernel draws into a contiguous mask whatever
the input's layout. Either way the compiled call would draw the same count of numbers as eager
(the generator state after the call is equal) and a different mask.

:func:`record_random_layouts` (on the captured graph, whose fake values have eager's strides)
restores ``aten.dropout`` where functionalization wrote ``native_dropout(x, p, train)[0]`` and
notes on every dropout in training mode its input's dim order (outermost first,
``graph_meta.EAGER_LAYOUT``); :func:`restore_random_layouts` (on the shared graph, last) puts an
:func:`in_layout` before each such dropout whose input might differ. Identity: ``in_layout(x,
order)`` equals ``x`` (a copy into that memory order where ``x`` has another), so values and
gradients are unchanged and the draws land where eager's did.
"""

from __future__ import annotations

import operator
from typing import Sequence

import torch
from torch import fx

from ..analysis.op_groups import dropout_in_training
from ..ir.graph_meta import EAGER_LAYOUT, PLACEMENT

aten = torch.ops.aten


def _order(shape: Sequence[int], strides: Sequence[int]) -> tuple[int, ...]:
    """Dims from outermost to innermost in memory (a stable sort: ties keep dim order)."""
    return tuple(sorted(range(len(shape)), key=lambda d: -strides[d]))


def _hint(value) -> int:
    if isinstance(value, torch.SymInt):
        return value.node.hint if value.node.hint is not None else 2
    return int(value)


def record_random_layouts(gm: fx.GraphModule) -> None:
    """Restore ``aten.dropout`` from ``native_dropout`` and note each training dropout's input
    layout (module docstring); in place."""
    for node in list(gm.graph.nodes):
        if node.target is aten.native_dropout.default:
            _restore_dropout(gm.graph, node)
    for node in gm.graph.nodes:
        if not dropout_in_training(node) or not isinstance(node.args[0], fx.Node):
            continue
        value = node.args[0].meta.get("val")
        if isinstance(value, torch.Tensor) and value.dim() > 1:
            shape = [_hint(s) for s in value.shape]
            node.meta[EAGER_LAYOUT] = _order(shape, [_hint(s) for s in value.stride()])
    gm.recompile()


def _restore_dropout(graph: fx.Graph, node: fx.Node) -> None:
    users = list(node.users)
    if not all(u.target is operator.getitem and u.args[1] == 0 for u in users):
        return  # the mask is read: the model asked for native_dropout itself
    with graph.inserting_before(node):
        dropout = graph.call_function(aten.dropout.default, tuple(node.args[:3]), dict(node.kwargs))
    for user in users:
        dropout.meta.update(user.meta)
        user.replace_all_uses_with(dropout)
        graph.erase_node(user)
    graph.erase_node(node)


def restore_random_layouts(gm: fx.GraphModule) -> int:
    """Put :func:`in_layout` before every dropout with a noted layout that is not plain row-major
    (module docstring); returns how many. In place."""
    count = 0
    for node in list(gm.graph.nodes):
        order = node.meta.get(EAGER_LAYOUT)
        if order is None or not dropout_in_training(node):
            continue
        source = node.args[0]
        with gm.graph.inserting_before(node):
            arranged = gm.graph.call_function(in_layout, (source, order))
        arranged.meta.update({k: v for k, v in source.meta.items() if k == "val"})
        arranged.meta[PLACEMENT] = node.meta.get(PLACEMENT)
        node.replace_input_with(source, arranged)
        count += 1
    if count:
        gm.recompile()
    return count


def in_layout(x: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """``x``, copied into the memory order ``order`` (outermost dim first) unless its dims of
    more than one element already lie in that order."""
    shape, strides = x.shape, x.stride()
    placed = [d for d in _order(shape, strides) if shape[d] > 1]
    if placed == [d for d in order if shape[d] > 1] and _dense(shape, strides, placed):
        return x
    return torch.empty_permuted(shape, order, dtype=x.dtype, device=x.device).copy_(x)


def _dense(shape, strides, placed: list[int]) -> bool:
    """Whether the dims ``placed`` (outermost first) tile memory without gaps or overlap."""
    expected = 1
    for d in reversed(placed):
        if strides[d] != expected:
            return False
        expected *= shape[d]
    return True
