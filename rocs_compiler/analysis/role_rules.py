"""Per-op role rules: is an ATen op row-wise for the given arguments?

An op is *row-wise* when it commutes with gathering requests along its operands' batch axes
(``batch_axis.py``): ``op(gather(x, idx), ...) == gather(op(x, ...), idx)`` for every index
vector ``idx``. Only then may an op whose inputs are request-side run once per request. One
registry maps each op (by overload packet) to a rule; family helpers register many ops at once,
in the manner of batching rules.

A rule receives a :class:`RuleContext` and returns ``None`` when the op is row-wise, or a short
reason why it is not: it checks that the op does not act *along* a batch axis (reduce, contract,
index or pad it). The driver (``driver.py``) calls a rule only when the op's inputs are
request-side or constant, and then derives the output's batch axis, which also checks that the
batched operands line up (one dim of the output holds the batch, merged the same way in every
operand). An op without a rule is computed per candidate, and the driver records that as a
fallback.

The same registration declares the op's :class:`Lane`: how each element of its output depends on
the elements of its inputs, which picks the op's taint rule in the lane analysis
(``segments.py``). A row-wise op whose inputs carry no candidate taint never has a tainted
output under its lane, so the two analyses agree on every value the role analysis calls REQUEST
(checked over samples of every lane in ``tests/analysis/test_lane_rules.py``). Ops outside ATen
(``rocs::`` ops) register their rules in the module that defines them.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import operator
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable, Optional

import sympy
import torch
from torch import fx

from . import op_groups
from .batch_axis import BatchAxis
from ..ir.graph_meta import BATCH_AXIS
from ..ir.roles import Role
from ..ir.symbolic import depends_on

aten = torch.ops.aten
Rule = Callable[["RuleContext"], Optional[str]]
ROWWISE = None
SHAPE_ARGUMENTS = frozenset({"size", "shape", "sizes"})


class Lane(enum.Enum):
    """How an op's output elements depend on its input elements (its taint rule in
    ``segments.py``)."""

    WHOLE = "whole"  # every output element may read every input element
    ELEMENTWISE = "elementwise"  # out[i] reads in[i] of each operand, broadcast
    MOVEMENT = "movement"  # moves or copies elements without combining them
    ITEM = "item"  # one item of a tuple
    LOOKUP = "lookup"  # out[..., :] reads the ids at ``...`` (pooled over trailing id dims)
    LINEAR = "linear"  # out[..., j] reads the row x[..., :]
    PRODUCT = "product"  # mm, bmm, matmul
    BIASED_PRODUCT = "biased_product"  # addmm, baddbmm
    EINSUM = "einsum"
    ATTENTION = "attention"  # a query row reads its own row and every key and value
    REDUCTION = "reduction"  # ``op(self, dim, keepdim)``: reads the reduced elements
    ALONG_DIM = "along_dim"  # same shape, reads the whole line along ``dim`` (softmax, cumsum)
    TRAILING_NORM = "trailing_norm"  # reads the normalized trailing dims


_RULES: dict[Any, Rule] = {}
_LANES: dict[Any, Lane] = {}


@dataclass
class RuleContext:
    node: fx.Node
    symbol: sympy.Symbol
    roles: dict  # fx.Node -> Role
    _arguments: dict

    def arg(self, name: str, default: Any = None) -> Any:
        return self._arguments.get(name, default)

    def val(self, x: Any) -> Any:
        return x.meta.get("val") if isinstance(x, fx.Node) else x

    def axis(self, x: Any) -> Any:
        """The batch axis of a REQUEST node (a tuple of them for a tuple); None otherwise."""
        if isinstance(x, fx.Node) and self.role(x) == Role.REQUEST:
            return x.meta.get(BATCH_AXIS)
        return None

    def on_batch_axis(self, x: Any, dim: int) -> bool:
        """True when ``dim`` of the tensor node ``x`` is its batch axis."""
        axis = self.axis(x)
        return isinstance(axis, BatchAxis) and dim % max(self.val(x).dim(), 1) == axis.dim

    def batched_dim(self) -> tuple[Any, Optional[BatchAxis]]:
        """(node, axis) of the first batched tensor operand."""
        for _, node in self.batched_operands():
            return node, self.axis(node)
        return None, None

    def role(self, x: Any) -> Role:
        if isinstance(x, fx.Node):
            return self.roles[x]
        if isinstance(x, (list, tuple)):
            return Role.join_all(self.role(v) for v in x)
        return Role.CONST

    @property
    def out(self) -> Any:
        return self.node.meta.get("val")

    def tensor_args(self) -> list[tuple[Any, fx.Node]]:
        """(fake value, node) for every tensor argument, lists flattened."""
        found = []

        def visit(x):
            if isinstance(x, (list, tuple)):
                for v in x:
                    visit(v)
            elif isinstance(x, fx.Node) and isinstance(x.meta.get("val"), torch.Tensor):
                found.append((x.meta["val"], x))

        for value in self._arguments.values():
            visit(value)
        return found

    def batch_scalars(self, exclude: frozenset = frozenset()) -> bool:
        """True when a scalar argument (outside ``exclude``) depends on the batch size."""

        def visit(x):
            if isinstance(x, (list, tuple)):
                return any(visit(v) for v in x)
            if isinstance(x, fx.Node):
                v = x.meta.get("val")
                return not isinstance(v, torch.Tensor) and depends_on(v, self.symbol)
            return False

        return any(visit(v) for k, v in self._arguments.items() if k not in exclude)

    def batched_operands(self) -> list[tuple[Any, fx.Node]]:
        return [(v, n) for v, n in self.tensor_args() if self.role(n) != Role.CONST]


def bind_arguments(node: fx.Node) -> dict:
    """Arguments of an ATen call by schema name (defaults filled in)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return {f"arg{i}": a for i, a in enumerate(node.args)} | dict(node.kwargs)
    out = {}
    schema_args = target._schema.arguments
    for i, a in enumerate(schema_args):
        if i < len(node.args):
            out[a.name] = node.args[i]
        elif a.name in node.kwargs:
            out[a.name] = node.kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
    return out


