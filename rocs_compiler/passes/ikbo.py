"""ikbo: replace ``consumer(broadcast(x), ...)`` with ops that read request rows in-kernel.

After *share*, every request value that candidate computation reads arrives through
``index_select(x, 0, idx)``, a replicated ``[N, ...]`` copy. Each rule below replaces a consumer
of such a broadcast with a ``rocs::`` op that takes ``x`` at its natural ``[R, ...]`` size plus
``idx``; the op's reference (``rocs_compiler.kernels.ROCS_OPS``) is exactly the replaced subgraph, so
the identity each rule relies on is the definition of its op:

- ``linear(c, W, b) + x[idx]`` -> ``broadcast_linear(c, W, b, x, idx)``; for ``c [N, L, K]`` and
  ``x [R, L, M]`` (a DIN activation unit over a history of static length L) the same op on the
  rows: ``c`` as ``[N L, K]``, ``x`` as ``[R L, M]``, candidate row ``n L + l`` reading request
  row ``idx[n] L + l``;
- ``W @ E + x[idx]`` (matmul or the equivalent einsum) -> ``broadcast_linear_compression``;
- ``sdpa(q, k[idx], v[idx], mask[idx])`` with a key-padding mask (bool ``[N, 1, 1, L]``, or the
  float mask ``[N, H, 1, L]`` that ``nn.MultiheadAttention`` builds, as ``key_bias``) ->
  ``broadcast_attention``;
- ``bmm(softmax(bmm(q, kT[idx])), v[idx])`` over heads merged into the batch (``[N*H, L, d]``,
  whose broadcasts gather along the outer factor of dim 0) -> ``broadcast_attention`` on the
  ``[N, H, L, d]`` views, scale 1;
- ``bmm(C, X[idx])`` / ``bmm(X[idx], C)`` -> ``broadcast_interaction`` (transposed as needed);
- ``matmul(x [N, *B, m, k], W [*B, k, n])`` with a constant ``W`` broadcast over candidates
  (which ``matmul`` copies once per candidate) -> one GEMM per ``B`` index over the candidates
  folded into the rows: ``permute(matmul(reshape(permute(x), [*B, N m, k]), W), back)``;
- a chain of elementwise ops over candidate tensors and broadcasts -> ``broadcast_pointwise``
  with a generated kernel (enabled by default only for models on a GPU, where the saved memory
  traffic pays for the kernel launch).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import fx
from torch._guards import detect_fake_mode

from .. import kernels  # noqa: F401 - registers the rocs:: ops
from ..kernels import pointwise_program as program_ast
from .engine import Builder, Rewrite, rewrite_to_fixpoint
from ..analysis.batch_axis import LEADING
from ..ir.graph_meta import BROADCAST, INDEX_NAME, PLACEMENT
from ..ir.roles import Role

aten = torch.ops.aten
rocs = torch.ops.rocs


def _broadcast_source(node: Any) -> Optional[fx.Node]:
    """``x`` when ``node`` is ``index_select(x, 0, idx)`` inserted by *share* (a request value
    whose batch is its leading dim: the fused ops gather rows)."""
    if isinstance(node, fx.Node) and node.meta.get(BROADCAST) == LEADING:
        return node.args[0]
    return None


def _merged_broadcast_source(node: Any) -> Optional[tuple[fx.Node, int]]:
    """``(x, H)`` when ``node`` is a broadcast of the request value ``x`` whose batch is the
    outer factor of dim 0 (``[R*H, ...]`` gathered to ``[N*H, ...]``: split, gathered, merged)."""
    if not (isinstance(node, fx.Node) and node.target == aten.reshape.default):
        return None
    gathered = node.args[0]
    axis = gathered.meta.get(BROADCAST) if isinstance(gathered, fx.Node) else None
    if axis is None or axis.dim != 0 or axis.outer != 1 or axis.inner == 1:
        return None
    split = gathered.args[0]
    return split.args[0], axis.inner


def _single_user(node: Any) -> bool:
    return isinstance(node, fx.Node) and len(node.users) == 1


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else node


def _const(node: Any) -> bool:
    return isinstance(node, fx.Node) and node.meta.get(PLACEMENT) == Role.CONST


class _Context:
    def __init__(self, index: fx.Node):
        self.index = index


def _plain_add(node: fx.Node) -> Optional[tuple[fx.Node, fx.Node]]:
    if node.target != aten.add.Tensor or node.kwargs.get("alpha", 1) != 1 or len(node.args) != 2:
        return None
    return node.args[0], node.args[1]


def _split_add(node: fx.Node):
    """(other, request source) for ``other + broadcast(x)`` in either order."""
    pair = _plain_add(node)
    if pair is None:
        return None
    for other, bcast in (pair, pair[::-1]):
        source = _broadcast_source(bcast)
        if source is not None and isinstance(other, fx.Node) and _single_user(other):
            vals = (_val(other), _val(node), _val(bcast))
            if not all(isinstance(v, torch.Tensor) for v in vals):
                continue  # a batch size (SymInt) or a number added to a broadcast
            # Same shape and dtype: no broadcasting and no type promotion inside the fused add.
            same_shape = tuple(vals[0].shape) == tuple(vals[1].shape) == tuple(vals[2].shape)
            if same_shape and vals[0].dtype == vals[1].dtype == vals[2].dtype:
                return other, source
    return None


def _fuse_linear(ctx: _Context):
    def apply(b: Builder, node: fx.Node) -> Optional[fx.Node]:
        split = _split_add(node)
        if split is None:
            return None
        lin, source = split
        if lin.target != aten.linear.default:
            return None
        c, weight = lin.args[0], lin.args[1]
        bias = lin.args[2] if len(lin.args) > 2 else None
        if not _const(weight) or (bias is not None and not _const(bias)):
            return None
        if _val(c).dim() == 2:
            return b.call(rocs.broadcast_linear.default, c, weight, bias, source, ctx.index)
        length = _val(c).shape[1]
        if _val(c).dim() != 3 or _val(source).dim() != 3 or not isinstance(length, int):
            return None
        k, m = _val(c).shape[2], _val(weight).shape[0]
        rows = b.call(
            rocs.broadcast_linear.default,
            b.call(aten.reshape.default, c, [-1, k]),
            weight,
            bias,
            b.call(aten.reshape.default, source, [-1, m]),
            _row_index(b, ctx.index, length, weight),
        )
        return b.call(aten.reshape.default, rows, [-1, length, m])

    return apply


def _row_index(b: Builder, index: fx.Node, length: int, like: fx.Node) -> fx.Node:
    """``[N L]``: ``index[n] * L + l`` at row ``n L + l``. The offsets ``0..L-1`` are made from
    the constant ``like`` (a weight), so that cleanup folds them into a buffer, which moves with
    the model's device."""
    ones = b.call(aten.new_ones.default, like, [length], dtype=torch.int64)
    offsets = b.call(aten.sub.Tensor, b.call(aten.cumsum.default, ones, 0), 1)
    first = b.call(aten.mul.Tensor, b.call(aten.unsqueeze.default, index, 1), length)
    return b.call(aten.reshape.default, b.call(aten.add.Tensor, first, offsets), [-1])


