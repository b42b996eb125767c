"""Embedding bags for ONNX as a gather and a scatter-add, never a ``Loop``.

The ONNX exporter translates ``embedding_bag`` into a ``Loop`` over the bags, one iteration per
bag, which ONNX Runtime interprets node by node: a DLRM's bags then cost many times their
lookups. :func:`with_gathered_bags` writes each bag of a program in ops ONNX Runtime runs as
kernels: the rows gathered at once (``index_select``), each id's bag numbered from the offsets
(a cumulative sum of the bag starts), and the rows summed into their bags by one ``scatter_add``
(``amax`` by ``scatter_reduce`` for max bags), mean bags divided by their sizes; bags of 2-D ids,
all of one size ``k``, as the gathered rows ``[B, k, D]`` reduced over ``k``
(:func:`_reduce_fixed_size`), which needs no scatter.

Identity: for ids ``i`` with bag numbers ``b`` (``b[j]`` the bag of position ``j``),
``embedding_bag(W, i, offsets, sum)[k] == sum over j with b[j] = k of W[i[j]] * w[j]`` (``w`` the
per-sample weights, 1 without), ids equal to ``padding_idx`` left out (and out of a mean's
count), an empty bag 0 in every mode.
"""

from __future__ import annotations

import copy

import sympy
import torch
from torch import fx

from ..ir.symbolic import expr_of

aten = torch.ops.aten
_SUM, _MEAN, _MAX = 0, 1, 2
BAG_OPS = (aten.embedding_bag.default, aten.embedding_bag.padding_idx)


def _bag_numbers(indices, offsets, include_last_offset: bool):
    """(the bag of each id, number of bags) of 1-D ids and their bags' offsets (the op's form:
    ``F.embedding_bag`` flattens 2-D ids and makes their offsets)."""
    starts = offsets[:-1] if include_last_offset else offsets
    count = indices.shape[0]
    # A bag starts at each offset; empty bags share a start, so their marks add up there and the
    # cumulative sum steps over them. A start at ``count`` (a trailing empty bag) falls past it.
    marks = torch.zeros(count + 1, dtype=torch.int64, device=indices.device)
    marks = marks.scatter_add(0, starts, torch.ones_like(starts))
    return marks[:count].cumsum(0) - 1, starts.shape[0]


def _gathered_bag(
    weight, indices, offsets, scale_grad_by_freq=False, mode=0, sparse=False,
    per_sample_weights=None, include_last_offset=False, padding_idx=None,
):  # fmt: skip
    """``aten.embedding_bag`` by a gather and a scatter-add; its other three outputs (the
    backward's) as the op gives them for the output alone: the bag of each id, bag sizes, and
    zeros for the max's arg."""
    ids = indices
    numbers, bags = _bag_numbers(indices, offsets, include_last_offset)
    rows = weight.index_select(0, ids)
    width = weight.shape[1]
    kept = None
    if padding_idx is not None:  # a negative one counts from the end, as the op reads it
        kept = ids != (padding_idx + weight.shape[0] if padding_idx < 0 else padding_idx)
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.reshape(-1, 1).to(rows.dtype)
    target = numbers.unsqueeze(1).expand(-1, width)
    ones = torch.ones_like(ids, dtype=weight.dtype) if kept is None else kept.to(weight.dtype)
    sizes = torch.zeros(bags, dtype=weight.dtype, device=weight.device).scatter_add(
        0, numbers, ones
    )
    if mode == _MAX:
        if kept is not None:
            rows = rows.masked_fill(kept.logical_not().unsqueeze(1), float("-inf"))
        out = torch.full((bags, width), float("-inf"), dtype=weight.dtype, device=weight.device)
        out = out.scatter_reduce(0, target, rows, "amax", include_self=True)
        out = out.masked_fill((sizes == 0).unsqueeze(1), 0.0)
    else:
        if kept is not None:
            rows = rows.masked_fill(kept.logical_not().unsqueeze(1), 0.0)
        out = torch.zeros(bags, width, dtype=weight.dtype, device=weight.device)
        out = out.scatter_add(0, target, rows)
        if mode == _MEAN:
            out = out / sizes.clamp(min=1).unsqueeze(1)
    max_args = torch.zeros((bags, width) if mode == _MAX else (0,), dtype=torch.int64,
                           device=weight.device)  # fmt: skip
    return out, numbers, sizes.to(torch.int64), max_args


def _pooled_only(program: torch.export.ExportedProgram) -> bool:
    """True when ``program`` has a bag and reads only the pooled output of each (an inference
    program); the backward's outputs stay the exporter's to translate."""
    bags = [n for n in program.graph.nodes if n.op == "call_function" and n.target in BAG_OPS]
    return bool(bags) and all(
        user.target.__name__ == "getitem" and (user.args[1] == 0 or not user.users)
        for bag in bags
        for user in bag.users
    )