def lookup(target: Any) -> Optional[Rule]:
    """The op's own rule, else its family's (every elementwise op shares one)."""
    return _registered(_RULES, target, elementwise_rule)


def lane_of(target: Any) -> Optional[Lane]:
    """The op's lane, found as :func:`lookup` finds its rule; None for an op without a rule."""
    return _registered(_LANES, target, Lane.ELEMENTWISE)


def _registered(table: dict, target: Any, elementwise: Any) -> Any:
    """``table``'s entry for the overload, else for its packet, else ``elementwise`` for an
    elementwise op; None otherwise."""
    entry = table.get(target)
    if entry is None and isinstance(target, torch._ops.OpOverload):
        entry = table.get(target.overloadpacket)
    if entry is None and op_groups.is_elementwise(target):
        entry = elementwise
    return entry


def registered_ops() -> list[Any]:
    return list(_RULES)


def register(*ops: Any, lane: Lane = Lane.WHOLE) -> Callable[[Rule], Rule]:
    """Register ``rule`` for ``ops`` (packets or overloads) with their :class:`Lane`."""

    def wrap(rule: Rule) -> Rule:
        for op in ops:
            _RULES[op] = rule
            _LANES[op] = lane
        return rule

    return wrap


# ---------------------------------------------------------------------------------------------
# Families


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


def _last(ndim: int) -> list[int]:
    return [ndim - 1]


def _second_last(ndim: int) -> list[int]:
    return [ndim - 2] if ndim >= 2 else [0]


def _attention_dims(ndim: int) -> list[int]:
    return [ndim - 2, ndim - 1]


# ---------------------------------------------------------------------------------------------
# Registrations

