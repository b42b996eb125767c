"""Whether a rewritten dynamo graph shares anything, and the warning when it does not.

A graph whose request inputs meet candidate values before any request-only work (or reach an op
that has no role rule) computes everything per candidate after the rewrite too: its shared
program is the original program plus the runtime's checks and gathers. The backend then runs
the graph as Inductor compiled it, at Inductor's cost per call, and says why when the reason is
an op without a role rule (a graph dynamo traced through one of PyTorch's fused kernels, say),
once per op.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
from torch import fx

from ..analysis.op_groups import SHAPE_ONLY, packet
from ..ir.graph_meta import PLACEMENT
from ..ir.roles import Role

__all__ = ["unshared_reason"]

_NO_RULE = "no role rule for "
_WARNED: set[str] = set()


def unshared_reason(compiled: Any) -> Optional[str]:
    """Why the rewrite of a dynamo graph shares nothing worth a shared program, or None when it
    shares: no node of the shared graph computes a request value at R rows (request inputs, their
    sizes and views aside), or no FLOP runs per request while ops without a role rule run request
    values per candidate (the latter warned once per op)."""
    gm = getattr(compiled, "graph_module", None)
    if gm is None:
        return None  # a compiled model of column lanes: its program decides for itself
    if not any(_computes_per_request(node) for node in gm.graph.nodes):
        return "nothing to share: every request value meets a candidate value first"
    try:
        report = compiled.report()
    except Exception:  # noqa: BLE001 - without a report there is no FLOP count to judge by
        return None
    rule_less = {}
    for fallback in report.fallbacks:
        if fallback.reason.startswith(_NO_RULE):
            rule_less.setdefault(fallback.op, fallback.module or fallback.node)
    if report.request_flops > 0 or not rule_less:
        return None
    _warn(rule_less)
    return f"nothing to share: no role rule for {', '.join(rule_less)}"


def _computes_per_request(node: fx.Node) -> bool:
    return (
        node.op == "call_function"
        and node.meta.get(PLACEMENT) == Role.REQUEST
        and isinstance(node.meta.get("val"), torch.Tensor)
        and packet(node.target) not in SHAPE_ONLY
    )


def _warn(rule_less: dict[str, str]) -> None:
    fresh = {op: where for op, where in rule_less.items() if op not in _WARNED}
    if not fresh:
        return
    _WARNED.update(fresh)
    named = ", ".join(f"{op} (in {where})" for op, where in fresh.items())
    warnings.warn(
        f"rocs: a torch.compile graph shares nothing: {named} has no role rule, so the request "
        "values it reads run per candidate; the graph runs as Inductor compiles it",
        stacklevel=4,
    )