def _left_matmul(node: fx.Node) -> Optional[tuple[fx.Node, fx.Node]]:
    """(W [M, K], E [N, K, D]) for ``matmul(W, E)`` or ``einsum('mk,nkd->nmd', W, E)``."""
    if node.target == aten.matmul.default:
        w, e = node.args
    elif node.target == aten.einsum.default and len(node.args[1]) == 2:
        equation = node.args[0].replace(" ", "")
        lhs, out = equation.split("->") if "->" in equation else ("", "")
        specs = lhs.split(",")
        if len(specs) != 2 or len(specs[0]) != 2 or len(specs[1]) != 3 or len(out) != 3:
            return None
        m, k = specs[0]
        n, k2, d = specs[1]
        if k != k2 or out != n + m + d or len({m, k, n, d}) != 4:
            return None
        w, e = node.args[1]
    else:
        return None
    if _val(w).dim() != 2 or _val(e).dim() != 3 or not _const(w):
        return None
    return w, e


def _fuse_linear_compression(ctx: _Context):
    def apply(b: Builder, node: fx.Node) -> Optional[fx.Node]:
        split = _split_add(node)
        if split is None:
            return None
        product, source = split
        operands = _left_matmul(product)
        if operands is None:
            return None
        w, e = operands
        return b.call(rocs.broadcast_linear_compression.default, e, w, source, ctx.index)

    return apply