# Copies and conversions compute elementwise (their lane reads one element); the rest move.
_COPIES = frozenset(op for op in op_groups.SHAPE_ONLY if op_groups.is_elementwise(op))
register(*(op_groups.SHAPE_ONLY - _COPIES), lane=Lane.MOVEMENT)(shape_only_rule)
register(*_COPIES, lane=Lane.ELEMENTWISE)(shape_only_rule)


@register(aten.squeeze, lane=Lane.MOVEMENT)
def _squeeze(ctx: RuleContext) -> Optional[str]:
    if ctx.node.target == aten.squeeze.default:
        # squeeze() drops every size-1 dim: with one request the batch dim would vanish.
        return "squeeze() without dims would drop the batch dim when there is one request"
    dims = ctx.arg("dim")
    dims = [dims] if isinstance(dims, int) else list(dims)
    if any(ctx.on_batch_axis(ctx.node.args[0], d) for d in dims):
        return "squeezes the batch dim"
    return ROWWISE


# Elementwise ops need no registration: ``lookup`` gives every member of the family
# ``elementwise_rule``. prelu is elementwise but aligns its weight with dim 1, never the batch dim.
register(aten.prelu)(elementwise_rule)


@register(aten.slice_scatter)
def _slice_scatter(ctx: RuleContext) -> Optional[str]:
    """Functionalized ``x[:, a:b] = y``: row-wise when it writes along another dim than the batch
    dim, or when it writes every row (the result is then ``src`` itself)."""
    target = ctx.arg("self")
    if ctx.batch_scalars(exclude=frozenset({"start", "end"})):
        return "a scalar operand depends on the batch size"
    if ctx.role(target) == Role.CONST:
        return "writes batched rows into a constant"
    if ctx.on_batch_axis(target, ctx.arg("dim")):
        whole = ctx.arg("start") in (None, 0) and ctx.arg("step") == 1
        if not whole or tuple(ctx.val(ctx.arg("src")).shape) != tuple(ctx.val(target).shape):
            return "writes a range of batch rows"
    return ROWWISE


@register(aten.select_scatter)
def _select_scatter(ctx: RuleContext) -> Optional[str]:
    """Functionalized ``x[:, i] = y``."""
    if ctx.role(ctx.arg("self")) == Role.CONST:
        return "writes batched rows into a constant"
    if ctx.on_batch_axis(ctx.arg("self"), ctx.arg("dim")):
        return "writes one batch row"
    if ctx.batch_scalars():
        return "a scalar operand depends on the batch size"
    return ROWWISE


@register(aten.tril, aten.triu)
def _triangular(ctx: RuleContext) -> Optional[str]:
    x = ctx.node.args[0]
    if any(ctx.on_batch_axis(x, d) for d in _attention_dims(ctx.val(x).dim())):
        return "triangular mask over a matrix whose rows or columns are the batch"
    return ROWWISE


# Set for one compile (``Options.request_dropout == "per_request"``, :func:`dropout_per_request`).
_DROPOUT_PER_REQUEST: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "rocs_dropout_per_request", default=False
)


@contextlib.contextmanager
def dropout_per_request(enabled: bool) -> Iterator[None]:
    """Within this block, dropout in training mode on request-side values is row-wise: run on
    the R request rows, it draws one mask per request, which every impression of the request
    then shares. That changes the model (eager draws one mask per impression row), so it is
    an option the user asks for, never a default."""
    token = _DROPOUT_PER_REQUEST.set(enabled)
    try:
        yield
    finally:
        _DROPOUT_PER_REQUEST.reset(token)


def dropout_is_per_request() -> bool:
    """True inside :func:`dropout_per_request` (enabled)."""
    return _DROPOUT_PER_REQUEST.get()


@register(aten.dropout, aten.feature_dropout, aten.alpha_dropout, lane=Lane.ELEMENTWISE)
def _dropout(ctx: RuleContext) -> Optional[str]:
    # ``p == 0`` returns its input without drawing (``aten::dropout``), in training mode too.
    if ctx.arg("train") and ctx.arg("p") and not dropout_is_per_request():
        return "dropout in training mode is random"
    return ROWWISE


