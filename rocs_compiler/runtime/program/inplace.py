"""In-place elementwise ops for the direct program: reuse a temporary's buffer when it dies.

``relu(x)`` allocates an output the size of ``x``; when ``x`` is a temporary that nothing reads
afterwards, ``relu_(x)`` computes the same values into ``x``'s memory. For the ``[N, M]``
activations of a ranking model at N ~ 1000 the saved allocation is most of the op's cost on a
CPU (fresh pages fault on first touch).

Identities: ``f(x, ...) == f_(x, ...)`` for every elementwise op with an in-place variant
(``op_groups.inplace_variant``), ``f(a, b) == f(b, a)`` for the commutative ones (``a + b``,
``a * b``, exactly in IEEE arithmetic). Safety conditions, checked per use:

- the overwritten operand is produced by an op known to compute a new tensor (a pointwise op,
  a GEMM, a lookup, ...; see ``op_groups.FRESH_RESULT``) or by a ``rocs::`` op, so no other
  tensor shares its memory;
- every reader of it is such a non-aliasing op (no view of it outlives this use) and this op
  is its last reader; it is not a graph output;
- it has the result's shape and dtype (no broadcast into it, no type promotion past it).

A view of the operand read earlier (``x[:, 0]`` read before ``x`` is written) does not outlive
the use when every reader of the view is such an op and runs before it.

Functionalized writes through views become scatters: ``x[:, 0].mul_(2)`` is
``select_scatter(x, mul(select(x, 1, 0), 2), 1, 0)``, a copy of all of ``x``. When ``x`` may be
overwritten under the conditions above, ``select_scatter(x, src, d, i)`` is computed as
``x.select(d, i).copy_(src)`` into ``x`` itself (and ``slice_scatter`` likewise), which is what
the original model's in-place update did.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import fx

from ...analysis import op_groups


def inplace_plan(
    nodes: list[fx.Node], last_use: dict[fx.Node, fx.Node], fresh_targets: set
) -> dict[fx.Node, tuple[Any, tuple]]:
    """``{node: (in-place op, args)}`` for the nodes that may overwrite a dying operand."""
    plan = {}
    position = {n: i for i, n in enumerate(nodes)}
    fresh_targets = set(fresh_targets) | set(_SCATTER_INTO)

    def reusable(arg: Any, node: fx.Node) -> bool:
        return _reusable(arg, node, last_use, fresh_targets, position)

    for node in nodes:
        if node.op != "call_function" or node.kwargs or not node.args:
            continue
        first = node.args[0]
        if node.target in _SCATTER_INTO:
            if reusable(first, node) and node.args.count(first) == 1:
                plan[node] = (_SCATTER_INTO[node.target], node.args)
            continue
        inplace = op_groups.inplace_variant(node.target)
        if inplace is None:
            continue
        if reusable(first, node) and node.args.count(first) == 1:
            plan[node] = (inplace, node.args)
        elif node.target in op_groups.COMMUTATIVE and len(node.args) == 2:
            second = node.args[1]
            if second is not first and reusable(second, node):
                plan[node] = (inplace, (second, first))
    return plan


def select_scatter_into(base: torch.Tensor, src: torch.Tensor, dim: int, index: int):
    """``select_scatter(base, src, dim, index)``, written into ``base``."""
    base.select(dim, index).copy_(src)
    return base


def slice_scatter_into(base: torch.Tensor, src: torch.Tensor, dim: int = 0, start=None,
                       end=None, step: int = 1):  # fmt: skip
    """``slice_scatter(base, src, dim, start, end, step)``, written into ``base``."""
    _SLICE(base, dim, start, end, step).copy_(src)
    return base


_SLICE = torch.ops.aten.slice.Tensor._op
_SCATTER_INTO = {
    torch.ops.aten.select_scatter.default: select_scatter_into,
    torch.ops.aten.slice_scatter.default: slice_scatter_into,
}


def _reusable(arg: Any, node: fx.Node, last_use: dict, fresh_targets: set, position: dict) -> bool:
    if not isinstance(arg, fx.Node) or arg.op != "call_function" or last_use.get(arg) is not node:
        return False
    if not _fresh(arg.target, fresh_targets):
        return False
    for user in arg.users:
        if user is node or _fresh(user.target, fresh_targets):
            continue
        if not _view_read_before(user, node, fresh_targets, position):
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


def _view_read_before(view: fx.Node, node: fx.Node, fresh_targets: set, position: dict) -> bool:
    """True if ``view`` is a view op whose readers are all non-aliasing ops that run before
    ``node``."""
    if view.op != "call_function" or not _is_view(view.target):
        return False
    at = position.get(node)
    return at is not None and all(
        u.op == "call_function" and _fresh(u.target, fresh_targets) and position.get(u, at) < at
        for u in view.users
    )


def _is_view(target: Any) -> bool:
    if not isinstance(target, torch._ops.OpOverload):
        return False
    schema = target._schema
    return (
        len(schema.returns) == 1
        and schema.returns[0].alias_info is not None
        and not schema.returns[0].alias_info.is_write
        and not schema.is_mutable
    )


def _fresh(target: Any, fresh_targets: set) -> bool:
    """True if ``target``'s result never shares memory with its inputs."""
    if target in fresh_targets:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False
    schema = target._schema
    if len(schema.returns) != 1 or schema.returns[0].alias_info is not None or schema.is_mutable:
        return False
    if target in op_groups.FRESH_RESULT:
        return True
    tags = target.tags
    return (
        op_groups.is_elementwise(target)
        and torch.Tag.pointwise in tags
        and torch.Tag.maybe_aliasing_or_mutating not in tags
    )


def _val(node: fx.Node) -> Optional[Any]:
    return node.meta.get("val")