def _fuse_attention(ctx: _Context):
    def apply(b: Builder, node: fx.Node) -> Optional[fx.Node]:
        args = list(node.args) + [None] * (4 - len(node.args))
        q, k, v, mask = args[:4]
        mask = node.kwargs.get("attn_mask", mask)
        if node.kwargs.get("is_causal") or node.kwargs.get("dropout_p", 0.0) or len(node.args) > 4:
            return None
        if node.kwargs.get("enable_gqa"):
            return None
        k_r, v_r = _broadcast_source(k), _broadcast_source(v)
        if k_r is None or v_r is None or _val(q).dim() != 4:
            return None
        key_mask = key_bias = None
        if mask is not None:
            m_r = _broadcast_source(mask)
            shape = _val(mask).shape if m_r is not None else None
            if m_r is None or len(shape) != 4 or shape[2] != 1:
                return None
            if _val(mask).dtype == torch.bool and shape[1] == 1:
                key_mask = b.call(aten.view.default, m_r, [-1, shape[3]])
            elif _val(mask).dtype == _val(q).dtype and shape[1] in (1, _val(q).shape[1]):
                key_bias = m_r  # a float mask, the same for every query: added to the scores
                if shape[1] == 1:
                    key_bias = b.call(aten.expand.default, m_r, [-1, _val(q).shape[1], -1, -1])
            else:
                return None
        scale = node.kwargs.get("scale")
        return b.call(
            rocs.broadcast_attention.default, q, k_r, v_r, ctx.index, key_mask, scale, key_bias
        )

    return apply


def _softmax_input(node: Any) -> Optional[fx.Node]:
    """``x`` for ``softmax(x, -1)`` (either spelling) without a dtype change."""
    if not isinstance(node, fx.Node) or len(node.args) < 2 or node.args[1] not in (-1, 2):
        return None
    if node.target == aten._softmax.default and not node.args[2]:
        return node.args[0]
    if node.target == aten.softmax.int and node.kwargs.get("dtype") is None and len(node.args) == 2:
        return node.args[0]
    return None


def _fuse_merged_head_attention(ctx: _Context):
    """``bmm(softmax(bmm(q, kT[idx]), -1), v[idx])`` over heads merged into the batch
    (``[N*H, Lq, d]``, what ``nn.MultiheadAttention`` computes when it returns weights) is
    ``broadcast_attention`` on the ``[N, H, Lq, d]`` view with scale 1 (``q`` is already
    scaled): the same products and softmax, without gathering K/V per candidate."""

    def apply(b: Builder, node: fx.Node) -> Optional[fx.Node]:
        weights, v = node.args[:2]
        scores = _softmax_input(weights)
        if scores is None or not _single_user(weights) or not _single_user(scores):
            return None
        # With a float mask (``baddbmm``) a fully masked row is NaN here (a softmax over -inf),
        # where the fused op returns zeros as SDPA does: only the unmasked spelling fuses.
        if scores.target != aten.bmm.default:
            return None
        q, k_t = scores.args[:2]
        k_source, v_source = _merged_broadcast_source(k_t), _merged_broadcast_source(v)
        if k_source is None or v_source is None or k_source[1] != v_source[1]:
            return None
        heads = k_source[1]
        _, lq, d = _val(q).shape
        key_len = _val(k_t).shape[2]
        dtypes = {_val(x).dtype for x in (q, k_t, v)}
        if len(dtypes) != 1 or not isinstance(lq, int) or not isinstance(key_len, int):
            return None
        k = b.call(aten.transpose.int, k_source[0], 1, 2)
        k = b.call(aten.reshape.default, k, [-1, heads, key_len, d])
        v4 = b.call(aten.reshape.default, v_source[0], [-1, heads, key_len, d])
        q4 = b.call(aten.reshape.default, q, [-1, heads, lq, d])
        out = b.call(rocs.broadcast_attention.default, q4, k, v4, ctx.index, None, 1.0)
        return b.call(aten.reshape.default, out, [-1, lq, d])

    return apply


