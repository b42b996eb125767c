"""Rules of ops that combine positions (reductions, softmax, scans, contractions, attention),
lookups, concatenations, factories and sizes."""

from __future__ import annotations

from typing import Callable

import torch
from torch import fx

from ...ir.symbolic import expr_of
from .lattice import (
    ANY,
    CLEAN,
    MASKED,
    NONFINITE,
    POS,
    Const,
    Context,
    Refused,
    Rule,
    Size,
    Tail,
    Value,
    _aligned_tail,
    _is,
    _no_sizes,
    _val,
    finite,
    loose,
    masks,
)

aten = torch.ops.aten


def _reduced_dims(node: fx.Node, x: torch.Tensor) -> list[int]:
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dims is None or (isinstance(dims, (list, tuple)) and not dims):
        return list(range(x.dim()))
    if isinstance(dims, int):
        dims = [dims]
    return [d % max(x.dim(), 1) for d in dims]


def reducing(over_history: Callable[[Tail], bool], needs_content: bool = False) -> Rule:
    """A reduction: over the rows refused; over the history only when ``over_history(tail)``
    (the tail adds nothing to it)."""

    def rule(node: fx.Node, ctx: Context) -> Value:
        _no_sizes(node, ctx)
        x = _val(node.args[0])
        state = ctx.state(node.args[0])
        dims = _reduced_dims(node, x)
        if any(_is(x.shape[d], ctx.rows) for d in dims):
            raise Refused("reduces over the rows: it mixes candidates")
        for d in dims:
            if _is(x.shape[d], ctx.history):
                tail = state.tails.get(d, ANY)
                if not over_history(tail):
                    raise Refused(f"reduces over the history, whose padded tail ({tail!r}) counts")
                if needs_content:
                    ctx.needs_content.append(node.name)
        outs = _val(node) if isinstance(_val(node), (list, tuple)) else [_val(node)]
        values = [
            Value({d: loose(state.tails.values()) for d in ctx.history_dims(v)}, ctx.row_dims(v))
            for v in outs
        ]
        return values if isinstance(_val(node), (list, tuple)) else values[0]

    return rule


def _is_zero(tail: Tail) -> bool:
    return isinstance(tail, Const) and tail.value == 0


def _is_one(tail: Tail) -> bool:
    return isinstance(tail, Const) and tail.value == 1


def softmaxing(node: fx.Node, ctx: Context) -> Value:
    """Softmax along the history: exact when the tail is masked (weight 0 past each length),
    for rows with content; along the rows refused; along another dim position-wise."""
    _no_sizes(node, ctx)
    x = _val(node.args[0])
    state = ctx.state(node.args[0])
    dim = node.args[1] % x.dim()
    if _is(x.shape[dim], ctx.rows):
        raise Refused("normalizes over the rows: it mixes candidates")
    tails = {d: loose([state.tails.get(d, ANY)]) for d in ctx.history_dims(x)}
    if _is(x.shape[dim], ctx.history):
        if not masks(state.tails.get(dim, ANY)):
            raise Refused("normalizes over the history, whose padded tail is not masked")
        ctx.needs_content.append(node.name)
        log = node.target.overloadpacket in (aten.log_softmax, aten._log_softmax)
        tails[dim] = MASKED if log else Const(0.0)
    return Value(tails, ctx.row_dims(_val(node)))


def scanning(node: fx.Node, ctx: Context) -> Value:
    """``cumsum``/``cumprod``: a position reads the positions before it."""
    _no_sizes(node, ctx)
    x = _val(node.args[0])
    if _is(x.shape[node.args[1] % x.dim()], ctx.rows):
        raise Refused("accumulates over the rows: it mixes candidates")
    state = ctx.state(node.args[0])
    return Value(
        {d: loose([state.tails.get(d, ANY)]) for d in ctx.history_dims(x)}, ctx.row_dims(x)
    )


def _contracted(ctx: Context, a_tail: Tail, b_tail: Tail) -> None:
    if (_is_zero(a_tail) and finite(b_tail)) or (_is_zero(b_tail) and finite(a_tail)):
        return
    raise Refused(f"contracts over the history, whose padded tails ({a_tail!r}, {b_tail!r}) count")


