"""Floats dynamo would hand a graph as tensors, traced as constants instead.

Under dynamic shapes (``torch.compile(..., dynamic=True)``) dynamo does not specialize a Python
float it reads (a layer's scale, a dropout's ``p``, a norm's ``eps`` kept as an attribute): the
frame's code makes each one a 0-d tensor on every call, and the graph reads it back with
``.item()``. The rewrite cannot share around a value it does not know, so it bakes the number
into the shared program and compares it on every call (``subgraph.py``). Both are per-call costs
of a value that, in a served model, never changes.

Dynamo offers the way out its own Inductor uses when it cannot keep a float symbolic: name the
float's symbol to ``TensorifyState`` and restart the frame's analysis; the trace that follows
reads the float as a constant and guards its value with the frame's other guards.

Identity: a graph traced with a float as the constant ``c``, run only while dynamo's guard
``float == c`` holds, computes what the graph with the float as an input computes on ``c``. A
changed value fails the guard and dynamo traces the frame again (up to its recompile limit, past
which the frame runs uncompiled: exact either way), as a changed baked value made the subgraph
rewrite again.
"""

from __future__ import annotations

from typing import Iterable

from torch import fx

from .dynamo_graph import _source_chain

_OURS: set[str] = set()  # the symbols this module asked dynamo to specialize, not yet done


def unspecialized_floats(gm: fx.GraphModule) -> list[str]:
    """The symbols of the floats of module state or globals that ``gm`` receives as 0-d tensors
    (``pass_arg_as_tensor``), read back only as numbers: those dynamo can trace as constants. A
    float the caller passes (``forward(x, temperature)``) may change on every call, and stays an
    input (each new value would compile anew up to dynamo's recompile limit)."""
    names = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        grapharg = node.meta.get("grapharg")
        memo = getattr(node.meta.get("example_value"), "item_memo", None)
        symbol = getattr(getattr(getattr(memo, "node", None), "_expr", None), "name", None)
        if not getattr(grapharg, "pass_arg_as_tensor", False) or not isinstance(symbol, str):
            continue
        if _passed_by_caller(getattr(grapharg, "source", None)):
            continue
        if node.users and all(u.target == "item" for u in node.users):
            names.append(symbol)
    return names


def _passed_by_caller(source) -> bool:
    """True for a value reached from a frame argument other than ``self``."""
    from torch._dynamo.source import LocalSource

    root, _ = _source_chain(source)
    return isinstance(root, LocalSource) and root.local_name != "self"


def specialize_floats(gm: fx.GraphModule) -> None:
    """Ask dynamo to trace ``gm``'s frame again with its float inputs as constants (raises
    dynamo's restart), unless it was asked for these floats already; forget the requests once a
    graph comes back without them, so that no other frame's floats are specialized by name."""
    try:
        from torch._dynamo.exc import TensorifyScalarRestartAnalysis
        from torch._dynamo.symbolic_convert import TensorifyState
    except ImportError:  # a torch without the mechanism: the floats stay baked values
        return
    names = unspecialized_floats(gm)
    pending = [n for n in names if not TensorifyState.should_specialize(n)]
    if not pending:
        _forget(TensorifyState, _OURS - set(names))
        return
    for name in pending:
        TensorifyState.specialize(name)
    _OURS.update(pending)
    raise TensorifyScalarRestartAnalysis(restart_reason="rocs: floats traced as constants")


def _forget(state, names: Iterable[str]) -> None:
    for name in list(names):
        state.force_specializations.discard(name)
        _OURS.discard(name)