def _fuse_interaction(ctx: _Context):
    def apply(b: Builder, node: fx.Node) -> Optional[fx.Node]:
        left, right = node.args[:2]
        if _val(left).dim() != 3 or _val(right).dim() != 3:
            return None
        right_r, left_r = _broadcast_source(right), _broadcast_source(left)
        if right_r is not None and left_r is None:
            # out[n] = C[n] @ X[idx[n]] with X [R, D, Fu]: the request stack is X^T.
            stack = b.call(aten.transpose.int, right_r, 1, 2)
            return b.call(rocs.broadcast_interaction.default, stack, left, ctx.index)
        if left_r is not None and right_r is None:
            # out[n] = U[idx[n]] @ Y[n] = (Y[n]^T @ U[idx[n]]^T)^T
            cand = b.call(aten.transpose.int, right, 1, 2)
            out = b.call(rocs.broadcast_interaction.default, left_r, cand, ctx.index)
            return b.call(aten.transpose.int, out, 1, 2)
        return None

    return apply


def _fuse_weight_matmul(b: Builder, node: fx.Node) -> Optional[fx.Node]:
    x, w = node.args
    if not isinstance(x, fx.Node) or x.meta.get(PLACEMENT) != Role.CANDIDATE or not _const(w):
        return None
    xv, wv = _val(x), _val(w)
    nb = wv.dim() - 2  # the batch dims B shared by x and W
    if nb < 1 or xv.dim() != wv.dim() + 1 or tuple(xv.shape[1:-2]) != tuple(wv.shape[:-2]):
        return None
    m, k = xv.shape[-2], xv.shape[-1]
    if not isinstance(m, int) or not isinstance(k, int):
        return None
    batch = list(wv.shape[:-2])
    to_front = [*range(1, nb + 1), 0, nb + 1, nb + 2]  # [N, *B, m, k] -> [*B, N, m, k]
    rows = b.call(aten.reshape.default, b.call(aten.permute.default, x, to_front), [*batch, -1, k])
    product = b.call(aten.matmul.default, rows, w)  # [*B, N m, n]
    n_out = wv.shape[-1]
    grouped = b.call(aten.reshape.default, product, [*batch, -1, m, n_out])
    out = b.call(aten.permute.default, grouped, [nb, *range(nb), nb + 1, nb + 2])
    if any(u.target == aten.view.default for u in node.users):
        # matmul returned a contiguous tensor; a view of the permuted result would fail.
        out = b.call(aten.clone.default, out, memory_format=torch.contiguous_format)
    return out


# -- pointwise chains --------------------------------------------------------------------------

# ATen overload -> primitive of the program language, from the language's own table.
_PROGRAM_OPS = {p.aten: name for name, p in program_ast.PRIMITIVES.items() if p.aten is not None}


def _program_operands(node: fx.Node):
    """Operands of a pointwise node that the program language can express, or None."""
    if node.target not in _PROGRAM_OPS or node.meta.get(PLACEMENT) != Role.CANDIDATE:
        return None
    if node.target == aten.gelu.default and node.kwargs.get("approximate", "none") != "none":
        return None
    if node.kwargs and set(node.kwargs) - {"approximate", "alpha"}:
        return None
    if node.kwargs.get("alpha", 1) != 1:
        return None
    out = _val(node)
    if not isinstance(out, torch.Tensor) or not out.is_floating_point():
        return None
    for arg in node.args:
        if isinstance(arg, fx.Node):
            val = _val(arg)
            if not isinstance(val, torch.Tensor) or tuple(val.shape) != tuple(out.shape):
                return None
            if val.dtype != out.dtype:
                return None
        elif not isinstance(arg, (int, float)) or isinstance(arg, bool):
            return None
    return list(node.args)


class _ProgramBuilder:
    """Numbers the candidate inputs (``c<i>``) and request sources (``r<i>``) of one program."""

    def __init__(self):
        self.candidates: list[fx.Node] = []
        self.requests: list[fx.Node] = []

    def leaf(self, arg: Any) -> Optional[program_ast.Node]:
        if not isinstance(arg, fx.Node):
            value = float(arg)
            return program_ast.Const(value) if math.isfinite(value) else None
        source = _broadcast_source(arg)
        if source is not None:
            return self.request(source)
        if arg not in self.candidates:
            self.candidates.append(arg)
        return program_ast.Input("c", self.candidates.index(arg))

    def request(self, source: fx.Node) -> program_ast.Input:
        if source not in self.requests:
            self.requests.append(source)
        return program_ast.Input("r", self.requests.index(source))


