"""Where a request-side value carries the batch: one dim, possibly merged with others.

A REQUEST value holds one row per request along its *batch axis*. The axis is a dim of the
tensor, anywhere in its shape (``[L, B, D]`` for a sequence-first history, ``[layers, B, H]``
for an RNN state), and that dim may be the batch merged with other dims in row-major order: the
heads-into-batch reshape of attention gives ``[B*H, L, d]``, where the batch is the *outer*
factor of dim 0, and ``[L*B, E]`` has it as the inner one. :class:`BatchAxis` records the dim and
the sizes merged before (``outer``) and after (``inner``) the batch, so that dim's size is
``outer * B * inner``; plain batch dims have ``outer == inner == 1``. It plays the role of a
vmap batching rule's batch dim, extended by the merge factors.

Identity (gathering rows along an axis): writing the tensor as ``[pre, outer, B, inner, post]``
(the axis split into its factors), gathering requests by ``idx`` is ``x'[..., o, j, i, ...] =
x[..., o, idx[j], i, ...]``. An op is row-wise for its input axes when it commutes with that
gather; its output axis is then found here: the one output dim whose size involves the batch
symbol, with the merge factors of the inputs whose axis has the same size. Reshapes re-merge
dims, so their output axis is derived from the elements that follow the batch in row-major
order (:func:`reshape_axis`), which a reshape leaves unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Union

import sympy
import torch

from ..ir.symbolic import expr_of


@dataclass(frozen=True)
class BatchAxis:
    """Dim ``dim`` holds the batch, merged as ``[outer, B, inner]`` in row-major order."""

    dim: int
    outer: int = 1
    inner: int = 1

    @property
    def plain(self) -> bool:
        return self.outer == 1 and self.inner == 1

    def size(self, symbol: sympy.Symbol) -> sympy.Expr:
        return self.outer * symbol * self.inner

    def __str__(self) -> str:
        if self.plain:
            return f"dim {self.dim}"
        merged = [str(self.outer)] * (self.outer > 1) + ["B"] + [str(self.inner)] * (self.inner > 1)
        return f"dim {self.dim} ({'*'.join(merged)})"


LEADING = BatchAxis(0)

# An op's output axes: one per tensor output (None for an output that is not batched).
Axes = Union[BatchAxis, tuple[Optional[BatchAxis], ...]]


def batch_dims(val: torch.Tensor, symbol: sympy.Symbol) -> list[int]:
    """The dims of ``val`` whose size involves the batch symbol."""
    return [d for d, size in enumerate(val.shape) if _involves(size, symbol)]


def _involves(size: Any, symbol: sympy.Symbol) -> bool:
    expr = expr_of(size)
    return expr is not None and symbol in expr.free_symbols


def _coefficient(size: Any, symbol: sympy.Symbol) -> Optional[int]:
    """``k`` when ``size == k * symbol`` for a positive integer ``k``, else None."""
    expr = expr_of(size)
    if expr is None:
        return None
    k = sympy.simplify(expr / symbol)
    return int(k) if k.is_Integer and k > 0 else None


def output_axis(
    val: Any, inputs: Iterable[BatchAxis], symbol: sympy.Symbol, *, sized_from_batch: bool
) -> Union[BatchAxis, str]:
    """The axis of one output of a row-wise op, or the reason it has none.

    ``inputs`` are the axes of the op's batched tensor operands; their merge factors carry over
    to the output dim of the same size. ``sized_from_batch``: the op also takes the batch size
    as a number (a factory such as ``zeros(layers, B, H)``), so an output without batched
    operands still has a batch axis: a plain one, whose rows are all alike (the rules refuse
    batch sizes anywhere but in sizes); a merged one would have an unknown order.
    """
    inputs = list(inputs)
    if not isinstance(val, torch.Tensor):
        return "the output is not a tensor"
    dims = batch_dims(val, symbol)
    if not dims:
        return "the output has no batch dim"
    if len(dims) > 1:
        return "the batch size appears in several dims"
    (dim,) = dims
    coefficient = _coefficient(val.shape[dim], symbol)
    if coefficient is None:
        return f"the batch dim has size {val.shape[dim]}, not a multiple of the batch size"
    size = expr_of(val.shape[dim])
    same = {(a.outer, a.inner) for a in inputs if sympy.simplify(a.size(symbol) - size) == 0}
    if len(same) > 1:
        return "batched operands merge the batch with other dims in different orders"
    if same:
        ((outer, inner),) = same
        if (outer, inner) != (1, 1) and _product(val.shape[:dim] + val.shape[dim + 1:]) is None:
            return "the batch is merged with other dims beside a dynamic size"
        return BatchAxis(dim, outer, inner)
    if inputs:
        return "the batch dim changes size"
    if not sized_from_batch:
        return "the batch size appears without a batched operand"
    if coefficient != 1:
        # ``const[2, D].repeat(B, 1)`` is [B, 2] merged, ``zeros(2 * B)`` either: unknown order.
        return "the batch is merged with another dim in an unknown order"
    return BatchAxis(dim)


def reshape_axis(
    source: torch.Tensor, axis: BatchAxis, out: torch.Tensor, symbol: sympy.Symbol
) -> Union[BatchAxis, str]:
    """The output axis of a reshape (any op keeping the row-major order of the elements).

    The elements after the batch in row-major order, ``inner * prod(source.shape[axis.dim+1:])``,
    are the same before and after a reshape; the output axis is the dim whose trailing
    elements divide that count, with the quotient as its new ``inner`` factor.
    """
    after = _product(source.shape[axis.dim + 1:])
    before = _product(source.shape[: axis.dim])
    dims = batch_dims(out, symbol)
    if after is None or before is None or len(dims) != 1:
        return "reshape mixes the batch with a dynamic size"
    after, before = axis.inner * after, axis.outer * before
    (dim,) = dims
    trailing = _product(out.shape[dim + 1:])
    leading = _product(out.shape[:dim])
    if trailing is None or leading is None or after % trailing or before % leading:
        return "reshape splits the batch dim"
    axis_out = BatchAxis(dim, before // leading, after // trailing)
    if sympy.simplify(axis_out.size(symbol) - expr_of(out.shape[dim])) != 0:
        return "reshape splits the batch dim"
    return axis_out


def _product(sizes: Iterable[Any]) -> Optional[int]:
    """The product of concrete sizes; None when one is symbolic."""
    values = []
    for size in sizes:
        expr = expr_of(size)
        if expr is None or not expr.is_Integer:
            return None
        values.append(int(expr))
    return math.prod(values)


def split_shape(shape: Iterable[Any], axis: BatchAxis, rows: Any) -> list[Any]:
    """``shape`` with the axis dim written as ``[outer, rows, inner]`` (factors of 1 dropped)."""
    shape = list(shape)
    factors = [axis.outer] * (axis.outer > 1) + [rows] + [axis.inner] * (axis.inner > 1)
    return shape[: axis.dim] + factors + shape[axis.dim + 1:]


def row_dim(axis: BatchAxis) -> int:
    """The dim of the request rows once the axis is split by :func:`split_shape`."""
    return axis.dim + (axis.outer > 1)


def gather_rows(x: torch.Tensor, axis: BatchAxis, index: torch.Tensor) -> torch.Tensor:
    """Eager form of a broadcast: the rows ``index`` of ``x`` along ``axis``."""
    split = x.reshape(split_shape(x.shape, axis, -1))
    out = split.index_select(row_dim(axis), index)
    shape = list(x.shape)
    shape[axis.dim] = axis.outer * index.numel() * axis.inner
    return out.reshape(shape)
