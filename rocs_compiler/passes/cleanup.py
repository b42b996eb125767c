"""cleanup: constant folding, common subexpressions, full slices, dead code.

Identities: a node whose inputs are all weights (no input reaches it) has the same value on every
call *as long as the weights do not change*, so it is evaluated once at compile time and stored
as a buffer, and the ``get_attr`` node that reads the buffer keeps the subgraph as its recipe
(``graph_meta.FOLD``, a :class:`~rocs_compiler.ir.folded.Fold`) so that the runtime can evaluate it
again after a weight refresh; two pure nodes with the same op and the same arguments have the
same value; ``slice(x, d, 0, end)`` with ``end`` at or past the size of dim ``d`` is ``x``
(export spells ``x[:]`` over the batch dim this way), ``transpose(transpose(x, a, b), a, b)``
is ``x`` (the in-kernel broadcasts transpose their operands into the layout they take), and the
writes functionalization leaves that change nothing or everything are their result
(``drop_identity_writes``); in a graph with value semantics ``clone(x)`` is ``x`` (what a dropout
in eval mode becomes after functionalization, and eager returns its input there without
copying), except as a graph output, where the copy keeps the output from aliasing an input; a
pure node nobody uses can go. No decision here depends on a weight's value, only on shapes.

Two op forms are chosen here too (docs/SPEED.md, "Op forms chosen by cleanup", has the
timings). ``x[:, I, J]`` with constant index vectors is ``index_select(reshape(x, [B, -1]), 1,
F)`` with the folded flat index ``F = I' * x.shape[2] + J'`` (``I'``, ``J'`` with negative entries
wrapped, ``F`` pushed past the row for a pair out of range, so that ``index_select`` raises where
indexing would): the same elements copied in the same order; ``x[:, I]`` is
``index_select(x, 1, I')`` likewise. For a 2-D constant ``W [m, k]`` and a batched
``x [N, ..., k, n]``, ``matmul(W, x) == reshape(mm(reshape(x.mT, [-1, k]), W.T), [N, ..., n,
m]).mT``: the one ``mm`` the original model ran (its weights require grad), where the compiled
graph's ``matmul`` would run a ``bmm`` of N tiny products. And ``linear(x.transpose(a, b), W)``
over two leading dims of a 3-D or larger ``x`` reads a contiguous copy of its input: the copy
eager's ``linear`` makes inside (its ``matmul`` folds the leading dims by a ``reshape``), where a
compiler's ``matmul`` keeps the view and runs a ``bmm`` against the weight expanded over the
first dim (an encoder over ``[L, R, D]``: L products of R rows, where one ``mm`` of ``L R`` rows
does the same work).
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from ..ir.folded import Fold, fresh_attr
from ..ir.graph_meta import BATCH_AXIS, FOLD, PLACEMENT
from ..analysis.op_groups import is_mutating, is_random
from ..ir.roles import Role
from .engine import Builder, Rewrite, rewrite_to_fixpoint

_FOLD_LIMIT_ELEMENTS = 1 << 24  # never fold a constant into something larger than this


def cleanup(gm: fx.GraphModule, fold: bool = True) -> fx.GraphModule:
    """``fold=False`` (a training compile) evaluates no weight-only subgraph: the graph then
    computes every value from the weights at each call, so autograd reaches them."""
    constant_indexing_as_index_select(gm)  # first: its flat index folds into a constant
    if fold:
        fold_constants(gm)
    weight_first_matmuls_fold(gm)  # after folding: W.mT stays a view, as in the original's mm
    contiguous_linear_inputs(gm)
    drop_full_slices(gm)
    drop_double_transposes(gm)  # before CSE: x.mT.mT and x then read as one value
    drop_clones(gm)
    eliminate_common_subexpressions(gm)
    drop_identity_writes(gm)  # after CSE: a slice read twice is one node
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def _pure(node: fx.Node) -> bool:
    return node.op == "call_function" and not is_random(node.target) and not is_mutating(node.target)


def fold_constants(gm: fx.GraphModule) -> int:
    """Evaluate weight-only tensor nodes (slices and concatenations of weights, mostly) into
    buffers, each read by a ``get_attr`` node that carries its recipe."""
    values: dict[fx.Node, Any] = {}
    folded = 0
    for node in list(gm.graph.nodes):
        if node.op == "get_attr":
            values[node] = operator.attrgetter(node.target)(gm)
            continue
        if not _pure(node) or not node.all_input_nodes:
            continue
        if not all(a in values for a in node.all_input_nodes):
            continue
        args, kwargs = fx.map_arg((node.args, node.kwargs), lambda a: values[a])
        value = node.target(*args, **kwargs)
        values[node] = value
        if not isinstance(value, torch.Tensor) or value.numel() > _fold_limit(args):
            continue
        if all(_foldable_user(u, values, node) for u in node.users):
            continue  # an intermediate: its users fold too
        name = fresh_attr(gm, f"_folded_{node.name}")
        gm.register_buffer(name, value.contiguous(), persistent=False)
        with gm.graph.inserting_before(node):
            new = gm.graph.get_attr(name)
        new.meta.update(node.meta)
        new.meta[PLACEMENT] = Role.CONST
        new.meta[FOLD] = Fold.of(node)
        node.replace_all_uses_with(new)
        values[new] = values[node]
        folded += 1
    gm.graph.eliminate_dead_code()
    return folded


def weight_first_matmuls_fold(gm: fx.GraphModule) -> int:
    """``matmul(W, x)`` -> the folded ``mm`` of the module docstring, for a 2-D constant ``W``
    and ``x`` of 3 or more dims whose dims besides the batch are static. Returns the count."""
    return _rewrite_each_call(gm, "folded_mm", torch.ops.aten.matmul.default, _folded_mm)


def _folded_mm(b: Builder, node: fx.Node) -> fx.Node | None:
    aten = torch.ops.aten
    weight, x = node.args
    w_val, x_val = weight.meta.get("val"), x.meta.get("val")
    if weight.meta.get(PLACEMENT) != Role.CONST or x.meta.get(PLACEMENT) == Role.CONST:
        return None
    if not isinstance(w_val, torch.Tensor) or not isinstance(x_val, torch.Tensor):
        return None
    inner = list(x_val.shape[1:])
    if w_val.dim() != 2 or x_val.dim() < 3 or not all(isinstance(d, int) for d in inner):
        return None
    k, n, m = inner[-2], inner[-1], w_val.shape[0]
    rows = b.call(aten.reshape.default, b.call(aten.transpose.int, x, -1, -2), [-1, k])
    w_t = b.call(aten.t.default, weight)
    product = b.call(aten.mm.default, rows, w_t)
    grouped = b.call(aten.reshape.default, product, [-1, *inner[:-2], n, m])
    out = b.call(aten.transpose.int, grouped, -1, -2)
    for new in b.created:
        new.meta[PLACEMENT] = Role.CONST if new is w_t else x.meta[PLACEMENT]
    return out


def contiguous_linear_inputs(gm: fx.GraphModule) -> int:
    """``linear(transpose(x, a, b), W)`` over two leading dims -> ``linear(contiguous(...), W)``:
    the copy eager's ``linear`` makes itself, where a compiler's ``matmul`` would run a ``bmm``
    of tiny products against the weight expanded (module docstring). Returns the count."""
    return _rewrite_each_call(gm, "contiguous_linear", torch.ops.aten.linear.default, _copied_input)


def _copied_input(b: Builder, node: fx.Node) -> fx.Node | None:
    x = node.args[0]
    if not isinstance(x, fx.Node) or x.target != torch.ops.aten.transpose.int or x.kwargs:
        return None
    val = x.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() < 3 or x.meta.get(PLACEMENT) == Role.CONST:
        return None
    dims = {d % val.dim() for d in x.args[1:3]}
    if val.dim() - 1 in dims or any(_statically(val.shape[d], 1) for d in dims):
        return None  # the last dim moves, or the transpose is a view of the same rows
    copied = b.call(torch.ops.aten.clone.default, x, memory_format=torch.contiguous_format)
    copied.meta[PLACEMENT] = x.meta[PLACEMENT]
    if BATCH_AXIS in x.meta:
        copied.meta[BATCH_AXIS] = x.meta[BATCH_AXIS]
    out = b.call(torch.ops.aten.linear.default, copied, *node.args[1:])
    for key in (PLACEMENT, BATCH_AXIS):
        if key in node.meta:
            out.meta[key] = node.meta[key]
    return out


def _statically(size: Any, value: int) -> bool:
    """True when ``size`` is the int ``value`` (a symbolic size is never read, so no guard)."""
    return isinstance(size, int) and size == value


def constant_indexing_as_index_select(gm: fx.GraphModule) -> int:
    """``index(x, [None, I_1, ..., I_k])`` with weight-only 1-D integer ``I_j`` of one length,
    over every dim of ``x`` after the first (or ``k = 1``), those dims static: the
    ``index_select`` of the module docstring. Returns the count."""
    return _rewrite_each_call(
        gm, "flat_index_select", torch.ops.aten.index.Tensor, _flat_index_select
    )


def _flat_index_select(b: Builder, node: fx.Node) -> fx.Node | None:
    aten = torch.ops.aten
    x, indices = node.args
    x_val = x.meta.get("val") if isinstance(x, fx.Node) else None
    if not isinstance(x_val, torch.Tensor) or len(indices) < 2 or indices[0] is not None:
        return None
    if len(indices) != 2 and len(indices) != x_val.dim():
        return None
    sizes = list(x_val.shape[1:len(indices)])
    if not all(isinstance(s, int) for s in sizes) or not all(
        _constant_index_vector(i) for i in indices[1:]
    ):
        return None
    if len({i.meta["val"].shape[0] for i in indices[1:]}) != 1:
        return None
    flat = _flat_index(b, indices[1:], sizes)
    rows = x if len(indices) == 2 else b.call(aten.reshape.default, x, [-1, math.prod(sizes)])
    out = b.call(aten.index_select.default, rows, 1, flat)
    axis = x.meta.get(BATCH_AXIS)
    for new in b.created:
        new.meta[PLACEMENT] = x.meta.get(PLACEMENT) if new in (rows, out) else Role.CONST
        if new in (rows, out) and axis is not None and axis.dim == 0:
            new.meta[BATCH_AXIS] = axis  # dim 0 kept whole: rows stay apart (request cache)
    return out


def _constant_index_vector(node: Any) -> bool:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return (
        node.meta.get(PLACEMENT) == Role.CONST
        and isinstance(val, torch.Tensor)
        and val.dim() == 1
        and val.dtype in (torch.int64, torch.int32)
    ) if val is not None else False


def _flat_index(b: Builder, indices: list[fx.Node], sizes: list[int]) -> fx.Node:
    """``sum_j wrap(I_j) * stride_j``, plus the row length where some ``I_j`` is out of range."""
    aten = torch.ops.aten
    total = math.prod(sizes)
    flat, stride = None, total
    for index, size in zip(indices, sizes):
        stride //= size
        negative = b.call(aten.lt.Scalar, index, 0)
        wrapped = b.call(aten.where.self, negative, b.call(aten.add.Tensor, index, size), index)
        outside = b.call(
            aten.logical_or.default,
            b.call(aten.lt.Scalar, wrapped, 0),
            b.call(aten.ge.Scalar, wrapped, size),
        )
        term = b.call(
            aten.add.Tensor,
            b.call(aten.mul.Tensor, wrapped, stride),
            b.call(aten.mul.Tensor, outside, total),
        )
        flat = term if flat is None else b.call(aten.add.Tensor, flat, term)
    return flat


def _fold_limit(args: Any) -> int:
    """Fold anything no larger than its largest input (a masked weight, a slice), and small
    results of ops that expand; never materialize a large expansion."""
    largest = max((t.numel() for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor)), default=0)
    return max(largest, _FOLD_LIMIT_ELEMENTS)


def _foldable_user(user: fx.Node, values: dict, node: fx.Node) -> bool:
    return _pure(user) and all(a in values or a is node for a in user.all_input_nodes)


def drop_full_slices(gm: fx.GraphModule) -> int:
    """Replace ``slice(x, d, 0, end)`` covering all of dim ``d`` by ``x``."""
    dropped = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target != torch.ops.aten.slice.Tensor:
            continue
        bound = {"dim": 0, "start": None, "end": None, "step": 1}
        bound.update(zip(["source", "dim", "start", "end", "step"], node.args), **node.kwargs)
        source, end = bound["source"], bound["end"]
        if not isinstance(source, fx.Node) or bound["step"] != 1 or bound["start"] not in (0, None):
            continue
        if end is not None and not isinstance(end, int):
            continue
        val = source.meta.get("val")
        size = val.shape[bound["dim"]] if isinstance(val, torch.Tensor) else None
        if end is None or end >= _INT64_MAX or (isinstance(size, int) and end >= size):
            node.replace_all_uses_with(source)
            gm.graph.erase_node(node)
            dropped += 1
    return dropped


_INT64_MAX = 2**63 - 1


def drop_double_transposes(gm: fx.GraphModule) -> int:
    """Replace ``transpose(transpose(x, a, b), a, b)`` (dims in either order) by ``x``, except
    as a graph output (the model returns a view there, not its operand)."""
    return _rewrite_each_call(
        gm, "double_transpose", torch.ops.aten.transpose.int, _double_transpose_source
    )


def _double_transpose_source(b: Builder, node: fx.Node) -> fx.Node | None:
    inner = node.args[0]
    if not isinstance(inner, fx.Node) or inner.target != node.target or inner.kwargs:
        return None
    source = inner.args[0]
    val = source.meta.get("val") if isinstance(source, fx.Node) else None
    if not isinstance(val, torch.Tensor) or any(u.op == "output" for u in node.users):
        return None
    ndim = max(val.dim(), 1)
    if {d % ndim for d in node.args[1:3]} != {d % ndim for d in inner.args[1:3]}:
        return None
    return source


def _rewrite_each_call(gm: fx.GraphModule, name: str, target: Any, replace) -> int:
    """The engine's rewrite ``name``: each call of the overload ``target`` without keyword
    arguments replaced by ``replace(builder, node)`` where that gives a node (None: the call
    stays). The rewrites place the nodes they build themselves. Returns the count."""
    rewrite = Rewrite(
        name,
        lambda op: op == target,
        lambda builder, node: None if node.kwargs else replace(builder, node),
    )
    return rewrite_to_fixpoint(gm, [rewrite], infer_node=_placed_by_the_rewrite)[name]


def _placed_by_the_rewrite(node: fx.Node) -> None:
    """Placements stay as share and ikbo left them; a rewrite places what it builds."""


def drop_identity_writes(gm: fx.GraphModule) -> int:
    """Replace the writes functionalization leaves that change nothing, or everything:

    - ``slice_scatter(x, src, d, 0, end)`` with ``src`` as large as ``x`` by ``src`` (from 0 with
      step 1, a slice as large as ``x`` is all of it);
    - ``copy(x, x)`` by ``x``;
    - ``slice_scatter(x, slice(x, *p), *p)`` and ``select_scatter(x, select(x, *p), *p)`` by
      ``x`` (a part written back where it was read).

    ``x[:, 0].mul_(2)`` leaves the first (the write goes back through the ``x[:]`` it sliced),
    ``x[:, 1:3] += y`` the other two (``__setitem__`` stores the updated slice into itself).
    A node the graph output reads is kept: its copy keeps the output from aliasing.
    """
    dropped = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or any(user.op == "output" for user in node.users):
            continue
        replacement = _identity_write(node)
        if replacement is not None:
            node.replace_all_uses_with(replacement)
            gm.graph.erase_node(node)
            dropped += 1
    return dropped


_READ_OF_WRITE = {
    torch.ops.aten.slice_scatter.default: torch.ops.aten.slice.Tensor,
    torch.ops.aten.select_scatter.default: torch.ops.aten.select.int,
}


def _identity_write(node: fx.Node) -> Any:
    aten = torch.ops.aten
    if node.kwargs or len(node.args) < 2:
        return None
    base, src = node.args[0], node.args[1]
    if not (isinstance(base, fx.Node) and isinstance(src, fx.Node)):
        return None
    if node.target == aten.copy.default:
        return base if src is base and len(node.args) == 2 else None
    read = _READ_OF_WRITE.get(node.target)
    if read is None:
        return None
    written_back = src.target == read and not src.kwargs and src.args[0] is base
    if written_back and src.args[1:] == node.args[2:]:
        return base
    if node.target != aten.slice_scatter.default:
        return None
    bound = {"dim": 0, "start": None, "end": None, "step": 1}
    bound.update(zip(["dim", "start", "end", "step"], node.args[2:]))
    have, want = src.meta.get("val"), base.meta.get("val")
    if bound["step"] != 1 or bound["start"] not in (0, None):
        return None
    if not (isinstance(have, torch.Tensor) and isinstance(want, torch.Tensor)):
        return None
    same = have.dtype == want.dtype and [str(d) for d in have.shape] == [str(d) for d in want.shape]
    return src if same else None


def drop_clones(gm: fx.GraphModule) -> int:
    """Replace ``clone(x)`` (layout preserved) by ``x`` where the graph output does not read it."""
    dropped = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target != torch.ops.aten.clone.default:
            continue
        fmt = node.kwargs.get("memory_format", torch.preserve_format)
        if fmt not in (None, torch.preserve_format) or len(node.args) != 1:
            continue
        if any(user.op == "output" for user in node.users):
            continue
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)
        dropped += 1
    return dropped


def _key(value: Any) -> Any:
    if isinstance(value, fx.Node):
        return ("node", value)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_key(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _key(v)) for k, v in value.items())))
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return ("lit", str(value))
    if isinstance(value, float):
        return ("lit", "float", repr(value))  # keeps 0.0 and -0.0 (and NaN) apart
    try:
        hash(value)
    except TypeError:
        return ("id", id(value))
    return ("lit", type(value).__name__, value)


def eliminate_common_subexpressions(gm: fx.GraphModule) -> int:
    seen: dict[Any, fx.Node] = {}
    removed = 0
    for node in list(gm.graph.nodes):
        if node.op == "get_attr":
            key = ("get_attr", node.target)
        elif _pure(node):
            key = (node.target, _key(node.args), _key(node.kwargs))
        else:
            continue
        if key in seen:
            node.replace_all_uses_with(seen[key])
            gm.graph.erase_node(node)
            removed += 1
        else:
            seen[key] = node
    return removed