_BY_DIM = op_groups.REDUCTIONS_DIM_KEEPDIM | {aten.any, aten.all}  # (self, dim, keepdim, ...)
register(*_BY_DIM, lane=Lane.REDUCTION)(reduction_rule("dim"))
register(*(op_groups.REDUCTIONS - _BY_DIM))(reduction_rule("dim"))
register(aten.max.dim, aten.min.dim, aten.argmax, aten.argmin, aten.median.dim)(
    reduction_rule("dim")
)
register(aten.max.default, aten.min.default)(reduction_rule("dim"))  # over every dim
register(*op_groups.ALONG_DIM_SAME_SHAPE, lane=Lane.ALONG_DIM)(along_dim_rule("dim", default=-1))
register(*op_groups.ALONG_DIM_MOVEMENT, lane=Lane.MOVEMENT)(along_dim_rule("dim", default=-1))
register(*op_groups.ALONG_DIM_OTHER)(along_dim_rule("dim", default=-1))
register(aten.cat, aten.concat, lane=Lane.MOVEMENT)(along_dim_rule("dim", default=0))


@register(aten.stack, lane=Lane.MOVEMENT)
def _stack(ctx: RuleContext) -> Optional[str]:
    """A new dim never splits the batch: stacking is row-wise at any position."""
    return ROWWISE
register(aten.flip, aten.roll, lane=Lane.MOVEMENT)(multi_dim_rule("dims"))


@register(aten.arange, aten.randperm)
def _values_from_batch_size(ctx: RuleContext) -> Optional[str]:
    return "values depend on the batch size"


@register(aten.repeat, lane=Lane.MOVEMENT)
def _repeat(ctx: RuleContext) -> Optional[str]:
    x = ctx.node.args[0]
    repeats = ctx.arg("repeats")
    lead = len(repeats) - ctx.val(x).dim()
    if ctx.axis(x) is not None and repeats[lead + ctx.axis(x).dim] != 1:
        return "repeats along the batch dim"
    return ROWWISE


@register(aten.repeat_interleave)
def _repeat_interleave(ctx: RuleContext) -> Optional[str]:
    d = ctx.arg("dim")
    if d is None or ctx.on_batch_axis(ctx.node.args[0], d):
        return "repeats along the batch dim"
    if ctx.role(ctx.arg("repeats")) != Role.CONST:
        return "repeat counts are batched"
    return ROWWISE


@register(aten.constant_pad_nd, aten.pad)
def _pad(ctx: RuleContext) -> Optional[str]:
    x = ctx.node.args[0]
    pad = list(ctx.arg("pad"))
    if ctx.axis(x) is None or ctx.batch_scalars():
        return "pads by the batch size"
    from_last = ctx.val(x).dim() - 1 - ctx.axis(x).dim  # pad pairs start at the last dim
    if any(p != 0 for p in pad[2 * from_last: 2 * from_last + 2]):
        return "pads the batch dim"
    return ROWWISE


@register(aten.gather)
def _gather(ctx: RuleContext) -> Optional[str]:
    if ctx.on_batch_axis(ctx.batched_dim()[0], ctx.arg("dim")):
        return "gathers along the batch dim"
    if ctx.role(ctx.arg("self")) == Role.CONST or ctx.role(ctx.arg("index")) == Role.CONST:
        return "gather between a batched and an unbatched tensor mixes rows"
    return ROWWISE


@register(aten.embedding, lane=Lane.LOOKUP)
def table_lookup_rule(ctx: RuleContext) -> Optional[str]:
    """A constant table looked up with batched ids: each output row reads its own ids."""
    if ctx.role(ctx.arg("weight")) != Role.CONST:
        return "the embedding table itself is batched"
    return ROWWISE


