"""Role rules of the ops that torch.nn layers call: linear maps and products, einsum,
attention, layer/group/batch norms, convolutions, recurrent layers, prelu and dropout.

A layer whose weights are constant is row-wise unless it contracts, normalizes or convolves
over the batch dim; a random op (dropout, attention dropout) is row-wise only where it draws
per request (``request_dropout.py``).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import op_groups
from .request_dropout import dropout_is_per_request
from .rule_families import (
    contracting_rule,
    elementwise_rule,
    last_dim,
    matrix_dims,
    second_last_dim,
)
from .rule_registry import ROWWISE, Lane, RuleContext, register
from ..ir.roles import Role

aten = torch.ops.aten

# Elementwise ops need no registration: ``lookup`` gives every member of the family
# ``elementwise_rule``. prelu is elementwise but aligns its weight with dim 1, never the batch dim.
register(aten.prelu)(elementwise_rule)


@register(aten.dropout, aten.feature_dropout, aten.alpha_dropout, lane=Lane.ELEMENTWISE)
def _dropout(ctx: RuleContext) -> Optional[str]:
    # ``p == 0`` returns its input without drawing (``aten::dropout``), in training mode too.
    if ctx.arg("train") and ctx.arg("p") and not dropout_is_per_request():
        return "dropout in training mode is random"
    return ROWWISE


@register(aten.linear, lane=Lane.LINEAR)
def _linear(ctx: RuleContext) -> Optional[str]:
    if ctx.role(ctx.arg("weight")) != Role.CONST or ctx.role(ctx.arg("bias")) != Role.CONST:
        return "the weight is batched"
    x = ctx.arg("input")
    if ctx.on_batch_axis(x, -1):
        return "the batch dim is the contracted dim"
    return ROWWISE


_mm_rule = contracting_rule(("mat1", last_dim), ("mat2", second_last_dim))
_bmm_rule = contracting_rule(
    ("self", last_dim), ("batch1", last_dim), ("mat2", second_last_dim), ("batch2", second_last_dim)
)
register(aten.mm, lane=Lane.PRODUCT)(_mm_rule)
register(aten.addmm, lane=Lane.BIASED_PRODUCT)(_mm_rule)
register(aten.bmm, lane=Lane.PRODUCT)(_bmm_rule)
register(aten.baddbmm, lane=Lane.BIASED_PRODUCT)(_bmm_rule)
register(aten.matmul, lane=Lane.PRODUCT)(
    contracting_rule(("self", last_dim), ("other", second_last_dim))
)


@register(aten.einsum, lane=Lane.EINSUM)
def _einsum(ctx: RuleContext) -> Optional[str]:
    """Row-wise when every batched operand carries its batch under one letter, which the output
    keeps and no constant operand uses."""
    equation = ctx.arg("equation").replace(" ", "")
    if "..." in equation or "->" not in equation:
        return "einsum with ellipsis or implicit output"
    lhs, out_spec = equation.split("->")
    specs = lhs.split(",")
    operands = ctx.arg("tensors")
    batched = [(spec, x) for spec, x in zip(specs, operands) if ctx.role(x) != Role.CONST]
    letters = {spec[ctx.axis(x).dim] for spec, x in batched}
    if len(letters) != 1:
        return "batched operands disagree on the batch letter"
    (letter,) = letters
    if letter not in out_spec:
        return "contracts the batch letter"
    for spec, x in zip(specs, operands):
        if ctx.role(x) == Role.CONST and letter in spec:
            return "a constant operand shares the batch letter"
        if ctx.role(x) != Role.CONST and spec.count(letter) != 1:
            return "the batch letter repeats within an operand"
    return ROWWISE


_sdpa_products = contracting_rule(
    ("query", matrix_dims), ("key", matrix_dims), ("value", matrix_dims),
    ("attn_mask", matrix_dims),
)  # fmt: skip


@register(aten.scaled_dot_product_attention, lane=Lane.ATTENTION)
def _sdpa(ctx: RuleContext) -> Optional[str]:
    # With ``request_dropout="per_request"`` request-only attention draws one mask per request,
    # as a dropout does (:func:`dropout_per_request`).
    if ctx.arg("dropout_p", 0.0) and not dropout_is_per_request():
        return "attention dropout is random"
    return _sdpa_products(ctx)


@register(*op_groups.TRAILING_NORMS, lane=Lane.TRAILING_NORM)
@register(aten.native_layer_norm)
def _layer_norm(ctx: RuleContext) -> Optional[str]:
    x = ctx.arg("input")
    if ctx.on_batch_axis(x, -1) or (
        ctx.axis(x) is not None
        and ctx.axis(x).dim >= ctx.val(x).dim() - len(ctx.arg("normalized_shape"))
    ):
        return "normalizes over the batch dim"
    for name in ("weight", "bias"):
        if ctx.role(ctx.arg(name)) != Role.CONST:
            return f"batched {name}"
    return ROWWISE


@register(aten.group_norm, aten.native_group_norm)
def _group_norm(ctx: RuleContext) -> Optional[str]:
    axis = ctx.axis(ctx.arg("input"))
    if axis is not None and axis.dim != 0:
        return "normalizes over the batch dim"
    for name in ("weight", "bias"):
        if ctx.role(ctx.arg(name)) != Role.CONST:
            return f"batched {name}"
    return ROWWISE


@register(aten.batch_norm, aten._native_batch_norm_legit_no_training, aten.native_batch_norm)
def _batch_norm(ctx: RuleContext) -> Optional[str]:
    if ctx.arg("training", False):
        return "batch norm in training mode uses batch statistics"
    for name in ("weight", "bias", "running_mean", "running_var"):
        if ctx.role(ctx.arg(name)) != Role.CONST:
            return f"batched {name}"
    return ROWWISE


@register(aten.conv1d, aten.conv2d, aten.convolution)
def _conv(ctx: RuleContext) -> Optional[str]:
    if ctx.role(ctx.arg("weight")) != Role.CONST or ctx.role(ctx.arg("bias")) != Role.CONST:
        return "the convolution weight is batched"
    axis = ctx.axis(ctx.arg("input"))
    if axis is not None and axis.dim != 0:
        return "convolves over the batch dim"
    return ROWWISE


@register(aten.gru.input, aten.lstm.input, aten.rnn_tanh.input, aten.rnn_relu.input)
def _recurrent(ctx: RuleContext) -> Optional[str]:
    """torch's RNN, GRU and LSTM over a padded sequence: each sequence of the batch runs on its
    own, along dim 0 of ``input`` when ``batch_first`` (else dim 1) and dim 1 of every state."""
    if ctx.arg("train") and ctx.arg("dropout"):
        return "recurrent dropout in training mode is random"
    if ctx.role(ctx.arg("params")) != Role.CONST:
        return "the recurrent weights are batched"
    x = ctx.arg("input")
    sequence_batch = 0 if ctx.arg("batch_first") else 1
    if ctx.role(x) != Role.CONST and not ctx.on_batch_axis(x, sequence_batch):
        return "the batch is not the input's batch dim"
    states = ctx.arg("hx")
    for state in states if isinstance(states, (list, tuple)) else [states]:
        if ctx.role(state) != Role.CONST and not ctx.on_batch_axis(state, 1):
            return "the batch is not the state's batch dim"
    return ROWWISE
