"""defer, identity 1: a contraction over a concatenated axis splits into a sum of partials.

For a constant weight W whose columns are split like the pieces of ``cat(u, c)``,

    ``linear(cat(u, c), W, b) == linear(u, W_u) + linear(c, W_c, b)``,

and likewise ``matmul(W, cat(u, c, dim=-2)) == W_u @ u + W_c @ c`` (linear compression), einsum
contracting the concatenated letter, and ``sum`` over the concatenated dim. The request piece's
partial is request-only and runs once per request. Precision of the split sums: see
``defer.py`` (``float32_partials``).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import fx

from ..ir.roles import Role
from .concat import Concat, mixed_concat, role_of, val_of
from .engine import Builder, Rewrite

aten = torch.ops.aten


def _select_columns(
    b: Builder, weight: fx.Node, dim: int, ranges: list[tuple[int, int]]
) -> fx.Node:
    parts = [b.call(aten.slice.Tensor, weight, dim, lo, hi) for lo, hi in ranges]
    return parts[0] if len(parts) == 1 else b.call(aten.cat.default, parts, dim)


def _join(b: Builder, pieces: list[fx.Node], dim: int) -> fx.Node:
    return pieces[0] if len(pieces) == 1 else b.call(aten.cat.default, pieces, dim)


LOW_PRECISION = (torch.float16, torch.bfloat16)


class _Partials:
    """How the partial contractions of one split are computed and summed.

    ``wide`` is set for a low-precision result when float32 partials are asked for: every
    operand of a partial is cast to float32 (weights fold to float32 copies at compile time)
    and the sum of the partials is rounded once to the original dtype.
    """

    def __init__(self, b: Builder, node: fx.Node, float32_partials: bool):
        val = node.meta.get("val")
        dtype = val.dtype if isinstance(val, torch.Tensor) else None
        self.b, self.dtype = b, dtype
        self.wide = float32_partials and dtype in LOW_PRECISION

    def operand(self, x: Optional[fx.Node]) -> Optional[fx.Node]:
        if not self.wide or x is None or val_of(x).dtype not in LOW_PRECISION:
            return x
        return self.b.call(aten._to_copy.default, x, dtype=torch.float32)

    def total(self, rest: fx.Node, req: fx.Node) -> fx.Node:
        out = self.b.call(aten.add.Tensor, rest, req)
        return self.b.call(aten._to_copy.default, out, dtype=self.dtype) if self.wide else out


def _split_by_role(info: Concat) -> list[tuple[list[fx.Node], list[tuple[int, int]]]]:
    """Pieces and their ranges, request pieces first, then the rest."""
    groups: dict[bool, tuple[list, list]] = {True: ([], []), False: ([], [])}
    for piece, span in zip(info.pieces, info.offsets):
        group = groups[role_of(piece) == Role.REQUEST]
        group[0].append(piece)
        group[1].append(span)
    return [groups[True], groups[False]]


def _split_linear(b: Builder, node: fx.Node, float32_partials: bool) -> Optional[fx.Node]:
    x, weight = node.args[0], node.args[1]
    bias = node.args[2] if len(node.args) > 2 else None
    info = mixed_concat(x)
    if info is None or info.dim != info.ndim - 1 or role_of(weight) != Role.CONST:
        return None
    (req, req_spans), (rest, rest_spans) = _split_by_role(info)
    p = _Partials(b, node, float32_partials)
    y_req = b.call(
        aten.linear.default,
        p.operand(_join(b, req, info.dim)),
        p.operand(_select_columns(b, weight, 1, req_spans)),
    )
    y_rest = b.call(
        aten.linear.default,
        p.operand(_join(b, rest, info.dim)),
        p.operand(_select_columns(b, weight, 1, rest_spans)),
        p.operand(bias),
    )
    return p.total(y_rest, y_req)


def _split_matmul(b: Builder, node: fx.Node, float32_partials: bool) -> Optional[fx.Node]:
    """``matmul(W, cat(..., dim=-2))`` with a constant W [M, K]: the linear-compression form."""
    a, x = node.args[0], node.args[1]
    info = mixed_concat(x)
    if info is None or info.dim != info.ndim - 2 or role_of(a) != Role.CONST:
        return None
    if val_of(a).dim() != 2:
        return None
    (req, req_spans), (rest, rest_spans) = _split_by_role(info)
    p = _Partials(b, node, float32_partials)
    y_req = b.call(
        aten.matmul.default,
        p.operand(_select_columns(b, a, 1, req_spans)),
        p.operand(_join(b, req, info.dim)),
    )
    y_rest = b.call(
        aten.matmul.default,
        p.operand(_select_columns(b, a, 1, rest_spans)),
        p.operand(_join(b, rest, info.dim)),
    )
    return p.total(y_rest, y_req)


def _split_einsum(b: Builder, node: fx.Node, float32_partials: bool) -> Optional[fx.Node]:
    equation, operands = node.args[0], list(node.args[1])
    equation = equation.replace(" ", "")
    if "..." in equation or "->" not in equation or len(operands) != 2:
        return None
    lhs, out = equation.split("->")
    specs = lhs.split(",")
    for pos in range(2):
        info = mixed_concat(operands[pos])
        other = operands[1 - pos]
        if info is None or role_of(other) != Role.CONST:
            continue
        letter = specs[pos][info.dim]
        if letter in out or specs[pos].count(letter) != 1 or specs[1 - pos].count(letter) != 1:
            continue
        other_dim = specs[1 - pos].index(letter)
        broadcasts = val_of(other).shape[other_dim] == 1  # einsum broadcasts a size-1 dim
        p = _Partials(b, node, float32_partials)
        terms = []
        for pieces, spans in _split_by_role(info):
            new_ops = [None, None]
            new_ops[pos] = _join(b, pieces, info.dim)
            new_ops[1 - pos] = other if broadcasts else _select_columns(b, other, other_dim, spans)
            terms.append(b.call(aten.einsum.default, equation, [p.operand(o) for o in new_ops]))
        return p.total(terms[1], terms[0])
    return None


def _split_sum(b: Builder, node: fx.Node, float32_partials: bool) -> Optional[fx.Node]:
    x, dims = node.args[0], node.args[1] if len(node.args) > 1 else None
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    info = mixed_concat(x)
    if info is None or dims is None or len(dims) != 1 or dims[0] % info.ndim != info.dim:
        return None
    if node.kwargs.get("dtype") is not None:
        return None
    p = _Partials(b, node, float32_partials)
    terms = [
        b.call(aten.sum.dim_IntList, p.operand(_join(b, pieces, info.dim)), [info.dim], keepdim)
        for pieces, _ in _split_by_role(info)
    ]
    return p.total(terms[1], terms[0])


def split_rewrites(float32_partials: bool) -> list[Rewrite]:
    """The splits of identity 1; ``float32_partials``: see ``defer.py`` (precision)."""
    splits = [
        ("split_linear", {aten.linear}, _split_linear),
        ("split_matmul", {aten.matmul}, _split_matmul),
        ("split_einsum", {aten.einsum}, _split_einsum),
        ("split_sum", {aten.sum}, _split_sum),
    ]
    return [
        Rewrite(name, frozenset(ops), functools.partial(fn, float32_partials=float32_partials))
        for name, ops, fn in splits
    ]