@register(aten.one_hot, lane=Lane.LOOKUP)
def _one_hot(ctx: RuleContext) -> Optional[str]:
    """``one_hot(x, K)``: a lookup of ``x`` in the K x K identity, once ``K`` is given."""
    if ctx.arg("num_classes", -1) < 0:
        return "the number of classes is the batch's largest id"
    return ROWWISE


@register(aten.embedding_bag, aten._embedding_bag)
def _embedding_bag(ctx: RuleContext) -> Optional[str]:
    if ctx.role(ctx.arg("weight")) != Role.CONST:
        return "the embedding table itself is batched"
    if ctx.val(ctx.arg("indices")).dim() != 2:
        return "1-D indices with offsets pool across the batch"
    axis = ctx.axis(ctx.arg("indices"))
    if axis is None:
        return "per-sample weights are batched, the bags are not"
    if axis.dim != 0:
        return "pools along the batch dim"
    return ROWWISE


@register(aten.index.Tensor)
def _index(ctx: RuleContext) -> Optional[str]:
    """``x[..., i, ...]`` with index tensors. A constant table looked up with batched indices is
    row-wise along the indices' batch (an embedding written as indexing); a batched tensor
    indexed with constant indices is row-wise unless an index runs along its batch dim."""
    x_node, indices = ctx.arg("self"), list(ctx.arg("indices"))
    positions = [i for i, ix in enumerate(indices) if ix is not None]
    if ctx.role(x_node) == Role.CONST:
        return ROWWISE
    if any(ctx.on_batch_axis(x_node, i) for i in positions):
        return "indexes the batch dim"
    if any(ctx.role(indices[i]) != Role.CONST for i in positions):
        return "batched index into a batched tensor"
    return ROWWISE


@register(aten.linear, lane=Lane.LINEAR)
def _linear(ctx: RuleContext) -> Optional[str]:
    if ctx.role(ctx.arg("weight")) != Role.CONST or ctx.role(ctx.arg("bias")) != Role.CONST:
        return "the weight is batched"
    x = ctx.arg("input")
    if ctx.on_batch_axis(x, -1):
        return "the batch dim is the contracted dim"
    return ROWWISE


_mm_rule = contracting_rule(("mat1", _last), ("mat2", _second_last))
_bmm_rule = contracting_rule(
    ("self", _last), ("batch1", _last), ("mat2", _second_last), ("batch2", _second_last)
)
register(aten.mm, lane=Lane.PRODUCT)(_mm_rule)
register(aten.addmm, lane=Lane.BIASED_PRODUCT)(_mm_rule)
register(aten.bmm, lane=Lane.PRODUCT)(_bmm_rule)
register(aten.baddbmm, lane=Lane.BIASED_PRODUCT)(_bmm_rule)
register(aten.matmul, lane=Lane.PRODUCT)(contracting_rule(("self", _last), ("other", _second_last)))


@register(aten.einsum, lane=Lane.EINSUM)
def _einsum(ctx: RuleContext) -> Optional[str]:
    """Row-wise when every batched operand carries its batch under one letter, which the output
    keeps and no constant operand uses."""
    equation = ctx.arg("equation").replace(" ", "")
    if "..." in equation or "->" not in equation:
        return "einsum with ellipsis or implicit output"
    lhs, out_spec = equation.split("->")
    specs = lhs.split(",")
    operands = ctx.arg("tensors")
    batched = [(spec, x) for spec, x in zip(specs, operands) if ctx.role(x) != Role.CONST]
    letters = {spec[ctx.axis(x).dim] for spec, x in batched}
    if len(letters) != 1:
        return "batched operands disagree on the batch letter"
    (letter,) = letters
    if letter not in out_spec:
        return "contracts the batch letter"
    for spec, x in zip(specs, operands):
        if ctx.role(x) == Role.CONST and letter in spec:
            return "a constant operand shares the batch letter"
        if ctx.role(x) != Role.CONST and spec.count(letter) != 1:
            return "the batch letter repeats within an operand"
    return ROWWISE


