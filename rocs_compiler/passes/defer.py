"""defer: push request-candidate interactions as late as algebra allows.

A concatenation of request and candidate pieces is where the two sides meet. Two identities
move that meeting point later, so that more of the graph stays request-only:

1. *Contraction over the concatenated axis splits into a sum.* For a weight W whose columns
   are split like the pieces, ``linear(cat(u, c), W, b) == linear(u, W_u) + linear(c, W_c, b)``;
   the same holds for ``matmul(W, cat(u, c, dim=-2))`` (linear compression), einsum contracting
   the concatenated letter, and ``sum`` over the concatenated dim. ``linear(u, W_u)`` is
   request-only and runs once per request.
2. *Ops independent along the concatenated axis distribute over it.*
   ``f(cat(u, c, d)) == cat(f(u), f(c), d')`` for elementwise ops (other operands sliced along
   d), linear maps and matmuls on other dims, norms and softmaxes over other dims, reductions
   over other dims, reshapes/permutes that keep the axis intact, and reshapes that split it
   into whole pieces (``[B, F*D] -> [B, F, D]``). ``f(u)`` is request-only.
   Applied repeatedly this computes K/V projections of a request history once per request, and
   turns a pairwise interaction ``bmm(T, T^T)`` over a stacked request/candidate feature set
   into blocks whose request-request block runs once per request.

Both rules fire only on *mixed* concatenations (at least one request piece and one that is
not); the re-association of sums they introduce is the only numerical difference.

Precision of the split sums: eager contracts a float16/bfloat16 tensor with a float32
accumulator and rounds once; two low-precision partials added in low precision round three
times (about one ulp of the partials' scale). With ``float32_partials`` (the default) rule 1
computes a low-precision contraction's partials in float32 and rounds their sum once, which
matches eager up to float32 re-association (bit for bit in practice). float32 and float64
contractions split in their own dtype: the partials' re-association is the bound (a few ulps
of ``sum |terms|``).
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import sympy
import torch
from torch import fx

from ..analysis import op_groups
from ..ir.symbolic import same_size
from ..analysis.driver import infer_node
from ..analysis.role_rules import dropout_is_per_request
from ..ir.roles import Role
from .concat import Concat, mixed_concat, role_of, val_of
from .engine import Builder, Rewrite, rewrite_to_fixpoint
from .normalize import normalize_rewrites

aten = torch.ops.aten


# ---------------------------------------------------------------------------------------------
# 1. Contractions over the concatenated axis


def _select_columns(b: Builder, weight: fx.Node, dim: int, ranges: list[tuple[int, int]]) -> fx.Node:
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


# ---------------------------------------------------------------------------------------------
# 2. Distribution over the concatenated axis


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
    weights = _slice_operand(b, weight, 0, info.offsets) if per_channel else [weight] * len(info.pieces)
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


def _distribute_reshape(b: Builder, node: fx.Node) -> Optional[fx.Node]:
    """Reshapes that keep every dim before the axis and the axis as the major dim of its group;
    size-1 dims before the axis may also be dropped (``[B, 1, 32] -> [B, 32]``: the order of the
    elements does not change)."""
    info = mixed_concat(node.args[0])
    if info is None:
        return None
    in_shape = list(val_of(node.args[0]).shape)
    out_shape = list(node.meta["val"].shape)
    d = info.dim
    group = _reshape_group(in_shape, out_shape, d)
    if group is None:
        kept = [i for i in range(len(in_shape)) if i >= d or not _is_one(in_shape[i])]
        d = d - (len(in_shape) - len(kept))
        group = _reshape_group([in_shape[i] for i in kept], out_shape, d)
        in_shape = [in_shape[i] for i in kept]
    if group is None:
        return _split_axis_reshape(b, node, info)
    merged = math.prod(in_shape[d + 1:group])
    outs = []
    for piece, size in zip(info.pieces, info.sizes):
        shape = list(node.args[1]) if node.target != aten.flatten.using_ints else None
        if shape is None:
            outs.append(b.call(node.target, piece, *node.args[1:]))
            continue
        shape[d] = size * merged
        outs.append(b.call(node.target, piece, shape))
    return _cat_pieces(b, outs, d)


def _split_axis_reshape(b: Builder, node: fx.Node, info: Concat) -> fx.Node | None:
    """A reshape that splits the axis into ``[k, *inner]`` and keeps every other dim
    (``[B, F*D] -> [B, F, D]``), when every piece's size is a multiple of ``prod(inner)``: each
    piece splits alike and the pieces concatenate along the leading part."""
    in_shape = list(val_of(node.args[0]).shape)
    out_shape = list(node.meta["val"].shape)
    d, extra = info.dim, len(out_shape) - len(in_shape)
    if extra < 1 or node.target == aten.flatten.using_ints:
        return None
    if not all(isinstance(s, int) for s in out_shape[d + 1:]):
        return None
    inner = math.prod(out_shape[d + 1:d + 1 + extra])
    if not (
        _same_prefix(in_shape[:d], out_shape[:d])
        and _same_prefix(in_shape[d + 1:], out_shape[d + 1 + extra:])
    ):
        return None
    if inner == 0 or any(size % inner for size in info.sizes):
        return None
    outs = []
    for piece, size in zip(info.pieces, info.sizes):
        shape = list(node.args[1])[:d] + [size // inner] + out_shape[d + 1:]
        outs.append(b.call(node.target, piece, shape))
    return _cat_pieces(b, outs, d)


def _reshape_group(in_shape: list, out_shape: list, d: int) -> Optional[int]:
    """The end of the input dims ``d:end`` that merge into output dim ``d`` with the dims before
    ``d`` unchanged, or None."""
    if len(out_shape) <= d or not _same_prefix(in_shape[:d], out_shape[:d]):
        return None
    if not all(isinstance(s, int) for s in in_shape[d + 1:]):
        return None
    for end in range(d + 1, len(in_shape) + 1):
        if same_size(math.prod(in_shape[d:end]) if end > d else 1, out_shape[d]):
            if _same_prefix(in_shape[end:], out_shape[d + 1:]) or end == d + 1:
                if end == d + 1 and not same_size(in_shape[d], out_shape[d]):
                    return None
                return end
    return None


def _is_one(size) -> bool:
    return isinstance(size, int) and size == 1


def _same_prefix(a: list, b: list) -> bool:
    return len(a) == len(b) and all(same_size(x, y) for x, y in zip(a, b))


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


def defer_rewrites(float32_partials: bool = True) -> list[Rewrite]:
    """The defer rewrites; ``float32_partials``: see the module docstring (precision)."""
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
         _distribute_reshape),
        ("distribute_matmul", {aten.matmul, aten.bmm}, _distribute_matmul),
        ("distribute_embedding", {aten.embedding}, _distribute_embedding),
    ]
    splits = [
        ("split_linear", {aten.linear}, _split_linear),
        ("split_matmul", {aten.matmul}, _split_matmul),
        ("split_einsum", {aten.einsum}, _split_einsum),
        ("split_sum", {aten.sum}, _split_sum),
    ]
    contract = [
        Rewrite(name, frozenset(ops), functools.partial(fn, float32_partials=float32_partials))
        for name, ops, fn in splits
    ]
    return contract + [
        Rewrite(name, ops if callable(ops) else frozenset(ops), fn) for name, ops, fn in distribute
    ]


def defer(
    gm: fx.GraphModule,
    request_placeholders: set[str],
    symbol: sympy.Symbol,
    float32_partials: bool = True,
):
    """Normalize, then apply the defer identities to a fixpoint. Returns (graph, counts)."""

    def infer(node: fx.Node) -> None:
        infer_node(node, request_placeholders, symbol)

    rewrites = normalize_rewrites() + defer_rewrites(float32_partials)
    counts = rewrite_to_fixpoint(gm, rewrites, infer)
    return gm, counts
