"""``torch.no_grad()`` blocks of a forward as ``detach`` of their results.

A training capture exports the model in grad mode, where a ``with torch.no_grad():`` block (a
frozen context encoder, say) is a region: ``wrap_with_set_grad_enabled(False, body, *args)``.
Functionalization would inline the body and forget that it ran without grad, and an optimizer
would then train the frozen layers. :func:`inline_grad_regions` inlines every region itself and
detaches what a no-grad region hands out.

Identity: a value computed with grad disabled carries no autograd history, exactly as
``aten.detach`` of the same value computed with grad enabled: equal values, and no gradient
reaches what it was computed from. Inside the region nothing is differentiated, so the body's
own ops may run in grad mode. ``aten.detach`` has a role rule (a view) and is no elementwise op,
so no rewrite fuses it away (``analysis/op_groups.py``). Export cuts nested blocks into a
sequence of regions (a ``torch.enable_grad()`` block inside a no-grad one is top-level graph
between two no-grad regions), so each region's mode is the mode its ops ran in.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from ..errors import CompileError
from ..ir.folded import fresh_attr

_SET_GRAD = torch.ops.higher_order.wrap_with_set_grad_enabled


def inline_grad_regions(gm: fx.GraphModule) -> bool:
    """Inline every ``wrap_with_set_grad_enabled`` region of ``gm`` (nested ones included), the
    results of a no-grad one detached. True when the graph changed."""
    changed = False
    while True:
        node = next((n for n in gm.graph.nodes if n.target is _SET_GRAD), None)
        if node is None:
            break
        _inline(gm, node)
        changed = True
    if changed:
        gm.graph.eliminate_dead_code()
        gm.delete_all_unused_submodules()
        gm.recompile()
    return changed


def _inline(gm: fx.GraphModule, node: fx.Node) -> None:
    enabled, body_node, *args = node.args
    body = getattr(gm, body_node.target)
    graph = gm.graph
    env: dict[fx.Node, fx.Node] = {}
    placeholders = iter(args)
    results: list = []
    with graph.inserting_before(node):
        for inner in body.graph.nodes:
            if inner.op == "placeholder":
                env[inner] = next(placeholders)
            elif inner.op == "output":
                results = list(inner.args[0])
            elif inner.op == "get_attr":
                attr = fresh_attr(gm, inner.target)
                setattr(gm, attr, getattr(body, inner.target))
                env[inner] = graph.get_attr(attr)
                env[inner].meta.update(inner.meta)
            else:
                env[inner] = graph.node_copy(inner, lambda n: env[n])
    for user in list(node.users):
        if user.target is not operator.getitem:
            raise CompileError(f"unexpected use of a grad region's results: {user.format_node()}")
        value = env[results[user.args[1]]] if isinstance(results[user.args[1]], fx.Node) else None
        if value is not None and not enabled and isinstance(user.meta.get("val"), torch.Tensor):
            with graph.inserting_before(user):
                detached = graph.call_function(torch.ops.aten.detach.default, (value,))
            detached.meta.update(user.meta)
            value = detached
        user.replace_all_uses_with(value if value is not None else results[user.args[1]])
        graph.erase_node(user)
    graph.erase_node(node)


