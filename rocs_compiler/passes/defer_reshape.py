"""defer, identity 2 for reshapes: a reshape that keeps the concatenated axis whole distributes
over the concatenation.

``reshape(cat(u, c, d), shape) == cat(reshape(u, shape_u), reshape(c, shape_c), d)`` when every
dim before ``d`` is kept (size-1 dims there may be dropped: the order of the elements does not
change) and ``d`` is the major dim of the group of dims it merges with, or when the reshape
splits ``d`` into ``[k, *inner]`` and every piece's size is a multiple of ``prod(inner)``
(``[B, F*D] -> [B, F, D]``). The request piece's reshape is request-only.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import fx

from ..ir.symbolic import same_size
from .concat import Concat, mixed_concat, val_of
from .engine import Builder

aten = torch.ops.aten


def distribute_reshape(b: Builder, node: fx.Node) -> Optional[fx.Node]:
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
    merged = math.prod(in_shape[d + 1 : group])
    outs = []
    for piece, size in zip(info.pieces, info.sizes):
        shape = list(node.args[1]) if node.target != aten.flatten.using_ints else None
        if shape is None:
            outs.append(b.call(node.target, piece, *node.args[1:]))
            continue
        shape[d] = size * merged
        outs.append(b.call(node.target, piece, shape))
    return b.call(aten.cat.default, outs, d)


def _split_axis_reshape(b: Builder, node: fx.Node, info: Concat) -> fx.Node | None:
    """A reshape that splits the axis into ``[k, *inner]`` and keeps every other dim
    (``[B, F*D] -> [B, F, D]``), when every piece's size is a multiple of ``prod(inner)``: each
    piece splits alike and the pieces concatenate along the leading part."""
    in_shape = list(val_of(node.args[0]).shape)
    out_shape = list(node.meta["val"].shape)
    d, extra = info.dim, len(out_shape) - len(in_shape)
    if extra < 1 or node.target == aten.flatten.using_ints:
        return None
    if not all(isinstance(s, int) for s in out_shape[d + 1 :]):
        return None
    inner = math.prod(out_shape[d + 1 : d + 1 + extra])
    if not (
        _same_prefix(in_shape[:d], out_shape[:d])
        and _same_prefix(in_shape[d + 1 :], out_shape[d + 1 + extra :])
    ):
        return None
    if inner == 0 or any(size % inner for size in info.sizes):
        return None
    outs = []
    for piece, size in zip(info.pieces, info.sizes):
        shape = list(node.args[1])[:d] + [size // inner] + out_shape[d + 1 :]
        outs.append(b.call(node.target, piece, shape))
    return b.call(aten.cat.default, outs, d)


def _reshape_group(in_shape: list, out_shape: list, d: int) -> Optional[int]:
    """The end of the input dims ``d:end`` that merge into output dim ``d`` with the dims before
    ``d`` unchanged, or None."""
    if len(out_shape) <= d or not _same_prefix(in_shape[:d], out_shape[:d]):
        return None
    if not all(isinstance(s, int) for s in in_shape[d + 1 :]):
        return None
    for end in range(d + 1, len(in_shape) + 1):
        if same_size(math.prod(in_shape[d:end]) if end > d else 1, out_shape[d]):
            if _same_prefix(in_shape[end:], out_shape[d + 1 :]) or end == d + 1:
                if end == d + 1 and not same_size(in_shape[d], out_shape[d]):
                    return None
                return end
    return None


def _is_one(size) -> bool:
    return isinstance(size, int) and size == 1


def _same_prefix(a: list, b: list) -> bool:
    return len(a) == len(b) and all(same_size(x, y) for x, y in zip(a, b))