def contracting(node: fx.Node, ctx: Context) -> Value:
    """``matmul``/``bmm``/``mm``: ``a[..., n, k] @ b[..., k, m]``; ``k`` along the history only
    when one side's tail is 0 (and the other's finite); ``m`` along the rows refused (every row
    against every other)."""
    _no_sizes(node, ctx)
    a, b = node.args[0], node.args[1]
    va, vb = _val(a), _val(b)
    sa, sb = ctx.state(a), ctx.state(b)
    ka, kb = va.dim() - 1, (vb.dim() - 2 if vb.dim() >= 2 else 0)
    if _is(va.shape[ka], ctx.rows):
        raise Refused("contracts over the rows: it mixes candidates")
    if vb.dim() >= 2 and _is(vb.shape[-1], ctx.rows) and ctx.row_dims(va)[-1:] != (va.dim() - 2,):
        raise Refused("multiplies every row by every other row")
    if (
        vb.dim() >= 2
        and _is(vb.shape[-1], ctx.rows)
        and va.dim() >= 2
        and _is(va.shape[-2], ctx.rows)
    ):
        raise Refused("multiplies every row by every other row")
    if _is(va.shape[ka], ctx.history):
        _contracted(ctx, sa.tails.get(ka, ANY), sb.tails.get(kb, ANY))
    out = _val(node)
    tails = {}
    for d in ctx.history_dims(out):
        from_a = _matmul_source(d, out.dim(), va, vb, "a")
        from_b = _matmul_source(d, out.dim(), va, vb, "b")
        parts = []
        if from_a is not None and _is(va.shape[from_a], ctx.history):
            parts.append(sa.tails.get(from_a, ANY))
        if from_b is not None and _is(vb.shape[from_b], ctx.history):
            parts.append(sb.tails.get(from_b, ANY))
        zero = any(_is_zero(t) for t in parts) and all(finite(t) for t in parts)
        tails[d] = (
            Const(0.0)
            if zero and len(parts) == 1
            else loose(parts + list(sa.tails.values()) + list(sb.tails.values()))
        )
    return Value(tails, ctx.row_dims(out))


def _matmul_source(d: int, out_ndim: int, va, vb, side: str) -> int | None:
    """The dim of ``a`` or ``b`` an output dim of ``a @ b`` comes from (None: from neither)."""
    n_dim = out_ndim - 2 if vb.dim() >= 2 and va.dim() >= 2 else None
    m_dim = out_ndim - 1 if vb.dim() >= 2 else None
    if va.dim() == 1:
        n_dim, m_dim = None, (out_ndim - 1 if vb.dim() >= 2 else None)
    if vb.dim() == 1:
        n_dim, m_dim = (out_ndim - 1 if va.dim() >= 2 else None), None
    if d == n_dim:
        return va.dim() - 2 if side == "a" else None
    if d == m_dim:
        return vb.dim() - 1 if side == "b" else None
    batch_out = out_ndim - (n_dim is not None) - (m_dim is not None)
    v = va if side == "a" else vb
    batch_in = v.dim() - min(v.dim(), 2)
    i = d - (batch_out - batch_in)
    return i if 0 <= i < batch_in else None


def linear(node: fx.Node, ctx: Context) -> Value:
    """``linear(x, w, b)`` contracts x's last dim with a weight: that dim cannot be the
    history's (a weight of fixed size) nor the rows."""
    _no_sizes(node, ctx)
    x = _val(node.args[0])
    if _is(x.shape[-1], ctx.history) or _is(x.shape[-1], ctx.rows):
        raise Refused("contracts over the history or the rows")
    if any(
        ctx.row_dims(_val(w)) or ctx.history_dims(_val(w))
        for w in node.args[1:]
        if isinstance(w, fx.Node)
    ):
        raise Refused("a weight with rows or the history")
    state = ctx.state(node.args[0])
    biased = len(node.args) > 2 and node.args[2] is not None
    tails = {}
    for d in ctx.history_dims(x):
        t = state.tails.get(d, ANY)
        tails[d] = Const(0.0) if _is_zero(t) and not biased else loose([t])
    return Value(tails, ctx.row_dims(_val(node)))


