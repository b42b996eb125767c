"""Rules of ops that keep positions: position-wise ops (each output position reads the same
positions of its broadcast inputs, with what a tail becomes through the op) and views (positions
move with their values)."""

from __future__ import annotations

import math
from typing import Any, Callable

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
    _tensor_args,
    _val,
    finite,
    loose,
    masks,
)

aten = torch.ops.aten


def _const_eval(node: fx.Node, consts: dict[int, float]) -> Tail:
    """The op on the constants of its tensor args (positions ``consts``), on 0-d tensors."""
    args = list(node.args)
    for i, value in consts.items():
        dtype = _val(node.args[i]).dtype
        args[i] = torch.tensor(value, dtype=dtype)
    kwargs = {k: v for k, v in node.kwargs.items() if not isinstance(v, fx.Node)}
    try:
        out = node.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - an op that does not take 0-d constants: nothing known
        return None
    if not isinstance(out, torch.Tensor) or out.numel() != 1:
        return None
    value = float(out.item())
    return Const(value) if not math.isnan(value) else NONFINITE


def _pointwise_tail(node: fx.Node, d: int, ndim: int, ctx: Context) -> Tail:
    """The output's tail at its history dim ``d`` for a position-wise op."""
    tensor_positions = [
        i
        for i, a in enumerate(node.args)
        if isinstance(a, fx.Node) and isinstance(_val(a), torch.Tensor)
    ]
    tails = {i: _aligned_tail(node.args[i], d, ndim, ctx) for i in tensor_positions}
    special = _SPECIAL_TAILS.get(getattr(node.target, "overloadpacket", node.target))
    if special is not None:
        tail = special(node, tails, ctx)
        if tail is not None:
            return tail
    scalars = [a for a in node.args if isinstance(a, (bool, int, float))]
    if all(isinstance(t, Const) for t in tails.values()) and all(math.isfinite(s) for s in scalars):
        tail = _const_eval(node, {i: t.value for i, t in tails.items()})
        if tail is not None:
            return tail
    return loose([t for t in tails.values() if t is not None])


def _tail_of_mul(node, tails, ctx) -> Tail | None:
    known = list(tails.values()) + [
        Const(float(a)) for a in node.args if isinstance(a, (int, float))
    ]
    if any(isinstance(t, Const) and t.value == 0 for t in known):
        if all(t is None or finite(t) for t in known):
            return Const(0.0)
    return None


def _tail_of_and(node, tails, ctx) -> Tail | None:
    if any(isinstance(t, Const) and t.value == 0 for t in tails.values()):
        return Const(0.0)
    return None


def _tail_of_or(node, tails, ctx) -> Tail | None:
    if any(isinstance(t, Const) and t.value != 0 for t in tails.values()):
        return Const(1.0)
    return None


def _tail_of_add(node, tails, ctx) -> Tail | None:
    """A masking fill plus finite terms stays masking (``scores + mask_bias``)."""
    if node.target.overloadpacket is aten.sub and 1 in tails and tails[1] is not None:
        if masks(tails[1]):
            return None  # minus a masking value: large positive
    known = [t for t in tails.values()]
    if any(t is not None and masks(t) for t in known):
        rest = [t for t in known if t is not None and not masks(t)]
        if all(finite(t) for t in rest):
            return MASKED
    return None


def _tail_of_masked_fill(node, tails, ctx) -> Tail | None:
    mask, fill = tails.get(1), node.args[2]
    if isinstance(fill, fx.Node):
        fill_tail = _aligned_tail(fill, 0, 0, ctx)
    else:
        fill_tail = Const(float(fill))
    if isinstance(mask, Const):
        return fill_tail if mask.value else tails.get(0) or ANY
    return None


def _tail_of_where(node, tails, ctx) -> Tail | None:
    cond = tails.get(0)
    if not isinstance(cond, Const):
        return None
    chosen = 1 if cond.value else 2
    arg = node.args[chosen]
    if isinstance(arg, fx.Node):
        return tails.get(chosen) or loose([])
    return Const(float(arg))


