"""In-place elementwise ops for the direct program: reuse a temporary's buffer when it dies.

``relu(x)`` allocates an output the size of ``x``; when ``x`` is a temporary that nothing reads
afterwards, ``relu_(x)`` computes the same values into ``x``'s memory. For the ``[N, M]``
activations of a ranking model at N ~ 1000 the saved allocation is most of the op's cost on a
CPU (fresh pages fault on first touch).

Identities: ``f(x) == f_(x)`` for the elementwise ops below, ``a + b == b + a`` and
``a * b == b * a`` exactly in IEEE arithmetic. Safety conditions, checked per use:

- the overwritten operand is produced by an op known to compute a new tensor (a pointwise op,
  a GEMM, a lookup, ...; see ``_COMPUTING``) or by a ``rocs::`` op, so no other tensor shares
  its memory;
- every reader of it is such a non-aliasing op (no view of it outlives this use) and this op
  is its last reader; it is not a graph output;
- it has the result's shape and dtype (no broadcast into it, no type promotion past it).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import fx

aten = torch.ops.aten

UNARY = {
    aten.relu.default: aten.relu_.default,
    aten.sigmoid.default: aten.sigmoid_.default,
    aten.tanh.default: aten.tanh_.default,
    aten.silu.default: aten.silu_.default,
}
# (in-place op, whether the operands may be swapped)
BINARY = {
    aten.add.Tensor: (aten.add_.Tensor, True),
    aten.mul.Tensor: (aten.mul_.Tensor, True),
    aten.sub.Tensor: (aten.sub_.Tensor, False),
    aten.div.Tensor: (aten.div_.Tensor, False),
}


def inplace_plan(
    nodes: list[fx.Node], last_use: dict[fx.Node, fx.Node], fresh_targets: set
) -> dict[fx.Node, tuple[Any, tuple]]:
    """``{node: (in-place op, args)}`` for the nodes that may overwrite a dying operand."""
    plan = {}
    for node in nodes:
        if node.op != "call_function" or node.kwargs:
            continue
        if node.target in UNARY and len(node.args) == 1:
            if _reusable(node.args[0], node, last_use, fresh_targets):
                plan[node] = (UNARY[node.target], node.args)
        elif node.target in BINARY and len(node.args) == 2:
            op, swappable = BINARY[node.target]
            a, b = node.args
            if a is not b and _reusable(a, node, last_use, fresh_targets):
                plan[node] = (op, (a, b))
            elif swappable and a is not b and _reusable(b, node, last_use, fresh_targets):
                plan[node] = (op, (b, a))
    return plan


def _reusable(arg: Any, node: fx.Node, last_use: dict, fresh_targets: set) -> bool:
    if not isinstance(arg, fx.Node) or arg.op != "call_function" or last_use.get(arg) is not node:
        return False
    if not _fresh(arg.target, fresh_targets):
        return False
    if not all(u is node or _fresh(u.target, fresh_targets) for u in arg.users):
        return False
    have, want = _val(arg), _val(node)
    return (
        isinstance(have, torch.Tensor)
        and isinstance(want, torch.Tensor)
        and have.dtype == want.dtype
        and _dims(have) == _dims(want)
    )


def _dims(t: torch.Tensor) -> list[str]:
    # Symbolic sizes compare by their expression: equal text, equal size; no guard is asked for.
    return [str(d) for d in t.shape]


# Ops whose result is always newly computed memory, besides pointwise-tagged ones. A schema
# without alias annotation is not enough: ``aten.dropout`` in eval mode and ``_unsafe_view``
# return (a view of) their input unannotated, and ``einsum('ij->ji', x)`` returns a view.
_COMPUTING = {
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
    aten.linear.default, aten.matmul.default, aten.embedding.default, aten.index_select.default,
    aten.cat.default, aten.sum.dim_IntList, aten.mean.dim, aten._softmax.default,
    aten.softmax.int, aten.layer_norm.default, aten.batch_norm.default, aten.clone.default,
    aten.scaled_dot_product_attention.default,
}


def _fresh(target: Any, fresh_targets: set) -> bool:
    """True if ``target``'s result never shares memory with its inputs."""
    if target in fresh_targets:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False
    schema = target._schema
    if len(schema.returns) != 1 or schema.returns[0].alias_info is not None or schema.is_mutable:
        return False
    if target in _COMPUTING:
        return True
    tags = target.tags
    return torch.Tag.pointwise in tags and torch.Tag.maybe_aliasing_or_mutating not in tags


def _val(node: fx.Node) -> Optional[Any]:
    return node.meta.get("val")
