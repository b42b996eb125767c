"""The lattice of padded tails (``Const``, ``ANY``, ``MASKED``, ``POS``, ``NONFINITE``), a
value's description (:class:`Value`, :class:`Size`), the rules' context and their registry."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import sympy
import torch
from torch import fx

from ...ir.symbolic import expr_of

aten = torch.ops.aten

MASKING = -1e4  # a fill at or below it drives exp(x - max) to 0 for any finite score above it


class Refused(Exception):
    """A node whose value at some position inside the rows' lengths would change with the
    width, or that mixes rows (the message says how)."""


@dataclass(frozen=True)
class Const:
    value: float


class _Kind:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


ANY, MASKED, POS, NONFINITE = _Kind("ANY"), _Kind("MASKED"), _Kind("POS"), _Kind("NONFINITE")
Tail = Any  # Const | ANY | MASKED | POS | NONFINITE


@dataclass
class Value:
    """A tensor's history dims with their tails (``{dim: tail}``), its row dims (size of the
    batch), and whether it holds each row's length (the lengths input, and views of it)."""

    tails: dict[int, Tail] = field(default_factory=dict)
    rows: tuple[int, ...] = ()
    lengths: bool = False


@dataclass(frozen=True)
class Size:
    """An int computed from sizes; ``symbols`` those of the history or the rows it reads."""

    symbols: frozenset


CLEAN = Value()


def finite(tail: Tail) -> bool:
    if isinstance(tail, Const):
        return math.isfinite(tail.value)
    return tail is ANY or tail is POS


def masks(tail: Tail) -> bool:
    """Whether ``exp(tail - max)`` is exactly 0 for a finite max above :data:`MASKING`."""
    return tail is MASKED or (isinstance(tail, Const) and tail.value <= MASKING)


def loose(tails) -> Tail:
    """The tail of a value computed from ``tails`` with nothing known: finite if they are."""
    return ANY if all(finite(t) for t in tails) else NONFINITE


@dataclass
class Context:
    """What the rules read besides states: the two symbols and the states of nodes."""

    history: sympy.Symbol
    rows: sympy.Symbol
    states: dict[fx.Node, Any]
    needs_content: list[str] = field(default_factory=list)  # nodes a row without content breaks

    def state(self, arg: Any) -> Any:
        return self.states.get(arg, CLEAN) if isinstance(arg, fx.Node) else CLEAN

    def history_dims(self, val: torch.Tensor) -> list[int]:
        return [d for d, s in enumerate(val.shape) if _is(s, self.history)]

    def row_dims(self, val: torch.Tensor) -> tuple[int, ...]:
        return tuple(d for d, s in enumerate(val.shape) if _is(s, self.rows))

    def merged(self, val: torch.Tensor) -> bool:
        """A dim whose size involves the history or the rows without being one of them."""
        for s in val.shape:
            expr = expr_of(s)
            if expr is None or not ({self.history, self.rows} & expr.free_symbols):
                continue
            if expr != self.history and expr != self.rows:
                return True
        return False


def _is(size: Any, symbol: sympy.Symbol) -> bool:
    expr = expr_of(size)
    return expr is not None and expr == symbol


Rule = Callable[[fx.Node, Context], Any]
RULES: dict[Any, Rule] = {}  # ATen op (or its overload packet) -> rule: ``table.py`` fills it


def register(ops, rule: Rule) -> None:
    for op in ops:
        RULES[op] = rule


def rule_for(target: Any) -> Rule | None:
    rule = RULES.get(target)
    if rule is None and hasattr(target, "overloadpacket"):
        rule = RULES.get(target.overloadpacket)
    return rule


# -- helpers the rules share ---------------------------------------------------------------------


def _val(node: fx.Node) -> torch.Tensor:
    return node.meta.get("val")


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    return [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]


def _no_sizes(node: fx.Node, ctx: Context, allowed: tuple = ()) -> None:
    """Refuse a node that reads the history's width or the row count as a value."""
    for where, arg in [*enumerate(node.args), *node.kwargs.items()]:
        if where in allowed:
            continue
        for a in _flat(arg):
            state = ctx.state(a)
            if isinstance(state, Size) and state.symbols:
                raise Refused(f"reads the padded width or the row count as a value ({a.name})")


def _flat(arg: Any) -> list:
    if isinstance(arg, (list, tuple)):
        return [x for a in arg for x in _flat(a)]
    return [arg] if isinstance(arg, fx.Node) else []


def _aligned_tail(arg: Any, out_dim: int, out_ndim: int, ctx: Context) -> Tail | None:
    """The tail ``arg`` (right-aligned against an output of ``out_ndim`` dims) has at the
    output's dim ``out_dim``; a Python scalar is a constant; a broadcast dim gives ``None``."""
    if not isinstance(arg, fx.Node):
        if isinstance(arg, (bool, int, float)):
            return Const(float(arg))
        return ANY
    val = _val(arg)
    if not isinstance(val, torch.Tensor):
        return ANY
    state = ctx.state(arg)
    d = out_dim - (out_ndim - val.dim())
    if d < 0 or not _is(val.shape[d], ctx.history):
        return None
    return state.tails.get(d, ANY) if isinstance(state, Value) else NONFINITE
