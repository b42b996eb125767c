"""normalize: one spelling per meaning, so that each defer rule has one pattern.

Identities:

- ``stack(xs, d) == cat([unsqueeze(x, d) for x in xs], d)``;
- ``cat([a, b, c, d], k) == cat([cat([a, b], k), cat([c, d], k)], k)``: adjacent pieces of the
  same role are grouped, so a concatenation alternates between request and candidate runs;
- ``slice(cat(xs, k), k, start, end)`` is the concatenation of the slices of the pieces it
  overlaps (a single piece when it covers exactly one);
- ``split(x, sizes, d)[i] == slice(x, d, o_i, o_i + sizes[i])`` (``o_i`` the sizes before it),
  for ``x`` a concatenation: a split at the pieces' boundaries gives the pieces back (a TorchRec
  ``KeyedTensor`` read by key), and so is ``narrow(x, d, start, length)`` (``slice`` from
  ``start`` to ``start + length``);
- ``cat([x], d) == x`` (a concatenation of one piece, as ``torch.concat(kt_values)``);
- TorchRec's ``fbgemm::permute_pooled_embs(x, offsets, permute, ...)`` (``KeyedTensor.regroup``)
  is ``cat([x[:, offsets[p]:offsets[p + 1]] for p in permute], 1)``, spelled so for ``x`` a
  concatenation with constant ``offsets`` and ``permute``;
- ``unbind(x, d)[i] == select(x, d, i)`` and
  ``select(permute(x, p), d, i) == permute(select(x, p[d], i), p')``: a fused QKV projection
  split by permute + unbind keeps the batch dim where the analysis can see it;
- ``embedding_bag(W, reshape(x, [-1]), arange(0, numel(x), L))`` over a ``[B, L]`` index matrix
  pools each row into one bag: it is the row-wise op ``rocs::embedding_bag_rows(W, x)``,
  computed by the very same kernel call.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
from torch import fx

from ..ir.symbolic import same_size
from .concat import as_concat, constant_index_entries, role_of, runs_in_pieces, val_of
from .engine import Builder, Rewrite

aten = torch.ops.aten


def _stack_to_cat(b: Builder, node: fx.Node) -> Optional[fx.Node]:
    tensors = list(node.args[0])
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    dim %= node.meta["val"].dim()
    pieces = [b.call(aten.unsqueeze.default, t, dim) for t in tensors]
    return b.call(aten.cat.default, pieces, dim)


def _group_role_runs(b: Builder, node: fx.Node) -> Optional[fx.Node]:
    info = as_concat(node)
    if info is None or not info.mixed:
        return None
    roles = info.roles
    runs: list[list[fx.Node]] = []
    for piece, role in zip(info.pieces, roles):
        if runs and role_of(runs[-1][0]) == role:
            runs[-1].append(piece)
        else:
            runs.append([piece])
    if all(len(run) == 1 for run in runs):
        return None
    grouped = [run[0] if len(run) == 1 else b.call(aten.cat.default, run, info.dim) for run in runs]
    return b.call(aten.cat.default, grouped, info.dim)


def _flatten_mixed_cat(b: Builder, node: fx.Node) -> Optional[fx.Node]:
    """``cat([cat([r, c], d), x], d) == cat([r, c, x], d)``: a concatenation nested in another
    along the same dim, when it mixes roles, is inlined so that its request pieces are visible
    to the distributions of the outer one (features flattened, then joined with dense ones)."""
    info = as_concat(node)
    if info is None:
        return None
    pieces, inlined = [], False
    for piece in info.pieces:
        inner = as_concat(piece)
        if inner is not None and inner.mixed and inner.dim == info.dim:
            pieces.extend(inner.pieces)
            inlined = True
        else:
            pieces.append(piece)
    return b.call(aten.cat.default, pieces, info.dim) if inlined else None


def _slice_of_cat(b: Builder, node: fx.Node) -> Optional[fx.Node]:
    source, dim, start, end = (list(node.args) + [0, None, None])[:4]
    step = node.args[4] if len(node.args) > 4 else 1
    info = as_concat(source)
    if info is None or step != 1 or not isinstance(start or 0, int) or not isinstance(end, (int, type(None))):
        return None
    dim %= info.ndim
    if dim != info.dim:
        return None
    total = sum(info.sizes)
    start = max(0, min(start or 0, total)) if (start or 0) >= 0 else max(0, total + start)
    end = total if end is None else (min(end, total) if end >= 0 else max(0, total + end))
    parts = []
    for piece, (lo, hi) in zip(info.pieces, info.offsets):
        a, z = max(start, lo), min(end, hi)
        if a >= z:
            continue
        parts.append(piece if (a, z) == (lo, hi) else b.call(aten.slice.Tensor, piece, dim, a - lo, z - lo))
    if not parts or (len(parts) == len(info.pieces) and (start, end) == (0, total)):
        return None
    return parts[0] if len(parts) == 1 else b.call(aten.cat.default, parts, dim)


def _select_of_cat(b: Builder, node: fx.Node) -> Optional[fx.Node]:
    """``cat(pieces, d).select(d, i) == pieces[k].select(d, i - offset_k)`` for the piece that
    holds index ``i`` (one column of a packed input, ``X[:, 0]``)."""
    source, dim, index = node.args[:3]
    info = as_concat(source)
    if info is None or not isinstance(index, int) or dim % info.ndim != info.dim:
        return None
    index = index if index >= 0 else index + sum(info.sizes)
    for piece, (lo, hi) in zip(info.pieces, info.offsets):
        if lo <= index < hi:
            return b.call(aten.select.int, piece, info.dim, index - lo)
    return None


def _index_of_cat(b: Builder, node: fx.Node) -> Optional[fx.Node]:
    """``cat(pieces, d)[..., I]`` (``index`` with one index list, at dim ``d``, or
    ``index_select(cat, d, I)``) with every entry of ``I`` known at compile time, in
    ``[0, size)``: equal to ``cat([pieces[k][..., I_r - offset_k] for each run r], d)``, where
    the runs ``I_r`` are the maximal runs of consecutive entries of ``I`` inside one piece ``k``
    (each row's columns are picked one by one, in the order of ``I``, so grouping them by piece
    and concatenating back changes nothing). A run of ascending neighbours is a slice, any
    other run an ``index_select`` whose index is read from ``I`` itself (a constant subgraph
    that cleanup folds). Only over a concatenation that mixes roles (the split pays off there);
    negative or out-of-range entries leave the op as it is, to fail or wrap as eager does, and
    so do more than ``_MAX_RUNS`` runs (a list alternating pieces: one op per run).

    The runs are read once, at compile time: an index tensor held in a buffer or a tensor
    attribute and written in place after compiling is not followed (a literal list or a Python
    list attribute cannot change that way; guards compare lists by value)."""
    found = _column_list(node)
    if found is None:
        return None
    source, dim, index = found
    info = as_concat(through_full_slices(source))
    if info is None or not info.mixed or dim % info.ndim != info.dim:
        return None
    # Literals only: a buffer is model state that the runtime follows when it is written after
    # compile, and the runs built here from its values would not follow it.
    values = constant_index_entries(index, state=False)
    if not values or not all(0 <= v < sum(info.sizes) for v in values):
        return None
    runs = runs_in_pieces(info, values)
    if len(runs) > _MAX_RUNS:
        return None
    parts = [_run_of(b, info, index, values, *run) for run in runs]
    return parts[0] if len(parts) == 1 else b.call(aten.cat.default, parts, info.dim)


_MAX_RUNS = 64


def _column_list(node: fx.Node) -> Optional[tuple[fx.Node, int, fx.Node]]:
    """``(source, dim, I)`` of ``index(source, [None] * dim + [I])`` or
    ``index_select(source, dim, I)``."""
    if node.target == aten.index_select.default:
        source, dim, index = node.args[:3]
        return (source, dim, index) if isinstance(index, fx.Node) else None
    if node.target != aten.index.Tensor:
        return None
    source, indices = node.args[:2]
    given = [k for k, i in enumerate(indices) if i is not None]
    if len(given) != 1 or not isinstance(indices[given[0]], fx.Node):
        return None
    return source, given[0], indices[given[0]]


def through_full_slices(node):
    """``x`` for ``x[:, ...]`` (``slice(x, d, 0, end)`` with ``end`` past every size)."""
    while _is_full_slice(node):
        node = node.args[0]
    return node


def _is_full_slice(node) -> bool:
    if not isinstance(node, fx.Node) or node.target != aten.slice.Tensor:
        return False
    start, end, step = (list(node.args) + [0, None, None, 1][len(node.args) - 1:])[2:5]
    return start in (0, None) and step == 1 and (end is None or end == _MAX_END)


_MAX_END = 2**63 - 1  # ``x[:, ...]`` as captured: ``slice(x, 0, 0, 9223372036854775807)``


def _run_of(b: Builder, info, index: fx.Node, values: list[int], piece: int, first: int, end: int):
    """``pieces[piece][..., I[first:end] - offset]``: the piece itself, a slice or an
    ``index_select``."""
    x, dim = info.pieces[piece], info.dim
    lo, hi = info.offsets[piece]
    local = [v - lo for v in values[first:end]]
    if local == list(range(local[0], local[0] + len(local))):
        if (local[0], len(local)) == (0, hi - lo):
            return x
        return b.call(aten.slice.Tensor, x, dim, local[0], local[0] + len(local))
    run = index
    if (first, end) != (0, len(values)):
        run = b.call(aten.slice.Tensor, index, 0, first, end)
    if lo:
        run = b.call(aten.sub.Tensor, run, lo)
    return b.call(aten.index_select.default, x, dim, run)


def _embedding_bag_rows(b: Builder, node: fx.Node) -> Optional[fx.Node]:
    """Anchored at ``getitem(embedding_bag(...), 0)``, the pooled output."""
    bag = node.args[0]
    if node.args[1] != 0 or not isinstance(bag, fx.Node):
        return None
    if bag.target not in (aten.embedding_bag.padding_idx, aten.embedding_bag.default):
        return None
    args = list(bag.args)
    weight, flat, offsets = args[:3]
    mode = args[4] if len(args) > 4 else 0
    per_sample = args[6] if len(args) > 6 else None
    include_last = args[7] if len(args) > 7 else False
    padding_idx = args[8] if len(args) > 8 else None
    if include_last or per_sample is not None or not _is_reshape_to_flat(flat):
        return None
    rows = flat.args[0]
    rows_val = val_of(rows)
    if rows_val.dim() != 2 or not isinstance(rows_val.shape[1], int):
        return None
    if not _is_regular_offsets(offsets, rows, rows_val.shape[1]):
        return None
    if any(u is not node and u.users for u in bag.users):
        return None
    from ..kernels import embedding_bag_rows  # noqa: F401 - registers rocs::embedding_bag_rows

    return b.call(torch.ops.rocs.embedding_bag_rows.default, weight, rows, mode, padding_idx)


def _split_of_cat(b: Builder, node: fx.Node) -> fx.Node | None:
    """Anchored at ``getitem(split(cat(...), sizes, d), i)``; the slice is left to
    ``slice_of_cat``."""
    source, index = node.args
    if not isinstance(source, fx.Node) or source.target not in (
        aten.split_with_sizes.default, aten.split.Tensor
    ):
        return None
    x = source.args[0]
    info = as_concat(x)
    dim = source.args[2] if len(source.args) > 2 else source.kwargs.get("dim", 0)
    if info is None or dim % info.ndim != info.dim:
        return None
    sizes = [val_of(item).shape[info.dim] for item in source.meta["val"]]
    if not all(isinstance(s, int) for s in sizes):
        return None
    start = sum(sizes[:index])
    return b.call(aten.slice.Tensor, x, info.dim, start, start + sizes[index])


def _narrow_of_cat(b: Builder, node: fx.Node) -> fx.Node | None:
    x, dim, start, length = node.args[:4]
    info = as_concat(x)
    if info is None or dim % info.ndim != info.dim:
        return None
    if not isinstance(start, int) or not isinstance(length, int):
        return None
    start = start if start >= 0 else start + sum(info.sizes)
    return b.call(aten.slice.Tensor, x, info.dim, start, start + length)


def _cat_of_one(b: Builder, node: fx.Node) -> fx.Node | None:
    pieces = node.args[0]
    if len(pieces) != 1 or not isinstance(pieces[0], fx.Node):
        return None
    if any(user.op == "output" for user in node.users):
        return None  # the model returns a fresh tensor, not its input
    return pieces[0]


def _is_permute_pooled_embs(target) -> bool:
    return isinstance(target, torch._ops.OpOverload) and target.name() == _PERMUTE_POOLED_EMBS


_PERMUTE_POOLED_EMBS = "fbgemm::permute_pooled_embs"


def _permute_pooled_embs_of_cat(b: Builder, node: fx.Node) -> fx.Node | None:
    x, offsets, permute = node.args[:3]
    info = as_concat(x)
    offsets, permute = _constant_ints(offsets), _constant_ints(permute)
    if info is None or info.dim != 1 or info.ndim != 2 or offsets is None or permute is None:
        return None
    blocks = [
        b.call(aten.slice.Tensor, x, 1, offsets[p], offsets[p + 1]) for p in permute
    ]
    return blocks[0] if len(blocks) == 1 else b.call(aten.cat.default, blocks, 1)


def _constant_ints(node) -> list[int] | None:
    """The values of a constant integer tensor (a ``get_attr``, possibly cloned), or None."""
    while isinstance(node, fx.Node) and node.target in (aten.clone.default, aten._to_copy.default):
        node = node.args[0]
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return None
    value = operator.attrgetter(node.target)(node.graph.owning_module)
    if not isinstance(value, torch.Tensor) or value.dtype.is_floating_point or value.dim() != 1:
        return None
    return value.tolist()


def _unbind_to_select(b: Builder, node: fx.Node) -> Optional[fx.Node]:
    source, index = node.args
    if not isinstance(source, fx.Node) or source.target != aten.unbind.int:
        return None
    dim = source.args[1] if len(source.args) > 1 else source.kwargs.get("dim", 0)
    return b.call(aten.select.int, source.args[0], dim, index)


def _select_of_permute(b: Builder, node: fx.Node) -> Optional[fx.Node]:
    source, dim, index = node.args
    if not isinstance(source, fx.Node) or source.target != aten.permute.default:
        return None
    x, order = source.args
    ndim = len(order)
    order = [o % ndim for o in order]
    picked = order[dim % ndim]
    rest = [o - (o > picked) for o in order if o != picked]
    return b.call(aten.permute.default, b.call(aten.select.int, x, picked, index), rest)


def _is_reshape_to_flat(node) -> bool:
    return (
        isinstance(node, fx.Node)
        and node.target in (aten.reshape.default, aten.view.default, aten.flatten.using_ints)
        and val_of(node).dim() == 1
    )


def _is_regular_offsets(node, rows, width: int) -> bool:
    if not isinstance(node, fx.Node) or node.target != aten.arange.start_step:
        return False
    start, end, step = node.args[:3]
    if start != 0 or step != width:
        return False
    return same_size(val_of(end), val_of(rows).numel())


def normalize_rewrites() -> list[Rewrite]:
    return [
        Rewrite("stack_to_cat", frozenset({aten.stack}), _stack_to_cat, "stack -> cat of unsqueeze"),
        Rewrite("flatten_mixed_cat", frozenset({aten.cat}), _flatten_mixed_cat,
                "inline a mixed concatenation nested along the same dim"),
        Rewrite("group_role_runs", frozenset({aten.cat}), _group_role_runs, "group same-role pieces"),
        Rewrite("slice_of_cat", frozenset({aten.slice}), _slice_of_cat, "slice of a cat -> piece"),
        Rewrite("select_of_cat", frozenset({aten.select}), _select_of_cat,
                "select of a cat -> select of the piece"),
        Rewrite("index_of_cat", frozenset({aten.index, aten.index_select}), _index_of_cat,
                "constant column list of a cat -> cat of the pieces' slices and selections"),
        Rewrite("split_of_cat", frozenset({operator.getitem}), _split_of_cat,
                "split of a cat + getitem -> slice"),
        Rewrite("narrow_of_cat", frozenset({aten.narrow}), _narrow_of_cat,
                "narrow of a cat -> slice"),
        Rewrite("cat_of_one", frozenset({aten.cat, aten.concat}), _cat_of_one,
                "cat of one piece -> the piece"),
        Rewrite("permute_pooled_embs_of_cat", _is_permute_pooled_embs,
                _permute_pooled_embs_of_cat, "regrouped pooled embeddings -> cat of slices"),
        Rewrite("unbind_to_select", frozenset({operator.getitem}), _unbind_to_select,
                "unbind + getitem -> select"),
        Rewrite("select_of_permute", frozenset({aten.select}), _select_of_permute,
                "select of a permute -> permute of a select"),
        Rewrite("embedding_bag_rows", frozenset({operator.getitem}), _embedding_bag_rows,
                "fixed-length bags -> row-wise bag op"),
    ]