def attending(node: fx.Node, ctx: Context) -> Value:
    """``scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal)``: keys along the
    history only when the mask gives their padded tail weight 0 (a False or masking tail), or
    when the attention is causal over the same history as its queries."""
    _no_sizes(node, ctx)
    q, k, v = (_val(a) for a in node.args[:3])
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    causal = node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False)
    if _is(q.shape[-2], ctx.rows) or _is(k.shape[-2], ctx.rows):
        raise Refused("attends across the rows: it mixes candidates")
    sk, sv = ctx.state(node.args[1]), ctx.state(node.args[2])
    masked = isinstance(mask, fx.Node)
    scores = q.dim()  # the mask broadcasts against the scores, [..., Lq, Lk]
    if not all(finite(t) for t in [*sk.tails.values(), *sv.tails.values()]):
        raise Refused("attends to keys or values that may not be finite past each length")
    if _is(k.shape[-2], ctx.history):
        tail = _aligned_tail(mask, scores - 1, scores, ctx) if masked else None
        if isinstance(tail, Const) and tail.value == 0 and _val(mask).dtype == torch.bool:
            ctx.needs_content.append(node.name)
        elif tail is not None and masks(tail):
            ctx.needs_content.append(node.name)
        elif not (causal and _is(q.shape[-2], ctx.history) and mask is None):
            raise Refused("attends to the history's padded keys without masking them")
    out = _val(node)
    # A padded query whose own row of the mask hides every key is nan; a mask that does not
    # vary along the queries hides what it hides from every query, and rows keep a key.
    per_query = masked and _aligned_tail(mask, scores - 2, scores, ctx) is not None
    tail = NONFINITE if per_query else ANY
    return Value({d: tail for d in ctx.history_dims(out)}, ctx.row_dims(out))


def looking_up(node: fx.Node, ctx: Context) -> Value:
    """``embedding(table, ids)``: a table of fixed size read at each id's position."""
    _no_sizes(node, ctx)
    table = _val(node.args[0])
    if ctx.row_dims(table) or ctx.history_dims(table):
        raise Refused("looks up a table that has rows or the history")
    out = _val(node)
    ids = ctx.state(node.args[1])
    return (
        Value({d: ANY for d in ctx.history_dims(out)}, ctx.row_dims(out))
        if isinstance(ids, Value)
        else CLEAN
    )


def joining(node: fx.Node, ctx: Context) -> Value:
    """``cat``/``stack`` along a dim that is neither the history nor the rows."""
    _no_sizes(node, ctx)
    parts = [a for a in node.args[0] if isinstance(a, fx.Node)]
    out = _val(node)
    dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % out.dim()
    if _is(out.shape[dim], ctx.history) or _is(out.shape[dim], ctx.rows):
        raise Refused("joins along the history or the rows")
    stacked = node.target.overloadpacket is aten.stack
    tails = {}
    for d in ctx.history_dims(out):
        src = d - (1 if stacked and d > dim else 0)
        found = []
        for p in parts:
            state = ctx.state(p)
            found.append(state.tails.get(src, ANY) if isinstance(state, Value) else NONFINITE)
        same = all(f == found[0] for f in found)
        tails[d] = found[0] if same and isinstance(found[0], Const) else loose(found)
    return Value(tails, ctx.row_dims(out))


def making(fill: Callable[[fx.Node], Tail]) -> Rule:
    """A factory (``zeros``, ``full``, ``arange``): its sizes may read the history's width."""

    def rule(node: fx.Node, ctx: Context) -> Value:
        out = _val(node)
        if not isinstance(out, torch.Tensor):
            return CLEAN
        if ctx.merged(out):
            raise Refused("a size that merges the history or the rows")
        tail = fill(node)
        return Value({d: tail for d in ctx.history_dims(out)}, ctx.row_dims(out))

    return rule


def _arange_fill(node: fx.Node) -> Tail:
    starts_at_zero = len(node.args) == 1 or node.args[0] == 0
    return POS if starts_at_zero else ANY


def _fill_value(node: fx.Node) -> Tail:
    op = node.target.overloadpacket
    if op in (aten.zeros, aten.zeros_like, aten.new_zeros):
        return Const(0.0)
    if op in (aten.ones, aten.ones_like, aten.new_ones):
        return Const(1.0)
    if op in (aten.full, aten.new_full, aten.full_like):
        value = node.args[1] if op is not aten.new_full else node.args[2]
        return Const(float(value)) if isinstance(value, (int, float, bool)) else ANY
    return NONFINITE  # empty: anything


def sizing(node: fx.Node, ctx: Context) -> Size:
    """``sym_size`` and int arithmetic on sizes: which of the two symbols they read."""
    expr = expr_of(_val(node))
    if expr is None:
        return Size(frozenset())
    return Size(frozenset(expr.free_symbols & {ctx.history, ctx.rows}))


def checking(node: fx.Node, ctx: Context) -> Value:
    """Runtime asserts on sizes: they compute nothing the outputs read."""
    return CLEAN