def _fuse_pointwise(ctx: _Context):
    def apply(b: Builder, node: fx.Node) -> Optional[fx.Node]:
        operands = _program_operands(node)
        if operands is None:
            return None
        fused_inputs = [a for a in operands if _is_fused_pointwise(a) and _single_user(a)]
        if not any(_broadcast_source(a) is not None for a in operands) and not fused_inputs:
            return None
        program = _ProgramBuilder()
        parts = []
        for arg in operands:
            if _is_fused_pointwise(arg) and _single_user(arg):
                parts.append(_inline(program, arg))
            else:
                parts.append(program.leaf(arg))
            if parts[-1] is None:
                return None
        text = program_ast.format_program(program_ast.Call(_PROGRAM_OPS[node.target], tuple(parts)))
        return b.call(
            rocs.broadcast_pointwise.default, text, program.candidates, program.requests, ctx.index
        )

    return apply


def _is_fused_pointwise(node: Any) -> bool:
    return isinstance(node, fx.Node) and node.target == rocs.broadcast_pointwise.default


def _inline(program: _ProgramBuilder, fused: fx.Node) -> program_ast.Node:
    """The fused node's program with its inputs renumbered into ``program``."""
    text, cands, reqs = fused.args[0], fused.args[1], fused.args[2]
    renamed = {f"c{i}": program.leaf(c) for i, c in enumerate(cands)}
    renamed |= {f"r{i}": program.request(r) for i, r in enumerate(reqs)}
    return program_ast.rename_inputs(text, lambda x: renamed[str(x)])


def _place_new_node(node: fx.Node) -> None:
    """A node a rule created lives where its highest-placed input lives; *share* placed the
    others."""
    if PLACEMENT not in node.meta:
        node.meta[PLACEMENT] = Role.join_all(a.meta[PLACEMENT] for a in node.all_input_nodes)


def ikbo_rewrites(index: Optional[fx.Node], pointwise: bool = False) -> list[Rewrite]:
    """The rules, in the order they are tried, reading ``candidate_to_request`` from ``index``;
    ``pointwise`` adds the generated pointwise kernels."""
    ctx = _Context(index)
    rewrites = [
        Rewrite("ikbo_linear", frozenset({aten.add}), _fuse_linear(ctx)),
        Rewrite("ikbo_linear_compression", frozenset({aten.add}), _fuse_linear_compression(ctx)),
        Rewrite("ikbo_attention", frozenset({aten.scaled_dot_product_attention}), _fuse_attention(ctx)),
        Rewrite("ikbo_merged_head_attention", frozenset({aten.bmm}),
                _fuse_merged_head_attention(ctx)),
        Rewrite("ikbo_interaction", frozenset({aten.bmm}), _fuse_interaction(ctx)),
        Rewrite("ikbo_weight_matmul", frozenset({aten.matmul}), _fuse_weight_matmul),
    ]
    if pointwise:
        rewrites.append(Rewrite("ikbo_pointwise", frozenset(p.overloadpacket for p in _PROGRAM_OPS),
                                _fuse_pointwise(ctx)))
    return rewrites


def ikbo(
    gm: fx.GraphModule, pointwise: bool = False, only: Optional[frozenset[str]] = None
) -> tuple[fx.GraphModule, dict[str, int]]:
    """Fuse broadcasts into their consumers; returns the graph and how often each rule fired.
    ``only`` names the rules to run (all by default; the identity tests run one at a time)."""
    index = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == INDEX_NAME)
    _ensure_index_val(gm, index)
    rewrites = [rw for rw in ikbo_rewrites(index, pointwise) if only is None or rw.name in only]
    counts = rewrite_to_fixpoint(gm, rewrites, _place_new_node)
    return gm, counts


def _ensure_index_val(gm: fx.GraphModule, index: fx.Node) -> None:
    if "val" in index.meta:
        return
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    tensors = [v for v in vals if isinstance(v, torch.Tensor) and v.dim() > 0]
    mode = detect_fake_mode(tensors)
    with mode:
        index.meta["val"] = torch.empty(tensors[0].shape[0], dtype=torch.int64)
