"""defer, identity 2: ops independent along the concatenated axis distribute over it.

``f(cat(u, c, d)) == cat(f(u), f(c), d')`` for elementwise ops (other operands sliced along
``d``, or reused whole where they broadcast), prelu, linear maps and matmuls on other dims, norms
and softmaxes over other dims, reductions over other dims, permutes, transposes, unsqueezes,
selects and slices that keep the axis, reshapes that keep it whole (``defer_reshape.py``) and
embedding lookups of concatenated ids. ``f(u)`` is request-only. Applied repeatedly this computes
K/V projections of a request history once per request, and turns a pairwise interaction
``bmm(T, T^T)`` over a stacked request/candidate feature set into blocks whose request-request
block runs once per request.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import fx

from ..analysis import op_groups
from ..analysis.request_dropout import dropout_is_per_request
from ..ir.roles import Role
from .concat import Concat, mixed_concat, role_of, val_of
from .defer_reshape import distribute_reshape
from .engine import Builder, Rewrite

aten = torch.ops.aten


def _cat_pieces(b: Builder, pieces: list[fx.Node], dim: int) -> fx.Node:
    return b.call(aten.cat.default, pieces, dim)


def _slice_operand(b, operand, operand_dim, spans):
    """An operand split like the pieces (or reused whole where it broadcasts)."""
    val = val_of(operand)
    if not isinstance(val, torch.Tensor) or operand_dim < 0 or val.shape[operand_dim] == 1:
        return [operand] * len(spans)
    return [b.call(aten.slice.Tensor, operand, operand_dim, lo, hi) for lo, hi in spans]


def _distribute_pointwise(b: Builder, node: fx.Node) -> Optional[fx.Node]:
    out_val = node.meta.get("val")
    if not isinstance(out_val, torch.Tensor) or _random_dropout(node):
        return None
    args = list(node.args)
    primary = next((i for i, a in enumerate(args) if mixed_concat(a) is not None), None)
    if primary is None:
        return None
    info = mixed_concat(args[primary])
    if any(_candidate_operand(arg) for i, arg in enumerate(args) if i != primary):
        return None
    out_dim = info.dim + out_val.dim() - info.ndim
    per_arg = []
    for i, arg in enumerate(args):
        if i == primary:
            per_arg.append(list(info.pieces))
        elif isinstance(arg, fx.Node) and isinstance(val_of(arg), torch.Tensor):
            val = val_of(arg)
            dim = out_dim - (out_val.dim() - val.dim())
            if dim >= 0 and val.shape[dim] != 1 and val.shape[dim] != sum(info.sizes):
                return None
            per_arg.append(_slice_operand(b, arg, dim, info.offsets))
        else:
            per_arg.append([arg] * len(info.pieces))
    outs = [
        b.call(node.target, *[per_arg[i][k] for i in range(len(args))], **node.kwargs)
        for k in range(len(info.pieces))
    ]
    return _cat_pieces(b, outs, out_dim)


def _candidate_operand(arg) -> bool:
    """A candidate tensor operand that is not itself a concatenation: every piece of the
    distributed op would read it and be candidate-side, so distributing gains nothing (and
    costs an op per piece and a concatenation)."""
    if not isinstance(arg, fx.Node) or not isinstance(val_of(arg), torch.Tensor):
        return False
    return role_of(arg) == Role.CANDIDATE and mixed_concat(arg) is None


# Dropouts drawing each element alone (``feature_dropout`` draws per channel: not split).
_ELEMENTWISE_DROPOUTS = frozenset({torch.ops.aten.dropout, torch.ops.aten.alpha_dropout})


def _random_dropout(node: fx.Node) -> bool:
    """Dropout in training mode draws one mask for the whole tensor, eager's numbers in eager's
    order: it must not be split. With ``request_dropout="per_request"`` an elementwise dropout
    draws each element independently, as split pieces do (``dropout(cat(a, b))`` and
    ``cat(dropout(a), dropout(b))`` have one distribution), and the request piece then draws
    once per request."""
    if op_groups.packet(node.target) in _ELEMENTWISE_DROPOUTS and dropout_is_per_request():
        return False
    return op_groups.dropout_in_training(node)


def _distribute_prelu(b: Builder, node: fx.Node) -> Optional[fx.Node]:
    """``prelu(cat(x_i, d), w) == cat(prelu(x_i, w_i), d)``: ``w`` has one slope per channel
    (dim 1), so it is split with the pieces only when the channels are concatenated."""
    info = mixed_concat(node.args[0])
    weight = node.args[1]
    if info is None or info.ndim < 2:
        return None
    per_channel = val_of(weight).numel() != 1 and info.dim == 1
    weights = (
        _slice_operand(b, weight, 0, info.offsets) if per_channel else [weight] * len(info.pieces)
    )
    outs = [b.call(node.target, piece, w) for piece, w in zip(info.pieces, weights)]
    return _cat_pieces(b, outs, info.dim)


def _distribute_first_arg(new_dim_fn):
    """Ops whose first argument is the concatenation; ``new_dim_fn(node, info)`` gives the cat
    dim of the result, or None when the op touches the concatenated axis."""

    def apply(b: Builder, node: fx.Node) -> Optional[fx.Node]:
        info = mixed_concat(node.args[0])
        if info is None:
            return None
        new_dim = new_dim_fn(node, info)
        if new_dim is None:
            return None
        rest = node.args[1:]
        outs = [b.call(node.target, piece, *rest, **node.kwargs) for piece in info.pieces]
        return _cat_pieces(b, outs, new_dim)

    return apply


def _same_dim_unless(*touched_dims_fn):
    def new_dim(node, info):
        for fn in touched_dims_fn:
            if info.dim in fn(node, info):
                return None
        return info.dim

    return new_dim


def _linear_dims(node, info):
    return {info.ndim - 1}


def _norm_dims(node, info):
    count = len(node.args[1])
    return set(range(info.ndim - count, info.ndim))


def _arg_dim(index, default=None):
    def dims(node, info):
        d = node.args[index] if len(node.args) > index else node.kwargs.get("dim", default)
        return {d % info.ndim} if d is not None else set(range(info.ndim))

    return dims


def _reduction_new_dim(node, info):
    dims = node.args[1] if len(node.args) > 1 else None
    if not dims:
        return None
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    dims = {d % info.ndim for d in dims}
    if info.dim in dims:
        return None
    return info.dim if keepdim else info.dim - sum(d < info.dim for d in dims)


def _permute_new_dim(node, info):
    order = [d % info.ndim for d in node.args[1]]
    return order.index(info.dim)


def _transpose_new_dim(node, info):
    a, c = (d % info.ndim for d in node.args[1:3])
    return {a: c, c: a}.get(info.dim, info.dim)


def _unsqueeze_new_dim(node, info):
    d = node.args[1] % (info.ndim + 1)
    return info.dim + 1 if d <= info.dim else info.dim


def _select_new_dim(node, info):
    d = node.args[1] % info.ndim
    if d == info.dim:
        return None
    return info.dim - (d < info.dim)


def _slice_new_dim(node, info):
    d = node.args[1] % info.ndim if len(node.args) > 1 else 0
    return None if d == info.dim else info.dim


def _distribute_embedding(b: Builder, node: fx.Node) -> Optional[fx.Node]:
    """``embedding(W, cat(ids, d)) == cat(embedding(W, ids_i), d)``."""
    weight, ids = node.args[0], node.args[1]
    info = mixed_concat(ids)
    if info is None:
        return None
    outs = [b.call(node.target, weight, piece, *node.args[2:]) for piece in info.pieces]
    return _cat_pieces(b, outs, info.dim)


def _distribute_matmul(b: Builder, node: fx.Node) -> Optional[fx.Node]:
    """Rows of the left operand or columns of the right operand are independent.

    The rows of ``left`` are the output's second-to-last dim, or its last one when ``right`` is
    a vector (``matmul`` drops the contracted vector dim); the columns of ``right`` are the
    output's last dim.

    Against a candidate operand every product is per candidate, but a request piece's product
    is an in-kernel broadcast (``ikbo``) where the concatenation needs the piece gathered to
    every candidate first: ``C @ [U^T[idx] | C^T]`` becomes ``[C @ U^T[idx] | C @ C^T]``, the
    bottom rows of a pairwise interaction over stacked request and candidate features. That
    split is taken when the concatenated output is smaller than the concatenated operand
    (``C``'s rows fewer than the contracted dim), so it moves less data than it saves.
    """
    left, right = node.args[0], node.args[1]
    out_ndim = node.meta["val"].dim()
    info = mixed_concat(left)
    if info is not None and info.ndim >= 2 and info.dim == info.ndim - 2:
        if _candidate_operand(right) and not _broadcast_pays(info, val_of(right), -1):
            return None
        outs = [b.call(node.target, piece, right) for piece in info.pieces]
        return _cat_pieces(b, outs, out_ndim - (1 if val_of(right).dim() == 1 else 2))
    info = mixed_concat(right)
    if info is not None and info.ndim >= 2 and info.dim == info.ndim - 1:
        if _candidate_operand(left) and not _broadcast_pays(info, val_of(left), -2):
            return None
        outs = [b.call(node.target, left, piece) for piece in info.pieces]
        return _cat_pieces(b, outs, out_ndim - 1)
    return None


def _broadcast_pays(info: Concat, other: torch.Tensor, kept_dim: int) -> bool:
    """Whether a matmul of the concatenation ``info`` with the candidate operand ``other``
    should split: some piece is request-only, and ``other``'s kept dim (its rows on the left,
    its columns on the right) is a size smaller than the contracted dim."""
    if other.dim() < 2 or not any(role_of(p) == Role.REQUEST for p in info.pieces):
        return False
    kept, contracted = other.shape[kept_dim], other.shape[-1 if kept_dim == -2 else -2]
    return isinstance(kept, int) and isinstance(contracted, int) and kept < contracted


def distribute_rewrites() -> list[Rewrite]:
    """The distributions of identity 2, in the order the engine tries them."""
    distribute = [
        ("distribute_pointwise", op_groups.is_elementwise, _distribute_pointwise),
        ("distribute_prelu", {aten.prelu}, _distribute_prelu),
        ("distribute_linear", {aten.linear}, _distribute_first_arg(_same_dim_unless(_linear_dims))),
        ("distribute_norm", op_groups.TRAILING_NORMS,
         _distribute_first_arg(_same_dim_unless(_norm_dims))),
        ("distribute_softmax", op_groups.ALONG_DIM_SAME_SHAPE,
         _distribute_first_arg(_same_dim_unless(_arg_dim(1)))),
        ("distribute_reduction", op_groups.REDUCTIONS_DIM_KEEPDIM,
         _distribute_first_arg(_reduction_new_dim)),
        ("distribute_permute", {aten.permute}, _distribute_first_arg(_permute_new_dim)),
        ("distribute_transpose", {aten.transpose}, _distribute_first_arg(_transpose_new_dim)),
        ("distribute_unsqueeze", {aten.unsqueeze}, _distribute_first_arg(_unsqueeze_new_dim)),
        ("distribute_select", {aten.select}, _distribute_first_arg(_select_new_dim)),
        ("distribute_slice", {aten.slice}, _distribute_first_arg(_slice_new_dim)),
        ("distribute_reshape", {aten.view, aten.reshape, aten._unsafe_view, aten.flatten},
         distribute_reshape),
        ("distribute_matmul", {aten.matmul, aten.bmm}, _distribute_matmul),
        ("distribute_embedding", {aten.embedding}, _distribute_embedding),
    ]  # fmt: skip
    return [
        Rewrite(name, ops if callable(ops) else frozenset(ops), fn) for name, ops, fn in distribute
    ]
