"""One gradient buffer per embedding table that several lookups read (the training program).

Recommendation models read one item table twice: for the request's history and for the
candidate. Autograd then gives the table one dense gradient per lookup (each a zero-filled
buffer of the table's size, with the lookup's rows added in) and sums them, so a step zero-fills
and adds table-sized buffers once more per extra lookup; on a CPU, for a 50000 x 48 table, that
is several milliseconds of memory traffic per step, more than the lookups themselves.
:func:`merge_table_lookups` replaces the lookups of one table in the training graph by a single
node (:class:`TableLookups`) whose backward fills one zero buffer and adds every lookup's rows
into it.

Identity: a lookup's table gradient is ``index_add(zeros, 0, ids, rows)``, its output gradient's
rows scattered to the table rows it read (``ids``; rows at a padding id, or at a bag's padding
entries, weigh nothing, and a mean bag's rows are divided by its entry count). The sum over
lookups of those scatters is one scatter of all of them into one zero buffer: the same sums per
table row, in another order (floating-point re-association only, as for any gradient the
training program computes; docs/contract.md). The forward calls each lookup's own op, so its
outputs are bit for bit the lookups'.

Merged: ``aten.embedding`` without ``scale_grad_by_freq`` or sparse gradients, and
``rocs::embedding_bag_rows`` in sum or mean mode. A table is merged only when every index the
merged lookups read is computed before the first of them (the node takes the first lookup's
place); other reads of the table (a tied output projection) keep their own gradients.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional

import torch
from torch import fx

from ...ir.graph_meta import PLACEMENT
from ...ir.roles import Role
from ...kernels.embedding_bag_rows import EMBEDDING_BAG_ROWS, MODE_MAX, bag_gradient_rows

aten = torch.ops.aten


@dataclass(frozen=True)
class _Lookup:
    """One lookup of a merged table: ``embedding`` (``mode`` None) or ``embedding_bag_rows``."""

    padding_idx: Optional[int]
    mode: Optional[int] = None

    def forward(self, weight: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        # The ops' own paths without the dispatcher's wrappers, as the direct program calls them
        # (``runtime/program/direct.py``; the runtime checked the call).
        if self.mode is None:
            padding = -1 if self.padding_idx is None else self.padding_idx
            return torch.embedding(weight, indices, padding, False, False)
        return EMBEDDING_BAG_ROWS.run(weight, indices, self.mode, self.padding_idx)

    def gradient_rows(
        self, grad: torch.Tensor, indices: torch.Tensor, num_rows: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(table row ids, gradient rows) whose ``index_add`` is this lookup's table gradient."""
        if self.mode is not None:
            return bag_gradient_rows(grad, indices, self.mode, self.padding_idx, num_rows)
        ids = indices.reshape(-1)
        rows = grad.reshape(ids.shape[0], grad.shape[-1])  # [*indices, D]: one row per id
        if self.padding_idx is not None:
            rows = rows.masked_fill((ids == self.padding_idx).unsqueeze(1), 0)
        return ids, rows


class _TableLookupsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, lookups, weight, *indices):
        ctx.set_materialize_grads(False)
        ctx.lookups = lookups
        ctx.table = (weight.shape, weight.dtype, weight.device)
        ctx.save_for_backward(*indices)
        return tuple(lookup.forward(weight, index) for lookup, index in zip(lookups, indices))

    @staticmethod
    def backward(ctx, *grads):
        shape, dtype, device = ctx.table
        table = None
        for lookup, index, grad in zip(ctx.lookups, ctx.saved_tensors, grads):
            if grad is None:
                continue
            ids, rows = lookup.gradient_rows(grad, index, shape[0])
            if table is None:
                table = torch.zeros(shape, dtype=dtype, device=device)
            table.index_add_(0, ids, rows.to(dtype))
        return (None, table, *(None for _ in ctx.lookups))


class TableLookups:
    """The graph target of a merged table: ``(weight, *indices) -> tuple of lookup outputs``."""

    def __init__(self, lookups: tuple[_Lookup, ...]):
        self.lookups = lookups
        self.__name__ = "table_lookups"

    def __call__(self, weight: torch.Tensor, *indices: torch.Tensor) -> tuple:
        return _TableLookupsFunction.apply(self.lookups, weight, *indices)

    def __repr__(self) -> str:
        return f"TableLookups({len(self.lookups)})"


def _lookup(node: fx.Node, weight: fx.Node) -> Optional[_Lookup]:
    """``node`` as a mergeable lookup of ``weight``, else None."""
    if node.op != "call_function" or not node.args or node.args[0] is not weight or node.kwargs:
        return None
    args = node.args
    if node.target is aten.embedding.default:
        padding, by_freq, sparse = (list(args[2:]) + [-1, False, False][len(args) - 2 :])[:3]
        if by_freq or sparse:
            return None
        return _Lookup(None if padding < 0 else padding)
    if node.target is torch.ops.rocs.embedding_bag_rows.default and args[2] != MODE_MAX:
        return _Lookup(args[3], args[2])
    return None


def merge_table_lookups(graph: fx.Graph) -> int:
    """Merge, per table (a placeholder of ``graph``), its lookups into one :class:`TableLookups`
    node (module docstring); returns the number of tables merged."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    merged = 0
    for weight in [n for n in graph.nodes if n.op == "placeholder"]:
        found = [(node, _lookup(node, weight)) for node in weight.users]
        found = sorted(((n, k) for n, k in found if k is not None), key=lambda item: order[item[0]])
        if len(found) < 2:
            continue
        first = found[0][0]
        indices = [node.args[1] for node, _ in found]
        if any(not isinstance(i, fx.Node) or order[i] > order[first] for i in indices):
            continue
        placements = {node.meta.get(PLACEMENT) for node, _ in found}
        with graph.inserting_before(first):
            table = graph.call_function(
                TableLookups(tuple(kind for _, kind in found)), (weight, *indices)
            )
            table.meta[PLACEMENT] = (
                Role.CANDIDATE if Role.CANDIDATE in placements else first.meta.get(PLACEMENT)
            )
            for position, (node, _) in enumerate(found):
                item = graph.call_function(operator.getitem, (table, position))
                item.meta.update(node.meta)
                node.replace_all_uses_with(item)
        for node, _ in found:
            graph.erase_node(node)
        merged += 1
    return merged
