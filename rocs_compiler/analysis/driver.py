"""Role analysis: the driver that assigns every node a role.

The driver walks the graph once in topological order. Inputs get their roles from the request
declaration; weights are CONST. For an op it joins the input roles: all CONST gives CONST, any
CANDIDATE gives CANDIDATE, and otherwise the op's rule (``role_rules``) decides whether the op is
row-wise and may stay REQUEST. A REQUEST value also records its batch axis (``batch_axis.py``):
the dim that holds the requests, anywhere in its shape and possibly merged with other dims; the
rules read their inputs' axes, and the driver derives the output's. Sizes are values too: an int
that involves the batch symbol is a *batch size* and is REQUEST (the rewrite evaluates it to R
or N by its consumer's role).
:func:`infer_node` is one step of that walk, reading the input roles from the nodes; the rewrite
engine takes the same steps as it sweeps the graph.

Only this driver writes ``node.meta["rocs_role"]``, ``node.meta["rocs_reason"]`` and
``node.meta["rocs_batch_axis"]``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import sympy
import torch
from torch import fx
from torch.utils._sympy.symbol import SymT, symbol_is_type

from . import batch_axis, op_groups, role_rules
from .batch_axis import LEADING
from ..errors import CompileError
from ..ir.graph_meta import BATCH_AXIS, REASON, ROLE
from ..ir.roles import Role
from ..ir.symbolic import expr_of, is_batched


@dataclass(frozen=True)
class Fallback:
    """A node that saw only request-side inputs but had to run per candidate."""

    node: str
    op: str
    reason: str
    module: str


@dataclass
class Analysis:
    roles: dict[fx.Node, Role]
    fallbacks: list[Fallback] = field(default_factory=list)

    def role(self, node: fx.Node) -> Role:
        return self.roles[node]


def op_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return getattr(target, "__name__", str(target))


def source_module(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    if path.startswith("_empty_nn_module_stack"):  # export's stand-in where no module called it
        return ""
    for prefix in ("L['self'].model.", "model.", "L['self']."):
        if path.startswith(prefix):
            path = path[len(prefix):]
    return "" if path in ("model", "L['self'].model") else path


def _node_args(node: fx.Node) -> Iterable[fx.Node]:
    return node.all_input_nodes


def _is_scalar_value(val: Any) -> bool:
    return isinstance(val, (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool))


def analyze(gm: fx.GraphModule, request_placeholders: set[str], symbol: sympy.Symbol) -> Analysis:
    """Infer every node's role, in topological order; collect the fallbacks."""
    result = Analysis({})
    for node in gm.graph.nodes:
        infer_node(node, request_placeholders, symbol)
        result.roles[node] = node.meta[ROLE]
        reason = node.meta[REASON]
        if reason is not None and node.op == "call_function":
            result.fallbacks.append(
                Fallback(node.name, op_name(node.target), reason, source_module(node))
            )
    return result


def infer_node(node: fx.Node, request_placeholders: set[str], symbol: sympy.Symbol) -> None:
    """Write ``node``'s role and fallback reason, reading its inputs' roles from their meta.

    One step of :func:`analyze`; the rewrite engine calls it node by node, in topological order,
    so that the inputs are always inferred first.
    """
    role, reason, axes = _infer(node, _META_ROLES, request_placeholders, symbol)
    node.meta[ROLE] = role
    node.meta[REASON] = reason
    if axes is None:
        node.meta.pop(BATCH_AXIS, None)
    else:
        node.meta[BATCH_AXIS] = axes


class _MetaRoles:
    """The inferred roles as the rules read them (``roles[node]``): stored on the nodes."""

    def __getitem__(self, node: fx.Node) -> Role:
        try:
            return node.meta[ROLE]
        except KeyError:
            raise CompileError(f"node {node.name} is read before its role was inferred") from None


_META_ROLES = _MetaRoles()
NO_RULE = "no role rule for"  # how a fallback's reason starts when its op has no rule


