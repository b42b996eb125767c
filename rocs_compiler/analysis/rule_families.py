"""Family helpers of the role rules: one rule (or rule maker) shared by every op of a family.

Each helper checks that the op does not act *along* a batch axis (reduce, contract, index it);
the driver checks the rest as it derives the output's batch axis (``role_rules.py``).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .rule_registry import ROWWISE, SHAPE_ARGUMENTS, Rule, RuleContext
from ..ir.roles import Role

aten = torch.ops.aten


def elementwise_rule(ctx: RuleContext) -> Optional[str]:
    """Broadcasting elementwise ops: row-wise when the batched operands' axes meet in one output
    dim, which the driver checks as it derives the output's axis."""
    if ctx.batch_scalars():
        return "a scalar operand depends on the batch size"
    return ROWWISE


def shape_only_rule(ctx: RuleContext) -> Optional[str]:
    """Ops that only move data by shape (views, permutes, expands, factories): row-wise whenever
    the output keeps the batch whole in one dim, which the driver checks as it derives the
    output's axis (selecting or slicing the batch dim leaves no dim of the batch size). Batch
    sizes may appear as sizes, never as values (a fill value, a select index)."""
    if ctx.batch_scalars(exclude=SHAPE_ARGUMENTS):
        return "a scalar operand depends on the batch size"
    return ROWWISE


def reduction_rule(dim_arg: str = "dim") -> Rule:
    def rule(ctx: RuleContext) -> Optional[str]:
        x = ctx.node.args[0]
        dims = ctx.arg(dim_arg)
        if dims is None or dims == []:
            return "reduces over every dim, the batch dim included"
        dims = [dims] if isinstance(dims, int) else list(dims)
        if any(ctx.on_batch_axis(x, d) for d in dims):
            return "reduces over the batch dim"
        return ROWWISE

    return rule


def along_dim_rule(dim_arg: str = "dim", default: int = 0) -> Rule:
    """Ops acting along one dim (softmax, cumsum, cat, slice, index_select...)."""

    def rule(ctx: RuleContext) -> Optional[str]:
        if ctx.batch_scalars():
            return "a scalar operand depends on the batch size"
        x, _ = ctx.batched_dim()
        d = ctx.arg(dim_arg, default)
        if d is None:
            return f"operates on the flattened tensor ({dim_arg}=None)"
        if x is not None and ctx.on_batch_axis(x, d):
            return "operates along the batch dim"
        if ctx.node.target.overloadpacket in _INDEX_ALONG_DIM:
            if ctx.role(ctx.arg("index")) != Role.CONST:
                return "index tensor is batched"
        return ROWWISE

    return rule


_INDEX_ALONG_DIM = {aten.index_select}


def multi_dim_rule(dim_arg: str) -> Rule:
    def rule(ctx: RuleContext) -> Optional[str]:
        x = ctx.node.args[0]
        dims = ctx.arg(dim_arg)
        dims = [dims] if isinstance(dims, int) else list(dims or [])
        if not dims:
            return f"operates on the flattened tensor ({dim_arg} empty)"
        if any(ctx.on_batch_axis(x, d) for d in dims):
            return "operates along the batch dim"
        return ROWWISE

    return rule


def contracting_rule(*contracted: tuple[str, Callable[[int], list[int]]]) -> Rule:
    """Products (matmul and kin): row-wise unless a batched operand's axis is among the dims the
    product contracts. ``contracted`` pairs an argument name with its contracted dims as a
    function of its rank; the other dims of both operands pass to the output, where the driver
    checks that the batched operands' axes meet."""

    def rule(ctx: RuleContext) -> Optional[str]:
        for name, dims_of in contracted:
            x = ctx.arg(name)
            if ctx.role(x) == Role.CONST or x is None:
                continue
            if any(ctx.on_batch_axis(x, d) for d in dims_of(ctx.val(x).dim())):
                return f"contracts the batch dim of {name}"
        return ROWWISE

    return rule


def last_dim(ndim: int) -> list[int]:
    return [ndim - 1]


def second_last_dim(ndim: int) -> list[int]:
    return [ndim - 2] if ndim >= 2 else [0]


def matrix_dims(ndim: int) -> list[int]:
    return [ndim - 2, ndim - 1]