def with_gathered_bags(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """``program`` with each embedding bag as a gather and a reduction over its fixed size (bags
    of 2-D ids) or a scatter-add (the module's docstring); ``program`` itself when it has none,
    or reads more of a bag than its output."""
    if not _pooled_only(program):
        return program
    program = copy.deepcopy(program)  # the caller's program stays as it is
    for bag in [n for n in program.graph.nodes if n.target in BAG_OPS]:
        _reduce_fixed_size(program.graph, bag)
    program.graph_module.recompile()
    return program.run_decompositions(dict.fromkeys(BAG_OPS, _gathered_bag))


def _bag_arguments(bag: fx.Node) -> list:
    """The bag's nine arguments (``weight, indices, offsets, scale_grad_by_freq, mode, sparse,
    per_sample_weights, include_last_offset, padding_idx``), defaults as None."""
    return list(bag.args) + [None] * (9 - len(bag.args))


def _fixed_size(bag: fx.Node) -> tuple[fx.Node, int] | None:
    """(the 2-D ids, the bag size ``k``) of a bag over ``ids.reshape(-1)`` with offsets
    ``arange(0, ids.numel(), k)``, the form ``F.embedding_bag`` gives 2-D ids; None for others."""
    indices, offsets = bag.args[1], bag.args[2]
    if not (isinstance(indices, fx.Node) and isinstance(offsets, fx.Node)):
        return None
    if indices.target is not aten.reshape.default or list(indices.args[1]) != [-1]:
        return None
    if offsets.target is not aten.arange.start_step or offsets.args[0] != 0:
        return None
    ids, size = indices.args[0], offsets.args[2]
    val = ids.meta.get("val") if isinstance(ids, fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.dim() != 2 or val.shape[1] != size:
        return None
    end = offsets.args[1]
    end = end.meta.get("val") if isinstance(end, fx.Node) else end
    numel, stated = expr_of(val.numel()), expr_of(end)
    if numel is None or stated is None or sympy.simplify(stated - numel) != 0:
        return None  # the offsets do not span the ids
    if not isinstance(size, int) or size < 1:
        return None
    if _bag_arguments(bag)[7]:  # include_last_offset: offsets then hold more than the starts
        return None
    return ids, size


def _reduce_fixed_size(graph: fx.Graph, bag: fx.Node) -> None:
    """Bags of one size ``k`` (``ids [B, k]``): ``embedding(W, ids)`` reduced over ``k`` by a
    sum, mean or max, padding ids left out; the bag's pooled output replaced by it.

    Identity: bag ``b`` holds the ids ``ids[b, :]``, so the op's scatter over bag numbers is the
    reduction over dim 1 of the gathered rows ``[B, k, D]``; a mean divides by the ids kept, an
    empty bag (every id padding) gives 0 in every mode."""
    found = _fixed_size(bag)
    if found is None:
        return
    ids, size = found
    weight = bag.args[0]
    arguments = _bag_arguments(bag)
    mode, per_sample, padding_idx = arguments[4] or 0, arguments[6], arguments[8]
    pooled = [u for u in bag.users if u.args[1] == 0]
    with graph.inserting_before(bag):
        call = graph.call_function
        rows = call(aten.embedding.default, (weight, ids))
        if per_sample is not None:
            shaped = call(aten.view_as.default, (per_sample, ids))
            rows = call(aten.mul.Tensor, (rows, call(aten.unsqueeze.default, (shaped, 2))))
        kept = None
        if padding_idx is not None:
            rows_of = weight.meta["val"].shape[0]
            pad = padding_idx + rows_of if padding_idx < 0 else padding_idx
            kept = call(aten.ne.Scalar, (ids, pad))
            mask = call(aten.unsqueeze.default, (kept, 2))
        if mode == _MAX:
            if kept is not None:
                dropped = call(aten.logical_not.default, (mask,))
                rows = call(aten.masked_fill.Scalar, (rows, dropped, float("-inf")))
            out = call(aten.amax.default, (rows, [1]))
            if kept is not None:
                some = call(aten.unsqueeze.default, (call(aten.any.dim, (kept, 1)), 1))
                out = call(aten.where.ScalarOther, (some, out, 0.0))
        else:
            if kept is not None:
                rows = call(aten.mul.Tensor, (rows, call(aten.type_as.default, (mask, rows))))
            out = call(aten.sum.dim_IntList, (rows, [1]))
            if mode == _MEAN and kept is None:
                out = call(aten.div.Scalar, (out, float(size)))
            elif mode == _MEAN:
                count = call(aten.sum.dim_IntList, (call(aten.type_as.default, (kept, out)), [1]))
                count = call(aten.clamp_min.default, (count, 1.0))
                out = call(aten.div.Tensor, (out, call(aten.unsqueeze.default, (count, 1))))
    for user in pooled:
        user.replace_all_uses_with(out)
        graph.erase_node(user)
    if not bag.users:
        graph.erase_node(bag)
