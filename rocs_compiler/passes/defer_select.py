"""defer, identity 2 for selections: advanced indexing with constant index vectors distributes
over a concatenation along an indexed dim.

For ``x = cat(pieces, d)`` and constant 1-D integer index vectors ``I_e`` at dims ``e`` (``d`` one
of them), broadcast together to one length ``L``, position ``t`` of the result picks the element
``(I_e[t])_e``, which lies in the piece ``k`` holding ``I_d[t]`` (at offset ``o_k``). So

    ``x[..., I_e, ...] == cat([pieces[k][..., I_e[run], ...] with I_d[run] - o_k], a)``

over the maximal runs of consecutive positions that fall in one piece, in order, where ``a`` is
the result's indexed dim (the first indexed dim when the indexed dims are adjacent, else 0, as
advanced indexing places it). Every element is copied alone, in the original order: exact.

Fires when some run falls in a piece that is request-only, or that holds a request-only block
along another indexed dim (the rule then reaches it on that piece's selection), and the source
is not request-only itself. A pairwise interaction ``bmm(T, T^T)`` over stacked request and
candidate features splits into a 2-D block layout (``cat`` along dim 1 of ``cat``s along dim 2);
DLRM's strict lower triangle ``Z[:, li, lj]`` then becomes ``cat([RR dots, C rows' dots], 1)``,
whose request-request dots run once per request, and the top MLP's first linear splits over it
(``defer_split.py``). Refused: an index that is not a constant 1-D int64/int32 vector of static
length, lengths that do not broadcast, entries negative or out of range (eager wraps or fails;
left as written, as ``normalize.index_of_cat`` does), a dim of symbolic size, more than
``_MAX_RUNS`` runs (one op per run). One index vector alone at a concatenated dim is
``normalize.index_of_cat``'s case when its entries are literals; it is tried first.

The runs are read at compile time, from literal lists (lifted constants) and from buffers alike
(DLRM's ``li``/``lj`` are buffers). Each run's index vectors are computed in the graph from the
index tensor itself (a slice of it, minus the piece's offset: a constant subgraph that cleanup
folds with its recipe), so a buffer written after compile is followed while each entry stays in
its piece; an entry written out of its piece is mapped past the piece's end, and the call fails
(index out of range) instead of reading another piece.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import fx

from ..ir.roles import Role
from .concat import Concat, as_concat, constant_index_entries, role_of, runs_in_pieces, val_of
from .engine import Builder, Rewrite
from .normalize import through_full_slices  # ``x[:, ...]`` as captured

aten = torch.ops.aten

_MAX_RUNS = 64  # a selection alternating pieces at every entry would cost one op per entry


def _distribute_index(b: Builder, node: fx.Node) -> Optional[fx.Node]:
    source, indices = node.args[0], list(node.args[1])
    info = as_concat(through_full_slices(source))
    if info is None or info.dim >= len(indices) or indices[info.dim] is None:
        return None
    given = [k for k, index in enumerate(indices) if index is not None]
    values = {k: constant_index_entries(indices[k], state=True) for k in given}
    if any(v is None for v in values.values()):
        return None
    length = max(len(v) for v in values.values())
    if any(len(v) not in (1, length) for v in values.values()):
        return None
    shape = val_of(info.node).shape
    for k, entries in values.items():
        if not isinstance(shape[k], int) or not all(0 <= v < shape[k] for v in entries):
            return None
    along = values[info.dim]
    runs = runs_in_pieces(info, along * length if len(along) == 1 else along)  # broadcast to L
    if len(runs) > _MAX_RUNS or role_of(info.node) == Role.REQUEST:
        return None
    if not any(_holds_request(info.pieces[piece], given) for piece, _, _ in runs):
        return None
    adjacent = given == list(range(given[0], given[-1] + 1))
    parts = [_run_of(b, info, indices, values, length, *run) for run in runs]
    if len(parts) == 1:
        return parts[0]
    return b.call(aten.cat.default, parts, given[0] if adjacent else 0)


def _holds_request(x, indexed: list[int]) -> bool:
    """``x`` is request-only, or a concatenation along an indexed dim with such a piece."""
    if role_of(x) == Role.REQUEST:
        return True
    info = as_concat(through_full_slices(x))
    return (
        info is not None
        and info.dim in indexed
        and any(_holds_request(piece, indexed) for piece in info.pieces)
    )


def _run_of(b: Builder, info: Concat, indices, values, length, piece, first, end) -> fx.Node:
    """``pieces[piece][..., I_e[first:end], ...]`` with ``I_d`` shifted into the piece."""
    lo, hi = info.offsets[piece]
    local = list(indices)
    for k, entries in values.items():
        index = indices[k]
        if len(entries) == length and (first, end) != (0, length):
            index = b.call(aten.slice.Tensor, index, 0, first, end)
        if k == info.dim:
            index = _into_piece(b, index, lo, hi)
        local[k] = index
    return b.call(aten.index.Tensor, info.pieces[piece], local)


def _into_piece(b: Builder, index: fx.Node, lo: int, hi: int) -> fx.Node:
    """``I - lo`` where ``lo <= I < hi``, else ``hi - lo`` (past the piece: indexing fails), so
    that an index buffer written after compile never reads another piece."""
    low, high = b.call(aten.ge.Scalar, index, lo), b.call(aten.lt.Scalar, index, hi)
    inside = b.call(aten.logical_and.default, low, high)
    shifted = b.call(aten.sub.Tensor, index, lo) if lo else index
    return b.call(aten.where.ScalarOther, inside, shifted, hi - lo)


def select_rewrites() -> list[Rewrite]:
    return [
        Rewrite("distribute_index", frozenset({aten.index}), _distribute_index,
                "constant advanced indexing of a cat -> cat of the pieces' selections"),
    ]  # fmt: skip
