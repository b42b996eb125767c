"""Per-op role rules: is an ATen op row-wise for the given arguments?

An op is *row-wise* when it commutes with gathering rows along dim 0:
``op(x[idx], ...) == op(x, ...)[idx]`` for every index vector ``idx``. Only then may an op whose
inputs are request-side run once per request. One registry maps each op (by overload packet) to
a rule; family helpers register many ops at once, in the manner of batching rules.

A rule receives a :class:`RuleContext` and returns ``None`` when the op is row-wise, or a short
reason why it is not. The driver (``analysis.py``) calls a rule only when the op's inputs are
request-side or constant, and then also checks that every output has the batch dim first. An op
without a rule is computed per candidate, and the driver records that as a fallback.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, Optional

import sympy
import torch
from torch import fx

from . import op_groups
from .roles import Role
from .symbolic import depends_on

aten = torch.ops.aten
Rule = Callable[["RuleContext"], Optional[str]]
ROWWISE = None
SHAPE_ARGUMENTS = frozenset({"size", "shape", "sizes"})

_RULES: dict[Any, Rule] = {}


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
    rule = _RULES.get(target)
    if rule is None and isinstance(target, torch._ops.OpOverload):
        rule = _RULES.get(target.overloadpacket)
    if rule is None and op_groups.is_elementwise(target):
        rule = elementwise_rule
    return rule


def registered_ops() -> list[Any]:
    return list(_RULES)


def register(*ops: Any) -> Callable[[Rule], Rule]:
    def wrap(rule: Rule) -> Rule:
        for op in ops:
            _RULES[op] = rule
        return rule

    return wrap


# ---------------------------------------------------------------------------------------------
# Families


def elementwise_rule(ctx: RuleContext) -> Optional[str]:
    """Broadcasting elementwise ops: row-wise when every batched operand keeps dim 0 aligned."""
    if ctx.batch_scalars():
        return "a scalar operand depends on the batch size"
    out = ctx.out
    ndim = out.dim() if isinstance(out, torch.Tensor) else 0
    for val, node in ctx.batched_operands():
        if val.dim() != ndim:
            return "a batched operand is broadcast against a higher-rank tensor"
    return ROWWISE


def shape_only_rule(ctx: RuleContext) -> Optional[str]:
    """Ops that only move data by shape (views, permutes, expands, factories): row-wise whenever
    the batch dim stays leading, which the driver checks on every output. Batch sizes may appear
    as sizes, never as values (a fill value, a select index)."""
    if ctx.batch_scalars(exclude=SHAPE_ARGUMENTS):
        return "a scalar operand depends on the batch size"
    return ROWWISE


def reduction_rule(dim_arg: str = "dim") -> Rule:
    def rule(ctx: RuleContext) -> Optional[str]:
        x = ctx.val(ctx.node.args[0])
        dims = ctx.arg(dim_arg)
        if dims is None or dims == []:
            return "reduces over every dim, the batch dim included"
        dims = [dims] if isinstance(dims, int) else list(dims)
        if any(d % max(x.dim(), 1) == 0 for d in dims):
            return "reduces over the batch dim"
        return ROWWISE

    return rule


def along_dim_rule(dim_arg: str = "dim", default: int = 0) -> Rule:
    """Ops acting along one dim (softmax, cumsum, cat, slice, index_select...)."""

    def rule(ctx: RuleContext) -> Optional[str]:
        if ctx.batch_scalars():
            return "a scalar operand depends on the batch size"
        first = ctx.node.args[0]
        x = ctx.val(first[0] if isinstance(first, (list, tuple)) else first)
        d = ctx.arg(dim_arg, default)
        if d is None:
            return f"operates on the flattened tensor ({dim_arg}=None)"
        if d % max(x.dim(), 1) == 0:
            return "operates along the batch dim"
        if ctx.node.target.overloadpacket in _INDEX_ALONG_DIM:
            if ctx.role(ctx.arg("index")) != Role.CONST:
                return "index tensor is batched"
        return ROWWISE

    return rule


_INDEX_ALONG_DIM = {aten.index_select}


def multi_dim_rule(dim_arg: str) -> Rule:
    def rule(ctx: RuleContext) -> Optional[str]:
        x = ctx.val(ctx.node.args[0])
        dims = ctx.arg(dim_arg)
        dims = [dims] if isinstance(dims, int) else list(dims or [])
        if not dims:
            return f"operates on the flattened tensor ({dim_arg} empty)"
        if any(d % x.dim() == 0 for d in dims):
            return "operates along the batch dim"
        return ROWWISE

    return rule


def all_batched_aligned_rule(ctx: RuleContext) -> Optional[str]:
    """Batched matmul-like ops: every batched operand has the batch dim first, and constant
    operands carry no batch dim (they broadcast)."""
    out = ctx.out
    for val, node in ctx.tensor_args():
        if ctx.role(node) == Role.CONST:
            if val.dim() >= out.dim() and val.shape[0] != 1:
                return "a constant operand has its own leading dim where the batch dim is"
        elif val.dim() != out.dim():
            return "a batched operand does not share the output's leading batch dim"
    return ROWWISE


# ---------------------------------------------------------------------------------------------
# Registrations

register(*op_groups.SHAPE_ONLY)(shape_only_rule)


@register(aten.squeeze)
def _squeeze(ctx: RuleContext) -> Optional[str]:
    if ctx.node.target == aten.squeeze.default:
        # squeeze() drops every size-1 dim: with one request the batch dim would vanish.
        return "squeeze() without dims would drop the batch dim when there is one request"
    dims = ctx.arg("dim")
    dims = [dims] if isinstance(dims, int) else list(dims)
    x = ctx.val(ctx.node.args[0])
    if any(d % x.dim() == 0 for d in dims):
        return "squeezes the batch dim"
    return ROWWISE


# Elementwise ops need no registration: ``lookup`` gives every member of the family
# ``elementwise_rule``. prelu is elementwise but aligns its weight with dim 1, never the batch dim.
register(aten.prelu)(elementwise_rule)


@register(aten.slice_scatter)
def _slice_scatter(ctx: RuleContext) -> Optional[str]:
    """Functionalized ``x[:, a:b] = y``: row-wise when it writes along another dim than the batch
    dim, or when it writes every row (the result is then ``src`` itself)."""
    x = ctx.val(ctx.arg("self"))
    if ctx.batch_scalars(exclude=frozenset({"start", "end"})):
        return "a scalar operand depends on the batch size"
    if ctx.arg("dim") % x.dim() == 0:
        whole = ctx.arg("start") in (None, 0) and ctx.arg("step") == 1
        if not whole or tuple(ctx.val(ctx.arg("src")).shape) != tuple(x.shape):
            return "writes a range of batch rows"
    return all_batched_aligned_rule(ctx)


@register(aten.select_scatter)
def _select_scatter(ctx: RuleContext) -> Optional[str]:
    """Functionalized ``x[:, i] = y``."""
    if ctx.arg("dim") % ctx.val(ctx.arg("self")).dim() == 0:
        return "writes one batch row"
    if ctx.batch_scalars():
        return "a scalar operand depends on the batch size"
    return ROWWISE


@register(aten.tril, aten.triu)
def _triangular(ctx: RuleContext) -> Optional[str]:
    if ctx.val(ctx.node.args[0]).dim() < 3:
        return "triangular mask over a matrix whose rows are the batch"
    return ROWWISE


@register(aten.dropout, aten.feature_dropout, aten.alpha_dropout)
def _dropout(ctx: RuleContext) -> Optional[str]:
    if ctx.arg("train"):
        return "dropout in training mode is random"
    return ROWWISE


register(*op_groups.REDUCTIONS)(reduction_rule("dim"))
register(aten.max.dim, aten.min.dim, aten.argmax, aten.argmin, aten.median.dim)(
    reduction_rule("dim")
)
register(*op_groups.ALONG_DIM)(along_dim_rule("dim", default=-1))
register(aten.cat, aten.concat)(along_dim_rule("dim", default=0))


@register(aten.stack)
def _stack(ctx: RuleContext) -> Optional[str]:
    x = ctx.val(ctx.arg("tensors")[0])
    if ctx.arg("dim") % (x.dim() + 1) == 0:
        return "stacks along the batch dim"
    return ROWWISE
register(aten.flip)(multi_dim_rule("dims"))
register(aten.roll)(multi_dim_rule("dims"))


@register(aten.arange, aten.randperm)
def _values_from_batch_size(ctx: RuleContext) -> Optional[str]:
    return "values depend on the batch size"


@register(aten.repeat)
def _repeat(ctx: RuleContext) -> Optional[str]:
    x = ctx.val(ctx.node.args[0])
    repeats = ctx.arg("repeats")
    lead = len(repeats) - x.dim()
    if lead > 0 or repeats[0] != 1:
        return "repeats along the batch dim"
    return ROWWISE


@register(aten.repeat_interleave)
def _repeat_interleave(ctx: RuleContext) -> Optional[str]:
    d = ctx.arg("dim")
    if d is None or d % ctx.val(ctx.node.args[0]).dim() == 0:
        return "repeats along the batch dim"
    if ctx.role(ctx.arg("repeats")) != Role.CONST:
        return "repeat counts are batched"
    return ROWWISE


@register(aten.constant_pad_nd, aten.pad)
def _pad(ctx: RuleContext) -> Optional[str]:
    x = ctx.val(ctx.node.args[0])
    pad = list(ctx.arg("pad"))
    if len(pad) // 2 >= x.dim() and any(p != 0 for p in pad[2 * (x.dim() - 1):]):
        return "pads the batch dim"
    return ROWWISE


@register(aten.gather)
def _gather(ctx: RuleContext) -> Optional[str]:
    if ctx.arg("dim") % ctx.val(ctx.arg("self")).dim() == 0:
        return "gathers along the batch dim"
    if ctx.role(ctx.arg("self")) == Role.CONST or ctx.role(ctx.arg("index")) == Role.CONST:
        return "gather between a batched and an unbatched tensor mixes rows"
    return ROWWISE


@register(aten.embedding)
def _embedding(ctx: RuleContext) -> Optional[str]:
    if ctx.role(ctx.arg("weight")) != Role.CONST:
        return "the embedding table itself is batched"
    return ROWWISE


@register(aten.embedding_bag, aten._embedding_bag)
def _embedding_bag(ctx: RuleContext) -> Optional[str]:
    if ctx.role(ctx.arg("weight")) != Role.CONST:
        return "the embedding table itself is batched"
    if ctx.val(ctx.arg("indices")).dim() != 2:
        return "1-D indices with offsets pool across the batch"
    return ROWWISE


@register(aten.index.Tensor)
def _index(ctx: RuleContext) -> Optional[str]:
    x_node, indices = ctx.arg("self"), list(ctx.arg("indices"))
    positions = [i for i, ix in enumerate(indices) if ix is not None]
    if positions != list(range(positions[0], positions[-1] + 1)):
        return "non-adjacent advanced indices move the indexed dims first"
    if ctx.role(x_node) == Role.CONST:
        # Looking up a constant table with batched indices (an embedding written as indexing).
        if positions[0] != 0:
            return "indices of a constant table do not start at dim 0"
        ndim = max(ctx.val(indices[i]).dim() for i in positions)
        for i in positions:
            if ctx.role(indices[i]) != Role.CONST and ctx.val(indices[i]).dim() != ndim:
                return "batched index broadcast against a higher-rank index"
        return ROWWISE
    if positions[0] == 0:
        return "indexes the batch dim"
    if any(ctx.role(indices[i]) != Role.CONST for i in positions):
        return "batched index into a batched tensor"
    return ROWWISE


@register(aten.linear)
def _linear(ctx: RuleContext) -> Optional[str]:
    if ctx.role(ctx.arg("weight")) != Role.CONST or ctx.role(ctx.arg("bias")) != Role.CONST:
        return "the weight is batched"
    if ctx.val(ctx.arg("input")).dim() < 2:
        return "1-D input: the batch dim is the contracted dim"
    return ROWWISE


@register(aten.addmm)
def _addmm(ctx: RuleContext) -> Optional[str]:
    if ctx.role(ctx.arg("mat2")) != Role.CONST:
        return "the right operand is batched"
    bias = ctx.val(ctx.arg("self"))
    if ctx.role(ctx.arg("self")) != Role.CONST and bias.dim() != 2:
        return "a batched bias is broadcast"
    return ROWWISE


@register(aten.mm)
def _mm(ctx: RuleContext) -> Optional[str]:
    if ctx.role(ctx.arg("mat2")) != Role.CONST:
        return "the right operand is batched: the batch dim is contracted"
    return ROWWISE


register(aten.bmm, aten.baddbmm)(all_batched_aligned_rule)


@register(aten.matmul)
def _matmul(ctx: RuleContext) -> Optional[str]:
    a, b = ctx.val(ctx.arg("self")), ctx.val(ctx.arg("other"))
    ra, rb = ctx.role(ctx.arg("self")), ctx.role(ctx.arg("other"))
    if a.dim() < 2 or b.dim() < 2:
        return "vector operand"
    if rb != Role.CONST and b.dim() == 2:
        return "a 2-D batched right operand contracts the batch dim"
    if ra != Role.CONST and a.dim() == 2 and rb == Role.CONST:
        return ROWWISE
    return all_batched_aligned_rule(ctx)


@register(aten.einsum)
def _einsum(ctx: RuleContext) -> Optional[str]:
    equation = ctx.arg("equation").replace(" ", "")
    if "..." in equation or "->" not in equation:
        return "einsum with ellipsis or implicit output"
    lhs, out_spec = equation.split("->")
    specs = lhs.split(",")
    operands = ctx.arg("tensors")
    batch_letters = {specs[i][0] for i, x in enumerate(operands) if ctx.role(x) != Role.CONST}
    if len(batch_letters) != 1:
        return "batched operands disagree on their leading letter"
    (letter,) = batch_letters
    if not out_spec or out_spec[0] != letter:
        return "the batch letter is not the output's leading dim"
    for spec, x in zip(specs, operands):
        if ctx.role(x) == Role.CONST and letter in spec:
            return "a constant operand shares the batch letter"
        if ctx.role(x) != Role.CONST and spec.count(letter) != 1:
            return "the batch letter repeats within an operand"
    return ROWWISE


@register(aten.scaled_dot_product_attention)
def _sdpa(ctx: RuleContext) -> Optional[str]:
    if ctx.arg("dropout_p", 0.0):
        return "attention dropout is random"
    return all_batched_aligned_rule(ctx)


@register(aten.layer_norm, aten.native_layer_norm, aten.rms_norm)
def _layer_norm(ctx: RuleContext) -> Optional[str]:
    x = ctx.val(ctx.arg("input"))
    if len(ctx.arg("normalized_shape")) >= x.dim():
        return "normalizes over the batch dim"
    for name in ("weight", "bias"):
        if ctx.role(ctx.arg(name)) != Role.CONST:
            return f"batched {name}"
    return ROWWISE


@register(aten.group_norm, aten.native_group_norm)
def _group_norm(ctx: RuleContext) -> Optional[str]:
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
    return ROWWISE


@register(operator.getitem)
def _getitem(ctx: RuleContext) -> Optional[str]:
    return ROWWISE


def _register_rocs_rules() -> None:
    from .kernels import embedding_bag_rows  # noqa: F401 - defines rocs::embedding_bag_rows

    register(torch.ops.rocs.embedding_bag_rows)(_embedding)


_register_rocs_rules()
