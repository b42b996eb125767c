"""The role-rule registry: the two tables (op -> rule, op -> lane), ``register`` that fills them,
and the :class:`RuleContext` every rule reads.

A rule receives a :class:`RuleContext` and returns ``ROWWISE`` (``None``) when the op is row-wise,
or a short reason why it is not (``role_rules.py`` states the identity). The tables are written
only by :func:`register` and read only through ``role_rules.lookup`` / ``role_rules.lane_of``,
which import every module of rules first.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Optional

import sympy
import torch
from torch import fx

from .batch_axis import BatchAxis
from ..ir.graph_meta import BATCH_AXIS
from ..ir.roles import Role
from ..ir.symbolic import depends_on

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


RULES: dict[Any, Rule] = {}
LANES: dict[Any, Lane] = {}
# op -> the argument in which it takes ``candidate_to_request`` when placed on request rows
REQUEST_INDEX: dict[Any, str] = {}


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


def register(
    *ops: Any, lane: Lane = Lane.WHOLE, request_index: Optional[str] = None
) -> Callable[[Rule], Rule]:
    """Register ``rule`` for ``ops`` (packets or overloads) with their :class:`Lane`.

    ``request_index`` names the argument of an op whose rows depend on which requests the
    call's candidates reference, not only on each row's own inputs: the share pass passes
    ``candidate_to_request`` in it to the op's request-placed copies and leaves it unset
    elsewhere, and the rule states the identity with it given,
    ``op(gather(x, idx)) == gather(op(x, idx), idx)``."""

    def wrap(rule: Rule) -> Rule:
        for op in ops:
            RULES[op] = rule
            LANES[op] = lane
            if request_index is not None:
                REQUEST_INDEX[op] = request_index
        return rule

    return wrap