def _infer(node, roles, request_placeholders, symbol):
    """(role, fallback reason, batch axes); a reason is set only where request-side sharing was
    lost, axes only on REQUEST tensor values."""
    val = node.meta.get("val")
    if node.op == "placeholder":
        if node.name in request_placeholders:
            return Role.REQUEST, None, LEADING
        return (Role.CANDIDATE if is_batched(val, symbol) else Role.CONST), None, None
    if node.op == "get_attr":
        return Role.CONST, None, None
    if node.op == "output":
        return Role.join_all(roles[a] for a in _node_args(node)), None, None
    inputs = Role.join_all(roles[a] for a in _node_args(node))
    if _is_scalar_value(val):
        return (*_scalar_role(node, val, inputs, symbol), None)
    target = node.target
    if op_groups.is_random(target):
        return Role.CANDIDATE, ("random op" if inputs == Role.REQUEST else None), None
    if op_groups.is_mutating(target):
        return Role.CANDIDATE, ("mutates its input" if inputs == Role.REQUEST else None), None
    if inputs == Role.CONST:
        return Role.CONST, None, None
    if inputs == Role.CANDIDATE:
        return Role.CANDIDATE, None, None
    rule = role_rules.lookup(target)
    if rule is None:
        return Role.CANDIDATE, f"{NO_RULE} {op_name(target)}", None
    ctx = role_rules.RuleContext(node, symbol, roles, role_rules.bind_arguments(node))
    try:
        reason = rule(ctx)
        axes = None if reason is not None else _output_axes(node, ctx, val, symbol)
    except Exception as err:  # noqa: BLE001 - re-raised with the node and its input roles
        detail = ", ".join(f"{a.name}={roles[a].name}" for a in _node_args(node))
        raise CompileError(
            f"role rule for {op_name(target)} failed at node {node.name} ({detail}): {err}"
        ) from err
    if reason is None and isinstance(axes, str):
        reason = axes
    if reason is not None:
        return Role.CANDIDATE, reason, None
    return Role.REQUEST, None, axes


def _output_axes(node, ctx, val, symbol):
    """The batch axes of a row-wise op's outputs (one per tensor of a tuple, None for outputs
    nothing reads), or the reason the op has none."""
    if node.target is operator.getitem:
        axes = ctx.axis(node.args[0])
        axis = axes[node.args[1]] if isinstance(axes, tuple) else None
        return axis if axis is not None else "reads an output without a batch dim"
    if op_groups.packet(node.target) in op_groups.RESHAPES:
        source = node.args[0]
        return batch_axis.reshape_axis(ctx.val(source), ctx.axis(source), val, symbol)
    inputs = [ctx.axis(n) for _, n in ctx.batched_operands()]
    sized = ctx.batch_scalars()
    if isinstance(val, torch.Tensor):
        return batch_axis.output_axis(val, inputs, symbol, sized_from_batch=sized)
    used = _used_indices(node, val)
    axes = []
    for i, item in enumerate(val):
        if i not in used or not isinstance(item, torch.Tensor):
            axes.append(None)
            continue
        axis = batch_axis.output_axis(item, inputs, symbol, sized_from_batch=sized)
        if isinstance(axis, str):
            return axis
        axes.append(axis)
    return tuple(axes)


def _used_indices(node: fx.Node, val: Any) -> set[int]:
    """The items of a tuple output that the graph reads (every item unless only ``getitem``s
    read it: batch norm's saved statistics are empty tensors nothing reads)."""
    if node.users and all(u.target is operator.getitem for u in node.users):
        return {u.args[1] for u in node.users}
    return set(range(len(val)))


def _is_input_size(symbol) -> bool:
    """A backed size symbol (an input's dynamic size), not an unbacked one (read from data)."""
    return symbol_is_type(symbol, SymT.SIZE)


def _scalar_role(node, val, inputs, symbol) -> tuple[Role, Optional[str]]:
    expr = expr_of(val)
    free = expr.free_symbols if expr is not None else set()
    others = free - {symbol}
    if others and symbol not in free and all(map(_is_input_size, others)):
        # A size of the call's inputs other than the batch (a history's width) is the same in
        # every layout of one call: a constant of the call (``share.py`` reads it off its inputs
        # where they are).
        return Role.CONST, None
    if others:
        if inputs == Role.CONST:
            return Role.CONST, None
        return Role.CANDIDATE, ("data-dependent scalar" if inputs == Role.REQUEST else None)
    return (Role.REQUEST if symbol in free else Role.CONST), None
