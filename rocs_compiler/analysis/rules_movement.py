"""Role rules of the ops that move or copy elements by shape: views and copies, squeeze,
scatters of a slice, triangular masks, concatenation and stacking, flips, repeats, pads,
factories and tuple items.

Such an op is row-wise when the batch stays whole in one dim of its output (the driver checks
that as it derives the output's axis) and no batch size appears as a value; each rule below
refuses the ops that select, write, repeat or pad along the batch dim.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch

from . import op_groups
from .rule_families import along_dim_rule, matrix_dims, multi_dim_rule, shape_only_rule
from .rule_registry import ROWWISE, Lane, RuleContext, register
from ..ir.roles import Role

aten = torch.ops.aten

# Copies and conversions compute elementwise (their lane reads one element); the rest move.
_COPIES = frozenset(op for op in op_groups.SHAPE_ONLY if op_groups.is_elementwise(op))
register(*(op_groups.SHAPE_ONLY - _COPIES), lane=Lane.MOVEMENT)(shape_only_rule)
register(*_COPIES, lane=Lane.ELEMENTWISE)(shape_only_rule)


@register(aten.squeeze, lane=Lane.MOVEMENT)
def _squeeze(ctx: RuleContext) -> Optional[str]:
    if ctx.node.target == aten.squeeze.default:
        # squeeze() drops every size-1 dim: with one request the batch dim would vanish.
        return "squeeze() without dims would drop the batch dim when there is one request"
    dims = ctx.arg("dim")
    dims = [dims] if isinstance(dims, int) else list(dims)
    if any(ctx.on_batch_axis(ctx.node.args[0], d) for d in dims):
        return "squeezes the batch dim"
    return ROWWISE


@register(aten.slice_scatter)
def _slice_scatter(ctx: RuleContext) -> Optional[str]:
    """Functionalized ``x[:, a:b] = y``: row-wise when it writes along another dim than the batch
    dim, or when it writes every row (the result is then ``src`` itself)."""
    target = ctx.arg("self")
    if ctx.batch_scalars(exclude=frozenset({"start", "end"})):
        return "a scalar operand depends on the batch size"
    if ctx.role(target) == Role.CONST:
        return "writes batched rows into a constant"
    if ctx.on_batch_axis(target, ctx.arg("dim")):
        whole = ctx.arg("start") in (None, 0) and ctx.arg("step") == 1
        if not whole or tuple(ctx.val(ctx.arg("src")).shape) != tuple(ctx.val(target).shape):
            return "writes a range of batch rows"
    return ROWWISE


@register(aten.select_scatter)
def _select_scatter(ctx: RuleContext) -> Optional[str]:
    """Functionalized ``x[:, i] = y``."""
    if ctx.role(ctx.arg("self")) == Role.CONST:
        return "writes batched rows into a constant"
    if ctx.on_batch_axis(ctx.arg("self"), ctx.arg("dim")):
        return "writes one batch row"
    if ctx.batch_scalars():
        return "a scalar operand depends on the batch size"
    return ROWWISE


@register(aten.tril, aten.triu)
def _triangular(ctx: RuleContext) -> Optional[str]:
    x = ctx.node.args[0]
    if any(ctx.on_batch_axis(x, d) for d in matrix_dims(ctx.val(x).dim())):
        return "triangular mask over a matrix whose rows or columns are the batch"
    return ROWWISE


register(aten.cat, aten.concat, lane=Lane.MOVEMENT)(along_dim_rule("dim", default=0))


@register(aten.stack, lane=Lane.MOVEMENT)
def _stack(ctx: RuleContext) -> Optional[str]:
    """A new dim never splits the batch: stacking is row-wise at any position."""
    return ROWWISE


register(aten.flip, aten.roll, lane=Lane.MOVEMENT)(multi_dim_rule("dims"))


@register(aten.arange, aten.randperm)
def _values_from_batch_size(ctx: RuleContext) -> Optional[str]:
    return "values depend on the batch size"


@register(aten.repeat, lane=Lane.MOVEMENT)
def _repeat(ctx: RuleContext) -> Optional[str]:
    x = ctx.node.args[0]
    repeats = ctx.arg("repeats")
    lead = len(repeats) - ctx.val(x).dim()
    if ctx.axis(x) is not None and repeats[lead + ctx.axis(x).dim] != 1:
        return "repeats along the batch dim"
    return ROWWISE


@register(aten.repeat_interleave)
def _repeat_interleave(ctx: RuleContext) -> Optional[str]:
    d = ctx.arg("dim")
    if d is None or ctx.on_batch_axis(ctx.node.args[0], d):
        return "repeats along the batch dim"
    if ctx.role(ctx.arg("repeats")) != Role.CONST:
        return "repeat counts are batched"
    return ROWWISE


@register(aten.constant_pad_nd, aten.pad)
def _pad(ctx: RuleContext) -> Optional[str]:
    x = ctx.node.args[0]
    pad = list(ctx.arg("pad"))
    if ctx.axis(x) is None or ctx.batch_scalars():
        return "pads by the batch size"
    from_last = ctx.val(x).dim() - 1 - ctx.axis(x).dim  # pad pairs start at the last dim
    if any(p != 0 for p in pad[2 * from_last : 2 * from_last + 2]):
        return "pads the batch dim"
    return ROWWISE


@register(operator.getitem, lane=Lane.ITEM)
def _getitem(ctx: RuleContext) -> Optional[str]:
    return ROWWISE
