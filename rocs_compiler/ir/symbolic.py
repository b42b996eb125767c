"""Helpers for sizes that depend on the batch symbol.

Capture declares one symbolic batch size shared by every batched input. In the captured graph a
size such as ``x.size(0)`` is a sympy expression in that symbol; in the rewritten graph the same
expression evaluates to R where it shapes request tensors and to N where it shapes candidates.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import sympy
import torch
from torch.utils._sympy.functions import FloorDiv, Mod, PythonMod

from ..errors import CompileError


def expr_of(value: Any) -> sympy.Expr | None:
    """The sympy expression behind an int or SymInt (None for other values)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return sympy.Integer(value)
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return value.node.expr
    return None


def same_size(a: Any, b: Any) -> bool:
    """True when two sizes (ints or SymInts) are equal for every value of their symbols."""
    ea = a.node.expr if isinstance(a, torch.SymInt) else sympy.Integer(a)
    eb = b.node.expr if isinstance(b, torch.SymInt) else sympy.Integer(b)
    return sympy.simplify(ea - eb) == 0


def depends_on(value: Any, symbol: sympy.Symbol) -> bool:
    """True when an int/SymInt (or a shape, a list of them) involves the batch symbol."""
    if isinstance(value, (list, tuple, torch.Size)):
        return any(depends_on(v, symbol) for v in value)
    expr = expr_of(value)
    return expr is not None and symbol in expr.free_symbols


def is_batch_size(value: Any, symbol: sympy.Symbol) -> bool:
    """True when the value is exactly the batch size."""
    expr = expr_of(value)
    return expr is not None and sympy.simplify(expr - symbol) == 0


def is_batched(val: Any, symbol: sympy.Symbol) -> bool:
    """A tensor whose leading dim is the batch size and whose other dims are free of it."""
    if not isinstance(val, torch.Tensor) or val.dim() == 0:
        return False
    return is_batch_size(val.shape[0], symbol) and not depends_on(list(val.shape[1:]), symbol)


def emit_expr(expr: sympy.Expr, symbol: sympy.Symbol, size_node: Any, call: Callable) -> Any:
    """Emit FX nodes computing ``expr`` with ``symbol`` replaced by ``size_node``.

    ``call(fn, args)`` creates a node; returns an int when the expression is constant.
    """
    if expr == symbol:
        return size_node
    if expr.is_Integer:
        return int(expr)
    if isinstance(expr, sympy.Add):
        terms = [emit_expr(t, symbol, size_node, call) for t in expr.args]
        return _fold(terms, operator.add, call)
    if isinstance(expr, sympy.Mul):
        terms = [emit_expr(t, symbol, size_node, call) for t in expr.args]
        return _fold(terms, operator.mul, call)
    if isinstance(expr, FloorDiv):
        a, b = (emit_expr(t, symbol, size_node, call) for t in expr.args)
        return call(operator.floordiv, (a, b))
    if isinstance(expr, (Mod, PythonMod)):
        a, b = (emit_expr(t, symbol, size_node, call) for t in expr.args)
        return call(operator.mod, (a, b))
    raise CompileError(f"cannot re-derive the batch-dependent size expression {expr}")


def _fold(terms, fn, call):
    out = terms[0]
    for term in terms[1:]:
        out = call(fn, (out, term))
    return out
