"""Whether a model's outputs read a padded history's tail: the proof behind jagged calls.

Identity: when every output is the same for a row padded to the batch's width ``L`` and for the
same row cut to any width at or past its own length (``analysis/padded_tails.py`` proves it node
by node), and no output row reads another row, then a call whose requests are grouped by length,
each group's histories cut to the group's longest, returns the call's outputs: each candidate's
row is computed from its own request's history, cut where only padding is lost.

A row's length is read from the call in one of two ways (:class:`LengthSource`):

- **padding**: an id input whose positions past the length hold one padding id, the one the model
  compares with to build its mask (``hist_ids == 0``); the length is one past the last other id;
- **lengths**: an integer input with one value per row that the model compares with positions
  (``arange(L) < lengths[:, None]``); the length is that value.

A model whose proof fails keeps padded calls; :attr:`Truncation.refused` says which node and why.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch
from torch import fx

from ..ir.symbolic import expr_of
from .op_groups import draws_in_training
from .padded_tails import ANY, CLEAN, Const, Context, Refused, Size, Value, rule_for


@dataclass(frozen=True)
class LengthSource:
    """Where each row's length comes from: ``input``'s positions past it hold ``pad`` (along
    ``dim``), or, with ``pad`` None, ``input`` holds the lengths themselves."""

    input: str
    dim: int = 1
    pad: float | None = None

    def describe(self) -> str:
        if self.pad is None:
            return f"the values of {self.input!r}"
        pad = int(self.pad) if float(self.pad).is_integer() else self.pad
        return f"{self.input!r} past its last id other than {pad} (dim {self.dim})"


@dataclass(frozen=True)
class Truncation:
    """A proof that calls may cut each history to its length (``source`` reads it): the inputs
    to cut (``{input: dims}``), and the nodes whose rows need one position at least
    (``needs_content``: a row without any runs at the call's width)."""

    source: LengthSource
    inputs: dict
    needs_content: tuple[str, ...] = ()


@dataclass(frozen=True)
class Refusal:
    """Why calls keep their padded width (``node``: the first node the proof fails at)."""

    reason: str
    node: str | None = None


def prove_truncation(
    gm: fx.GraphModule, placeholder_of: dict, request_inputs, batch_symbol: sympy.Symbol
) -> Truncation | Refusal:
    """A :class:`Truncation` for the captured graph ``gm`` (``placeholder_of``: input name ->
    placeholder name), or the :class:`Refusal` of its most likely length source."""
    proofs, refusal = prove_truncations(gm, placeholder_of, request_inputs, batch_symbol)
    return proofs[0] if proofs else refusal


def prove_truncations(
    gm: fx.GraphModule, placeholder_of: dict, request_inputs, batch_symbol: sympy.Symbol
) -> tuple[list[Truncation], Refusal | None]:
    """One :class:`Truncation` per dynamic length that may be cut (each length proved alone,
    the other lengths kept at the call's widths: a KeyedJaggedTensor gives every key its own), or
    none and the :class:`Refusal` of the first one's most likely length source."""
    inputs = _input_nodes(gm, placeholder_of)
    by_length: dict[sympy.Symbol, dict[str, list[int]]] = {}
    for name, dims in _history_inputs(inputs, batch_symbol).items():
        for dim, symbol in dims.items():
            by_length.setdefault(symbol, {}).setdefault(name, []).append(dim)
    if not by_length:
        return [], Refusal("no input has a dynamic history length")
    proofs: list[Truncation] = []
    first: Refusal | None = None
    for history, inputs_of_length in by_length.items():
        cut = {name: tuple(dims) for name, dims in inputs_of_length.items()}
        outside = sorted(set(cut) - set(request_inputs))
        if outside:
            first = first or Refusal(f"candidate input(s) {outside} have the history's length")
            continue
        for source in _sources(inputs, cut, request_inputs, batch_symbol):
            result = _prove_with(gm, inputs, cut, source, history, batch_symbol)
            if isinstance(result, Truncation):
                proofs.append(result)
                break
            first = first or result
        else:
            first = first or Refusal("no input gives each row's length (padding ids or lengths)")
    return proofs, None if proofs else first


def history_inputs(gm: fx.GraphModule, placeholder_of: dict, batch_symbol) -> dict:
    """``{input: dims}`` of each input with a dynamic size past its rows (a history)."""
    found = _history_inputs(_input_nodes(gm, placeholder_of), batch_symbol)
    return {name: tuple(dims) for name, dims in found.items()}


def _input_nodes(gm: fx.GraphModule, placeholder_of: dict) -> dict:
    placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    return {name: placeholders.get(ph) for name, ph in placeholder_of.items()}


def _history_inputs(inputs: dict, batch_symbol) -> dict[str, dict[int, sympy.Symbol]]:
    """``{input: {dim: symbol}}`` of each input with a symbolic size past its rows."""
    found = {}
    for name, node in inputs.items():
        val = node.meta.get("val") if node is not None else None
        if not isinstance(val, torch.Tensor):
            continue
        dims = {}
        for d, size in enumerate(val.shape):
            expr = expr_of(size)
            if expr is not None and isinstance(expr, sympy.Symbol) and expr != batch_symbol:
                dims[d] = expr
        if dims:
            found[name] = dims
    return found


def _sources(inputs, cut, request_inputs, batch_symbol):
    """Length sources to try, most likely first: each integer history compared with a
    constant (0 first), then each integer request input with one value per row."""
    for name, dims in cut.items():
        node = inputs[name]
        if node.meta["val"].is_floating_point():
            continue
        pads = [0.0] + sorted(_compared_constants(node) - {0.0})
        for pad in pads:
            yield LengthSource(name, dims[0], pad)
    for name in request_inputs:
        node = inputs.get(name)
        val = node.meta.get("val") if node is not None else None
        if isinstance(val, torch.Tensor) and val.dim() == 1 and not val.is_floating_point():
            if expr_of(val.shape[0]) == batch_symbol and name not in cut:
                yield LengthSource(name, 0, None)


def _compared_constants(node: fx.Node) -> set[float]:
    aten = torch.ops.aten
    found = set()
    for user in node.users:
        packet = getattr(user.target, "overloadpacket", None)
        if packet in (aten.eq, aten.ne) and len(user.args) > 1:
            if isinstance(user.args[1], (int, float)) and not isinstance(user.args[1], bool):
                found.add(float(user.args[1]))
    return found


def _prove_with(gm, inputs, cut, source, history, batch_symbol) -> Truncation | Refusal:
    ctx = Context(history, batch_symbol, {})
    by_node = {node: name for name, node in inputs.items() if node is not None}
    for node in gm.graph.nodes:
        try:
            ctx.states[node] = _state(node, ctx, by_node, cut, source)
        except Refused as refused:
            return Refusal(f"{node.name} ({_op_name(node)}) {refused}", node.name)
    return Truncation(source, cut, tuple(ctx.needs_content))


def _state(node: fx.Node, ctx: Context, by_node: dict, cut: dict, source: LengthSource):
    if node.op == "placeholder":
        return _input_state(node, ctx, by_node.get(node), cut, source)
    if node.op == "get_attr":
        return CLEAN
    if node.op == "output":
        _check_outputs(node, ctx)
        return CLEAN
    if node.op != "call_function":
        raise Refused("is not a function call")
    if draws_in_training(node):
        raise Refused("draws random numbers: a group's draws would not be the padded call's")
    rule = rule_for(node.target)
    if rule is None:
        if _reads_tracked(node, ctx):
            raise Refused("has no rule for padded histories, and reads the history or the rows")
        return CLEAN
    try:
        return rule(node, ctx)
    except Refused:
        raise
    except Exception as err:  # noqa: BLE001 - a rule that cannot read this node: no proof
        raise Refused(f"could not be read ({type(err).__name__}: {err})") from None


def _input_state(node, ctx, name, cut, source):
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        expr = expr_of(val)
        return (
            Size(frozenset(expr.free_symbols & {ctx.history, ctx.rows}))
            if expr is not None
            else CLEAN
        )
    rows = ctx.row_dims(val)
    if name == source.input and source.pad is None:
        return Value({}, rows, lengths=True)
    tails = {d: ANY for d in cut.get(name, ())}
    if name == source.input:
        tails[source.dim] = Const(source.pad)
    return Value(tails, rows)


def _reads_tracked(node: fx.Node, ctx: Context) -> bool:
    for arg in node.all_input_nodes:
        state = ctx.states.get(arg, CLEAN)
        if isinstance(state, Size) and state.symbols:
            return True
        if isinstance(state, Value) and (state.tails or state.rows or state.lengths):
            return True
        if isinstance(state, list):
            return True
    return False


def _check_outputs(node: fx.Node, ctx: Context) -> None:
    from torch.utils import _pytree as pytree

    for leaf in pytree.tree_leaves(node.args[0]):
        if not isinstance(leaf, fx.Node):
            continue
        state = ctx.states.get(leaf, CLEAN)
        if not isinstance(state, Value) or state.tails:
            raise Refused(f"returns {leaf.name}, which has the history's length")
        if state.rows != (0,):
            raise Refused(f"returns {leaf.name}, which does not have one row per candidate")


def _op_name(node: fx.Node) -> str:
    target = node.target
    return getattr(target, "__name__", None) or str(target)
