"""Role rules of the lookups: embeddings and embedding bags, one-hot, gather and indexing.

A constant table looked up with batched ids is row-wise: each output row reads its own ids
(``out[b] == table[ids[b]]``); a lookup is not row-wise when the table itself is batched or
the lookup runs along the batch dim.
"""

from __future__ import annotations

from typing import Optional

import torch

from .rule_registry import ROWWISE, Lane, RuleContext, register
from ..ir.roles import Role

aten = torch.ops.aten


@register(aten.gather)
def _gather(ctx: RuleContext) -> Optional[str]:
    if ctx.on_batch_axis(ctx.batched_dim()[0], ctx.arg("dim")):
        return "gathers along the batch dim"
    if ctx.role(ctx.arg("self")) == Role.CONST or ctx.role(ctx.arg("index")) == Role.CONST:
        return "gather between a batched and an unbatched tensor mixes rows"
    return ROWWISE


@register(aten.embedding, lane=Lane.LOOKUP)
def table_lookup_rule(ctx: RuleContext) -> Optional[str]:
    """A constant table looked up with batched ids: each output row reads its own ids."""
    if ctx.role(ctx.arg("weight")) != Role.CONST:
        return "the embedding table itself is batched"
    return ROWWISE


@register(aten.one_hot, lane=Lane.LOOKUP)
def _one_hot(ctx: RuleContext) -> Optional[str]:
    """``one_hot(x, K)``: a lookup of ``x`` in the K x K identity, once ``K`` is given."""
    if ctx.arg("num_classes", -1) < 0:
        return "the number of classes is the batch's largest id"
    return ROWWISE


@register(aten.embedding_bag, aten._embedding_bag)
def _embedding_bag(ctx: RuleContext) -> Optional[str]:
    if ctx.role(ctx.arg("weight")) != Role.CONST:
        return "the embedding table itself is batched"
    if ctx.val(ctx.arg("indices")).dim() != 2:
        return "1-D indices with offsets pool across the batch"
    axis = ctx.axis(ctx.arg("indices"))
    if axis is None:
        return "per-sample weights are batched, the bags are not"
    if axis.dim != 0:
        return "pools along the batch dim"
    return ROWWISE


@register(aten.index.Tensor)
def _index(ctx: RuleContext) -> Optional[str]:
    """``x[..., i, ...]`` with index tensors. A constant table looked up with batched indices is
    row-wise along the indices' batch (an embedding written as indexing); a batched tensor
    indexed with constant indices is row-wise unless an index runs along its batch dim."""
    x_node, indices = ctx.arg("self"), list(ctx.arg("indices"))
    positions = [i for i, ix in enumerate(indices) if ix is not None]
    if ctx.role(x_node) == Role.CONST:
        return ROWWISE
    if any(ctx.on_batch_axis(x_node, i) for i in positions):
        return "indexes the batch dim"
    if any(ctx.role(indices[i]) != Role.CONST for i in positions):
        return "batched index into a batched tensor"
    return ROWWISE
