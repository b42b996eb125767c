"""Whether a rewritten dynamo graph shares anything, and the warning when it does not.

A graph whose request inputs meet candidate values before any request-only work (or reach an op
that has no role rule) computes everything per candidate after the rewrite too: its shared
program is the original program plus the runtime's checks and gathers. The backend then runs
the graph as Inductor compiles it, at Inductor's cost per call, and says why when the reason is
an op without a role rule (a graph dynamo traced through one of PyTorch's fused kernels, say),
once per op.

The rewrite runs at a graph's first call, after dynamo compiled its frame; Inductor's compile
of the graph as it is, guarded as dynamo guards its backends' graphs, is only had while dynamo
compiles the frame. So :class:`UnsharedGraphs` remembers the graph and drops the frame's
compiled entries: dynamo traces the frame again at its next call, and the backend lowers the
same graph with Inductor at once (``lowering.lower_plain``). Graphs that share pay no second
Inductor compile.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional, Sequence

import torch
from torch import fx

from ..analysis.driver import NO_RULE
from ..analysis.op_groups import SHAPE_ONLY, packet
from ..ir.graph_meta import PLACEMENT
from ..ir.roles import Role

__all__ = ["UNSHARED", "UnsharedGraphs", "frame_code", "unshared_reason"]

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
        if fallback.reason.startswith(NO_RULE):
            rule_less.setdefault(fallback.op, fallback.module or fallback.node)
    if report.request_flops > 0 or not rule_less:
        return None
    _warn(rule_less)
    return f"nothing to share: {NO_RULE} {', '.join(rule_less)}"


class UnsharedGraphs:
    """The graphs (by their code and request inputs) whose rewrite shared nothing, with the
    reason. One table for the process: the entry point builds a backend per dynamo graph."""

    def __init__(self):
        self._reasons: dict[tuple, str] = {}
        self._retraced: set[tuple] = set()

    def reason(self, gm: fx.GraphModule, request_inputs: Sequence[str]) -> Optional[str]:
        return self._reasons.get((gm.code, tuple(request_inputs)))

    def retrace(
        self, gm: fx.GraphModule, request_inputs: Sequence[str], code: Any, reason: str
    ) -> bool:
        """Remember ``gm`` and make dynamo trace the frame of ``code`` again; False (nothing
        done) when the frame is unknown or was traced again for this graph once already."""
        key = (gm.code, tuple(request_inputs))
        if code is None or (code, key) in self._retraced:
            return False
        from torch._dynamo.eval_frame import remove_from_cache

        self._reasons[key] = reason
        self._retraced.add((code, key))
        remove_from_cache(code)
        return True


UNSHARED = UnsharedGraphs()


def frame_code() -> Any:
    """The code object of the frame dynamo is compiling (None outside a dynamo compile)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        return getattr(InstructionTranslator.current_tx(), "f_code", None)
    except Exception:  # noqa: BLE001 - no frame known: the graph is lowered without a retrace
        return None


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