_sdpa_products = contracting_rule(
    ("query", _attention_dims), ("key", _attention_dims), ("value", _attention_dims),
    ("attn_mask", _attention_dims),
)  # fmt: skip


@register(aten.scaled_dot_product_attention, lane=Lane.ATTENTION)
def _sdpa(ctx: RuleContext) -> Optional[str]:
    # With ``request_dropout="per_request"`` request-only attention draws one mask per request,
    # as a dropout does (:func:`dropout_per_request`).
    if ctx.arg("dropout_p", 0.0) and not dropout_is_per_request():
        return "attention dropout is random"
    return _sdpa_products(ctx)


@register(*op_groups.TRAILING_NORMS, lane=Lane.TRAILING_NORM)
@register(aten.native_layer_norm)
def _layer_norm(ctx: RuleContext) -> Optional[str]:
    x = ctx.arg("input")
    if ctx.on_batch_axis(x, -1) or (
        ctx.axis(x) is not None
        and ctx.axis(x).dim >= ctx.val(x).dim() - len(ctx.arg("normalized_shape"))
    ):
        return "normalizes over the batch dim"
    for name in ("weight", "bias"):
        if ctx.role(ctx.arg(name)) != Role.CONST:
            return f"batched {name}"
    return ROWWISE


@register(aten.group_norm, aten.native_group_norm)
def _group_norm(ctx: RuleContext) -> Optional[str]:
    axis = ctx.axis(ctx.arg("input"))
    if axis is not None and axis.dim != 0:
        return "normalizes over the batch dim"
    for name in ("weight", "bias"):
        if ctx.role(ctx.arg(name)) != Role.CONST:
            return f"batched {name}"
    return ROWWISE


@register(aten.batch_norm, aten._native_batch_norm_legit_no_training, aten.native_batch_norm)
def _batch_norm(ctx: RuleContext) -> Optional[str]:
    if ctx.arg("training", False):
        return "batch norm in training mode uses batch statistics"
    for name in ("weight", "bias", "running_mean", "running_var"):
        if ctx.role(ctx.arg(name)) != Role.CONST:
            return f"batched {name}"
    return ROWWISE


@register(aten.conv1d, aten.conv2d, aten.convolution)
def _conv(ctx: RuleContext) -> Optional[str]:
    if ctx.role(ctx.arg("weight")) != Role.CONST or ctx.role(ctx.arg("bias")) != Role.CONST:
        return "the convolution weight is batched"
    axis = ctx.axis(ctx.arg("input"))
    if axis is not None and axis.dim != 0:
        return "convolves over the batch dim"
    return ROWWISE


@register(aten.gru.input, aten.lstm.input, aten.rnn_tanh.input, aten.rnn_relu.input)
def _recurrent(ctx: RuleContext) -> Optional[str]:
    """torch's RNN, GRU and LSTM over a padded sequence: each sequence of the batch runs on its
    own, along dim 0 of ``input`` when ``batch_first`` (else dim 1) and dim 1 of every state."""
    if ctx.arg("train") and ctx.arg("dropout"):
        return "recurrent dropout in training mode is random"
    if ctx.role(ctx.arg("params")) != Role.CONST:
        return "the recurrent weights are batched"
    x = ctx.arg("input")
    sequence_batch = 0 if ctx.arg("batch_first") else 1
    if ctx.role(x) != Role.CONST and not ctx.on_batch_axis(x, sequence_batch):
        return "the batch is not the input's batch dim"
    states = ctx.arg("hx")
    for state in states if isinstance(states, (list, tuple)) else [states]:
        if ctx.role(state) != Role.CONST and not ctx.on_batch_axis(state, 1):
            return "the batch is not the state's batch dim"
    return ROWWISE


@register(operator.getitem, lane=Lane.ITEM)
def _getitem(ctx: RuleContext) -> Optional[str]:
    return ROWWISE