def _tail_of_compare(node, tails, ctx) -> Tail | None:
    """Positions against each row's length: ``pos < len`` is False past it, ``pos >= len``
    True (and the mirrored spellings)."""
    if len(node.args) < 2 or not all(isinstance(a, fx.Node) for a in node.args[:2]):
        return None
    a, b = node.args[:2]
    a_pos, b_pos = tails.get(0) is POS, tails.get(1) is POS
    a_len = getattr(ctx.state(a), "lengths", False)
    b_len = getattr(ctx.state(b), "lengths", False)
    op = node.target.overloadpacket
    if a_pos and b_len:
        return {aten.lt: Const(0.0), aten.ge: Const(1.0)}.get(op)
    if a_len and b_pos:
        return {aten.gt: Const(0.0), aten.le: Const(1.0)}.get(op)
    return None


def _tail_of_unary_masked(value: float) -> Callable:
    """``exp``/``sigmoid``/``relu`` of a masking value: exactly ``value``."""

    def tail(node, tails, ctx) -> Tail | None:
        t = tails.get(0)
        return Const(value) if t is not None and masks(t) else None

    return tail


_SPECIAL_TAILS: dict[Any, Callable] = {
    aten.mul: _tail_of_mul,
    aten.logical_and: _tail_of_and,
    aten.bitwise_and: _tail_of_and,
    aten.logical_or: _tail_of_or,
    aten.bitwise_or: _tail_of_or,
    aten.add: _tail_of_add,
    aten.sub: _tail_of_add,
    aten.masked_fill: _tail_of_masked_fill,
    aten.where: _tail_of_where,
    aten.lt: _tail_of_compare,
    aten.le: _tail_of_compare,
    aten.gt: _tail_of_compare,
    aten.ge: _tail_of_compare,
    aten.exp: _tail_of_unary_masked(0.0),
    aten.sigmoid: _tail_of_unary_masked(0.0),
    aten.relu: _tail_of_unary_masked(0.0),
}


def position_wise(node: fx.Node, ctx: Context) -> Value:
    """Each output position reads the same positions of its (broadcast) inputs."""
    _no_sizes(node, ctx)
    val = _val(node)
    tails = {d: _pointwise_tail(node, d, val.dim(), ctx) for d in ctx.history_dims(val)}
    lengths = any(getattr(ctx.state(a), "lengths", False) for a in _tensor_args(node))
    lengths = lengths and not tails and node.target.overloadpacket in _KEEPS_LENGTHS
    return Value(tails, ctx.row_dims(val), lengths)


_KEEPS_LENGTHS = {aten._to_copy, aten.to, aten.clone, aten.contiguous, aten.detach, aten.alias}


def normalizing(kinds: tuple[str, ...]) -> Rule:
    """Position-wise except over the dims ``kinds`` name: ``"last"`` (layer norm's last dims,
    from its ``normalized_shape``) or ``"channels"`` (batch norm's dim 1)."""

    def rule(node: fx.Node, ctx: Context) -> Value:
        x = _val(node.args[0])
        if "training" in kinds and _batch_norm_trains(node):
            raise Refused("normalizes with the batch's statistics: it mixes candidates")
        if "last" in kinds:
            covered = range(x.dim() - len(node.args[1]), x.dim())
            if any(_is(x.shape[d], ctx.history) or _is(x.shape[d], ctx.rows) for d in covered):
                raise Refused("normalizes over the history or the rows")
        val = _val(node) if isinstance(_val(node), torch.Tensor) else x
        tails = {
            d: loose([ctx.state(node.args[0]).tails.get(d, ANY)]) for d in ctx.history_dims(val)
        }
        return Value(tails, ctx.row_dims(val))

    return rule


def _batch_norm_trains(node: fx.Node) -> bool:
    args = list(node.args)
    if node.target.overloadpacket is aten.batch_norm:
        return bool(args[5]) if len(args) > 5 else bool(node.kwargs.get("training"))
    return False


# -- views ------------------------------------------------------------------------------------


def _mapped(node: fx.Node, ctx: Context, source: fx.Node, order: list[int] | None) -> Value:
    """The output's tails, taken from ``source``'s history dims: ``order[out_dim] = in_dim``
    when known, else the k-th history dim of the output is the k-th of the input."""
    val, src = _val(node), _val(source)
    state = ctx.state(source)
    if not isinstance(state, Value):
        raise Refused("reads a value the proof does not describe")
    if ctx.merged(val):
        raise Refused("merges the history or the rows with another dim")
    out_dims, in_dims = ctx.history_dims(val), ctx.history_dims(src)
    if len(ctx.row_dims(val)) != len(ctx.row_dims(src)):
        raise Refused("moves the rows into another dim")
    if order is not None:
        tails = {d: state.tails.get(order[d], ANY) for d in out_dims}
    else:
        if len(out_dims) != len(in_dims):
            raise Refused("adds or removes a dim of the history's width")
        tails = {o: state.tails.get(i, ANY) for o, i in zip(out_dims, in_dims)}
    return Value(tails, ctx.row_dims(val), state.lengths and not out_dims)


