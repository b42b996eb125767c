"""Which ids each served input may hold: the rows of the embedding tables it looks up, read from
the model's graph, so that the server refuses an id past a table (or negative) before the
request joins a batch.

The identity relied on: a lookup ``table[ids]`` (``aten.embedding``, ``embedding_bag``, the
``rocs::embedding_bag_rows`` kernel, ``index_select``/``index`` of a table) fails unless every
element of ``ids`` is in ``[0, rows)``, and ops that keep every element of their input
(``view``/``reshape``/``flatten``, ``unsqueeze``/``squeeze``, copies and dtype casts, and the
gather of request rows to candidates, which reaches every request row since each request has a
candidate) pass that condition back to the input unchanged; ``select`` of one column (a dim other
than the batch dim) passes it to that column only. Ids that reach a table any other way (hashed,
shifted, sliced) get no range: the model's own error, if any, answers for them (the server runs
a failing batch again one request at a time, so only that request fails).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import fx

aten = torch.ops.aten


@dataclass(frozen=True)
class IdRange:
    """Every id of a field (or of one column of its rows: ``column`` = (dim of a row, index)) is
    in ``[0, rows)``: the rows of the table ``table`` it looks up."""

    rows: int
    table: str
    column: tuple[int, int] | None = None

    def where(self) -> str:
        return "" if self.column is None else f" (dim {self.column[0]}, index {self.column[1]})"


def _lookups() -> dict:
    """op -> (argument index of the table, argument index of the ids)."""
    found = {
        aten.embedding.default: (0, 1),
        aten.embedding_bag.default: (0, 1),
        aten.embedding_bag.padding_idx: (0, 1),
        aten._embedding_bag.default: (0, 1),
        aten._embedding_bag_forward_only.default: (0, 1),
    }
    rows = getattr(torch.ops.rocs, "embedding_bag_rows", None)
    if rows is not None:
        found[rows.default] = (0, 1)
    return found


# Ops whose output holds every element of their first input and no other value.
_KEEP_ELEMENTS = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints,
    aten.unsqueeze.default, aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims,
    aten.clone.default, aten.contiguous.default, aten._to_copy.default, aten.to.dtype,
    aten.alias.default, aten.detach.default, aten.lift_fresh_copy.default,
}  # fmt: skip
# Those that also keep the shape (before a ``select``, whose dims must be the input's).
_KEEP_SHAPE = {
    aten.clone.default, aten.contiguous.default, aten._to_copy.default, aten.to.dtype,
    aten.alias.default, aten.detach.default, aten.lift_fresh_copy.default,
}  # fmt: skip


def id_ranges(
    graph: fx.Graph,
    inputs: Mapping[str, str],
    table_rows: Callable[[fx.Node], int | None],
    index_name: str,
) -> dict[str, list[IdRange]]:
    """The id ranges of the inputs ``inputs`` names (placeholder name -> input name).

    ``table_rows(node)``: the rows of the table ``node`` holds, or None where ``node`` is no
    table (an input, a computed value). ``index_name``: the placeholder of
    ``candidate_to_request``, whose gathers keep every request row.
    """
    lookups = _lookups()
    ranges: dict[str, list[IdRange]] = {}
    for node in graph.nodes:
        where = lookups.get(node.target) if node.op == "call_function" else None
        if where is None:
            where = _table_indexing(node, table_rows)
        if where is None:
            continue
        table, ids = node.args[where[0]], node.args[where[1]]
        rows = table_rows(table) if isinstance(table, fx.Node) else None
        if rows is None or not isinstance(ids, fx.Node):
            continue
        source = _source(ids, index_name)
        if source is None or source[0].name not in inputs:
            continue
        name = inputs[source[0].name]
        found = IdRange(rows, table.name, source[1])
        if found not in ranges.setdefault(name, []):
            ranges[name].append(found)
    return ranges


def _table_indexing(node: fx.Node, table_rows) -> tuple[int, int] | None:
    """``index_select(table, 0, ids)`` and ``table[ids]`` of a table: where its arguments are."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    if table_rows(node.args[0]) is None:
        return None
    if node.target == aten.index_select.default and node.args[1] == 0:
        return (0, 2)
    if node.target == aten.index.Tensor and len(node.args[1]) == 1:
        return None if node.args[1][0] is None else (0, 1)  # one index tensor, in a list
    return None


def _source(ids: fx.Node, index_name: str) -> tuple[fx.Node, tuple[int, int] | None] | None:
    """The placeholder every element of ``ids`` comes from, and the column they are (None: all
    of it), or None where the ids are computed."""
    node = _through(ids, _KEEP_ELEMENTS, index_name)
    if node.op == "placeholder":
        return node, None
    if node.target == aten.select.int and node.args[1] != 0:
        base = _through(node.args[0], _KEEP_SHAPE, index_name)
        dim = node.args[1]
        if base.op == "placeholder" and isinstance(dim, int) and dim > 0:
            return base, (dim - 1, node.args[2])
    return None


def _through(node: fx.Node, ops: set, index_name: str) -> fx.Node:
    """``node`` followed back through ``ops`` and gathers of request rows to candidates."""
    while node.op == "call_function":
        if node.target in ops and isinstance(node.args[0], fx.Node):
            node = node.args[0]
        elif _gathers_requests(node, index_name):
            node = node.args[0]
        else:
            break
    return node


def _gathers_requests(node: fx.Node, index_name: str) -> bool:
    """``index_select(x, 0, candidate_to_request)``: x's request rows, one per candidate."""
    if node.target != aten.index_select.default or node.args[1] != 0:
        return False
    index = node.args[2]
    return isinstance(index, fx.Node) and index.op == "placeholder" and index.name == index_name
