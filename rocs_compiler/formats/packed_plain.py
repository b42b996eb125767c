"""The plain graph of a column-range model over its packed arguments as called.

A model compiled with column ranges (``columns.py``) is captured as a wrapper that takes each
packed argument ``X`` as its column pieces and concatenates them back; its plain graph (the
program a call runs where sharing does not pay, ``runtime/call/plain.py``) inherits that, so a call
would split ``X`` into views and copy them together again before the model's own ops.
:func:`packed_plain_graph` gives the plain graph ``X`` itself instead: each piece placeholder
becomes a slice of a placeholder for ``X``, and a concatenation of those slices in order along
the columns, which is ``X`` again, is ``X``.

Identity: ``X[:, a:b]`` is piece ``a:b`` of the split (``ColumnSplit.split``), and
``cat([X[:, p0], X[:, p1], ...], dim=1) == X`` for pieces that cover its columns in order
(``columns.py``'s identity read backwards). Slices are views of the caller's tensor, never
overwritten: the direct program writes in place only into tensors it computed itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import fx
from torch._guards import detect_fake_mode

from ..ir.graph_meta import PLACEMENT
from ..ir.roles import Role

_SLICE = torch.ops.aten.slice.Tensor
_CAT = torch.ops.aten.cat.default


def packed_plain_graph(
    gm: fx.GraphModule, input_names: Sequence[str], splits: Sequence
) -> tuple[fx.GraphModule, list[str]]:
    """``(gm, its input names)``: ``gm`` (placeholders in ``input_names`` order), rewritten in
    place, taking each of ``splits``' arguments whole, by its leaf name, where it took its
    pieces."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(input_names):
        raise ValueError(f"{len(placeholders)} placeholders for inputs {list(input_names)}")
    piece_of = {  # program input name -> (split, start, stop)
        f"{split.argument}.{key}": (split, start, stop)
        for split in splits
        for key, start, stop, _ in split.pieces()
    }
    vals = [n.meta.get("val") for n in placeholders]
    fake_mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    names: list[str] = []
    whole: dict[str, fx.Node] = {}
    slices: dict[str, list[fx.Node]] = {}  # per argument, its pieces' slices in column order
    for node, name in zip(placeholders, input_names):
        if name not in piece_of:
            names.append(name)
            continue
        split, start, stop = piece_of[name]
        packed = whole.get(split.argument)
        if packed is None:
            with graph.inserting_before(node):
                packed = graph.placeholder(_identifier(split.argument, gm))
            packed.meta["val"] = _packed_val(node.meta.get("val"), split.width, fake_mode)
            packed.meta[PLACEMENT] = node.meta.get(PLACEMENT, Role.CANDIDATE)
            whole[split.argument] = packed
            names.append(split.argument)
        with graph.inserting_after(_last_placeholder(graph)):
            piece = graph.call_function(_SLICE, (packed, 1, start, stop))
        piece.meta.update(node.meta)
        node.replace_all_uses_with(piece)
        graph.erase_node(node)
        slices.setdefault(split.argument, []).append(piece)
    for argument, pieces in slices.items():
        for cat in [u for u in pieces[0].users if u.target is _CAT]:
            if list(cat.args[0]) == pieces and _dim(cat) in (1, -1):
                cat.replace_all_uses_with(whole[argument])
                graph.erase_node(cat)
    for pieces in slices.values():
        for piece in pieces:
            if not piece.users:
                graph.erase_node(piece)
    graph.lint()
    gm.recompile()
    return gm, names


def _dim(cat: fx.Node) -> int:
    return cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)


def _last_placeholder(graph: fx.Graph) -> fx.Node:
    return [n for n in graph.nodes if n.op == "placeholder"][-1]


def _identifier(argument: str, gm: fx.GraphModule) -> str:
    taken = {n.name for n in gm.graph.nodes} | set(dir(gm))
    base = "".join(c if c.isalnum() else "_" for c in argument) or "packed"
    name, i = base, 0
    while name in taken:
        i += 1
        name = f"{base}_{i}"
    return name


def _packed_val(piece, width: int, fake_mode):
    """The fake value of the packed argument: a piece's rows with ``width`` columns."""
    if not isinstance(piece, torch.Tensor):
        return None
    if fake_mode is None:
        return piece.new_empty((piece.shape[0], width, *piece.shape[2:]))
    with fake_mode:
        return piece.new_empty((piece.shape[0], width, *piece.shape[2:]))
