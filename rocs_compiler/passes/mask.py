"""mask: split linear layers along exactly-zero weight blocks (Generalized Layer Masking).

Identity: if rows ``O_r`` of W are zero on every column that reads a non-request piece of
``x = cat(pieces, -1)``, then ``linear(x, W, b)[..., O_r] == linear(x_req, W[O_r, req], b[O_r])``,
which is request-only. With the request rows first (the GLM layout) the layer becomes
``cat([linear(x_req, W_rr, b_r), linear(x, W[O_c], b[O_c])], -1)``: a concatenation whose first
piece is a request lane, which the defer rewrites then carry through the following layers.
Weights are read at compile time, after weight-only subgraphs (parametrizations) are folded.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
from torch import fx

from ..roles import Role
from .concat import mixed_concat, role_of
from .engine import Builder, Rewrite

aten = torch.ops.aten


def _weight_value(gm: fx.GraphModule, node) -> Optional[torch.Tensor]:
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return None
    obj = operator.attrgetter(node.target)(gm)
    return obj if isinstance(obj, torch.Tensor) else None


def _split_rows(b: Builder, node: fx.Node) -> Optional[fx.Node]:
    x, weight = node.args[0], node.args[1]
    bias = node.args[2] if len(node.args) > 2 else None
    info = mixed_concat(x)
    if info is None or info.dim != info.ndim - 1:
        return None
    w = _weight_value(b.gm, weight)
    if w is None or w.dim() != 2:
        return None
    other_cols = [
        c for piece, (lo, hi) in zip(info.pieces, info.offsets) if role_of(piece) != Role.REQUEST
        for c in range(lo, hi)
    ]
    request_rows = (w[:, other_cols] == 0).all(dim=1)
    k = int(request_rows.long().cumprod(0).sum())  # length of the leading all-request block
    if k == 0:
        return None
    req_pieces = [p for p in info.pieces if role_of(p) == Role.REQUEST]
    req_spans = [span for p, span in zip(info.pieces, info.offsets) if role_of(p) == Role.REQUEST]
    x_req = req_pieces[0] if len(req_pieces) == 1 else b.call(aten.cat.default, req_pieces, info.dim)
    cols = [b.call(aten.slice.Tensor, weight, 1, lo, hi) for lo, hi in req_spans]
    w_req = cols[0] if len(cols) == 1 else b.call(aten.cat.default, cols, 1)
    w_req = b.call(aten.slice.Tensor, w_req, 0, 0, k)
    b_req = None if bias is None else b.call(aten.slice.Tensor, bias, 0, 0, k)
    y_req = b.call(aten.linear.default, x_req, w_req, b_req)
    if k == w.shape[0]:
        return y_req
    w_rest = b.call(aten.slice.Tensor, weight, 0, k, w.shape[0])
    b_rest = None if bias is None else b.call(aten.slice.Tensor, bias, 0, k, w.shape[0])
    y_rest = b.call(aten.linear.default, x, w_rest, b_rest)
    return b.call(aten.cat.default, [y_req, y_rest], -1)


def mask_rewrites() -> list[Rewrite]:
    return [Rewrite("glm_split_rows", frozenset({aten.linear}), _split_rows)]