def view_like(node: fx.Node, ctx: Context) -> Value:
    """Positions move with their values (reshape, unsqueeze, squeeze): by the order of dims."""
    return _mapped(node, ctx, node.args[0], None)


def permuting(node: fx.Node, ctx: Context) -> Value:
    _no_sizes(node, ctx)
    ndim = _val(node).dim()
    op = node.target.overloadpacket
    if op is aten.permute:
        order = [d % ndim for d in node.args[1]]
    elif op in (aten.transpose, aten.swapaxes):
        a, b = node.args[1] % ndim, node.args[2] % ndim
        order = list(range(ndim))
        order[a], order[b] = b, a
    else:  # t
        order = list(range(ndim))[::-1]
    return _mapped(node, ctx, node.args[0], order)


def expanding(node: fx.Node, ctx: Context) -> Value:
    """``expand``: input dims right-aligned; a history dim made from a size-1 dim holds the
    input's (finite) values at every position."""
    val, src = _val(node), _val(node.args[0])
    state = ctx.state(node.args[0])
    if ctx.merged(val):
        raise Refused("expands to a size that merges the history or the rows")
    shift = val.dim() - src.dim()
    tails = {}
    for d in ctx.history_dims(val):
        i = d - shift
        if i >= 0 and _is(src.shape[i], ctx.history):
            tails[d] = state.tails.get(i, ANY)
        else:
            tails[d] = loose(state.tails.values())
    return Value(tails, ctx.row_dims(val))


def _slice_args(node: fx.Node) -> tuple:
    """``(dim, start, end, step)`` of an ``aten.slice`` node, defaults filled in."""
    defaults = [None, 0, None, None, 1]
    return tuple(list(node.args) + defaults[len(node.args) :])[1:]


def _full_slice(node: fx.Node, ctx: Context | None = None) -> bool:
    dim, start, end, step = _slice_args(node)
    if start not in (None, 0) or step != 1:
        return False
    if end is None or (isinstance(end, int) and end >= 2**62):
        return True
    src = _val(node.args[0])
    end_expr = expr_of(_val(end)) if isinstance(end, fx.Node) else expr_of(end)
    return end_expr is not None and end_expr == expr_of(src.shape[dim])


def selecting(node: fx.Node, ctx: Context) -> Value:
    """``select``/``slice``/``narrow`` of a dim that is neither the history nor the rows (or the
    whole of one)."""
    src = _val(node.args[0])
    dim = node.args[1] % max(src.dim(), 1)
    state = ctx.state(node.args[0])
    if node.target.overloadpacket is aten.slice and _full_slice(node, ctx):
        if isinstance(state, Value):
            return state  # the whole of a dim: the value itself
    tracked = _is(src.shape[dim], ctx.history) or _is(src.shape[dim], ctx.rows)
    if tracked and not (node.target.overloadpacket is aten.slice and _full_slice(node, ctx)):
        raise Refused("picks positions of the history or of the rows")
    _no_sizes(node, ctx, allowed=(3,))
    out = _val(node)
    if (
        not tracked
        and node.target.overloadpacket is aten.slice
        and _is(out.shape[dim], ctx.history)
    ):
        return _table_prefix(node, ctx, dim)
    return _mapped(node, ctx, node.args[0], None)


def _table_prefix(node: fx.Node, ctx: Context, dim: int) -> Value:
    """``table[:L]``: the first ``L`` rows of a fixed table (positions), a history dim whose
    position ``j`` holds row ``j`` at every width."""
    starts = node.args[2] if len(node.args) > 2 else 0
    steps = node.args[4] if len(node.args) > 4 else 1
    if starts not in (None, 0) or steps != 1:
        raise Refused("takes positions of a table that do not start at its first row")
    state = ctx.state(node.args[0])
    if not isinstance(state, Value) or state.rows:
        raise Refused("slices a value with rows to the history's width")
    out = _val(node)
    tails = {d: state.tails.get(d, ANY) for d in ctx.history_dims(out) if d != dim}
    tails[dim] = loose(state.tails.values())
    return Value(tails, ctx.row_dims(out))


