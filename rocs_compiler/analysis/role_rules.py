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

This module is the registry's public face: importing it registers every ATen rule, one module
per op family, and :func:`lookup` / :func:`lane_of` read the tables only through it.

- ``rule_registry.py``: the tables, :func:`register`, :class:`RuleContext`, :class:`Lane`;
- ``rule_families.py``: family helpers (elementwise, shape-only, reductions, products...);
- ``rules_movement.py``, ``rules_reductions.py``, ``rules_lookups.py``, ``rules_layers.py``:
  the registrations, by op family;
- ``request_dropout.py``: the per-request dropout switch of one compile.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from . import op_groups
from . import rules_layers, rules_lookups, rules_movement, rules_reductions  # noqa: F401 (register)
from .request_dropout import dropout_is_per_request, dropout_per_request
from .rule_families import (
    along_dim_rule,
    contracting_rule,
    elementwise_rule,
    multi_dim_rule,
    reduction_rule,
    shape_only_rule,
)
from .rule_registry import (
    LANES,
    REQUEST_INDEX,
    ROWWISE,
    RULES,
    SHAPE_ARGUMENTS,
    Lane,
    Rule,
    RuleContext,
    bind_arguments,
    register,
)
from .rules_lookups import table_lookup_rule

__all__ = [
    "ROWWISE", "SHAPE_ARGUMENTS", "Lane", "Rule", "RuleContext", "along_dim_rule",
    "bind_arguments", "contracting_rule", "dropout_is_per_request", "dropout_per_request",
    "elementwise_rule", "lane_of", "lookup", "multi_dim_rule", "reduction_rule", "register",
    "registered_ops", "request_index_argument", "shape_only_rule", "table_lookup_rule",
]  # fmt: skip


def lookup(target: Any) -> Optional[Rule]:
    """The op's own rule, else its family's (every elementwise op shares one)."""
    return _registered(RULES, target, elementwise_rule)


def lane_of(target: Any) -> Optional[Lane]:
    """The op's lane, found as :func:`lookup` finds its rule; None for an op without a rule."""
    return _registered(LANES, target, Lane.ELEMENTWISE)


def request_index_argument(target: Any) -> Optional[str]:
    """The argument in which the op takes ``candidate_to_request`` on request rows (registered
    with ``register(..., request_index=...)``); None for every other op."""
    return _registered(REQUEST_INDEX, target, None)


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
    return list(RULES)