def padding(node: fx.Node, ctx: Context) -> Value:
    """``pad``/``constant_pad_nd`` with a constant: of dims that are neither the history nor the
    rows, or of the history on its right with the value its tail holds, when every user takes a
    prefix no longer than the padding (``to_padded_dense(L)``: ``pad(rows, L)[:, :L]``).

    Identity: a row of length ``n`` holds ``v`` at every position ``j >= n`` of the padded value
    at any width ``w >= n``, so its first ``E <= p`` positions are the same at every width; the
    prefix has no dim of the history's width."""
    _no_sizes(node, ctx)
    src, out = _val(node.args[0]), _val(node)
    amounts = list(node.args[1])
    mode = node.args[2] if len(node.args) > 2 else node.kwargs.get("mode", "constant")
    if node.target.overloadpacket is aten.pad and mode != "constant":
        raise Refused(f"pads in mode {mode!r}, which reads the values next to the padding")
    value = node.args[-1] if len(node.args) > 2 else node.kwargs.get("value", 0.0)
    value = 0.0 if value is None or isinstance(value, str) else value
    state = ctx.state(node.args[0])
    if not isinstance(state, Value):
        raise Refused("reads a value the proof does not describe")
    tails = dict(state.tails)
    for k in range(len(amounts) // 2):
        dim = src.dim() - 1 - k
        left, right = amounts[2 * k], amounts[2 * k + 1]
        if left == 0 and right == 0:
            continue
        if _is(src.shape[dim], ctx.rows):
            raise Refused("pads the rows")
        if not _is(src.shape[dim], ctx.history):
            continue
        if left != 0 or not isinstance(right, int) or tails.get(dim) != Const(float(value)):
            raise Refused(
                f"pads the history other than on its right with the value its tail holds "
                f"({tails.get(dim, ANY)!r})"
            )
        for user in node.users:
            if not _prefix_of(user, node, dim, right):
                raise Refused(f"{user.name} reads the padded history past a prefix of {right}")
        del tails[dim]
    if len(ctx.history_dims(out)) != len(tails):
        raise Refused("changes the dims of the history's width")
    return Value(tails, ctx.row_dims(out))


def _prefix_of(user: fx.Node, padded: fx.Node, dim: int, most: int) -> bool:
    """``user`` is ``padded[..., :E]`` along ``dim`` with a fixed ``E <= most`` (through whole
    slices of other dims, which ``x[:, :E]`` traces to first)."""
    if getattr(user.target, "overloadpacket", None) is not aten.slice or user.args[0] is not padded:
        return False
    along, start, end, step = _slice_args(user)
    if along % _val(padded).dim() != dim:
        return _full_slice(user) and all(_prefix_of(u, user, dim, most) for u in user.users)
    return start in (None, 0) and step == 1 and isinstance(end, int) and 0 <= end <= most


def splitting(node: fx.Node, ctx: Context) -> list[Value] | Value:
    """``split``/``chunk``/``unbind`` along a dim that is neither the history nor the rows."""
    src = _val(node.args[0])
    dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % src.dim()
    if node.target.overloadpacket is aten.unbind:
        dim = (node.args[1] if len(node.args) > 1 else 0) % src.dim()
    if _is(src.shape[dim], ctx.history) or _is(src.shape[dim], ctx.rows):
        raise Refused("splits the history or the rows")
    state = ctx.state(node.args[0])
    outs = []
    for val in _val(node):
        dims_in = ctx.history_dims(src)
        dims_out = ctx.history_dims(val)
        outs.append(
            Value(
                {o: state.tails.get(i, ANY) for o, i in zip(dims_out, dims_in)}, ctx.row_dims(val)
            )
        )
    return outs


def picking(node: fx.Node, ctx: Context) -> Any:
    """``operator.getitem`` of a multi-output node."""
    state = ctx.state(node.args[0])
    if isinstance(state, list):
        return state[node.args[1]]
    if isinstance(state, Size):
        return state
    return CLEAN
