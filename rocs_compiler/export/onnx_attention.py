"""Masked attention for ONNX, with eager's answer for a query that sees no key.

Eager's ``scaled_dot_product_attention`` (its math and fused CPU kernels alike) returns zeros for
a query whose every key is masked out: its softmax of a row of ``-inf`` only is 0, not NaN. The
ONNX exporter's translation does not: a boolean mask becomes an additive mask of the dtype's
lowest finite value, so such a row attends uniformly to every key (the mean of the values); a
float mask of ``-inf`` gives NaN. A request whose history is all padding then scores otherwise in
ONNX Runtime than in eager.

:func:`with_eager_attention` replaces each masked ``scaled_dot_product_attention`` of a program
(in the branches of a ``torch.cond`` too) by its plain ops (``matmul``, ``softmax``, ``matmul``),
the weights of a row of ``-inf`` only set to zero, which every ONNX runtime computes as eager
does. Attention without a mask keeps the exporter's translation (a query sees every key, or,
causal, at least the first).

Identity: for ``scores = q @ k^T * scale + additive(mask)``,
``sdpa(q, k, v, mask) == where(closed, 0, softmax(scores, -1) @ v)`` with ``closed`` the rows
whose every key the mask hides (``all(additive(mask) == -inf, -1)``, read off the mask, which is
smaller than the scores): such a row's softmax is NaN or uniform, and the ``where`` drops it; any
other row has a finite score (finite queries and keys), so its weights are eager's. A row whose
finite scores overflow to ``-inf`` everywhere is not read as closed (eager's zeros there; NaN here).
"""

from __future__ import annotations

import math

import torch
from torch import fx

aten = torch.ops.aten


def _eager_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
):
    """``aten.scaled_dot_product_attention`` with a mask, in plain ops (NotImplemented, which
    keeps the op, for attention without a mask or with dropout)."""
    if attn_mask is None or dropout_p != 0.0:
        return NotImplemented
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        groups = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(groups, dim=-3)
        value = value.repeat_interleave(groups, dim=-3)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = (query @ key.transpose(-2, -1)) * scale
    if attn_mask.dtype == torch.bool:
        hidden = attn_mask.logical_not()
        scores = scores.masked_fill(hidden, float("-inf"))
    else:
        hidden = attn_mask == float("-inf")
        scores = scores + attn_mask
    # A query whose every key the mask hides: read off the mask (no head dim, one row when it
    # broadcasts over the queries) and applied to the output (D wide, not L).
    closed = hidden.all(-1, keepdim=True)
    return (torch.softmax(scores, -1) @ value).masked_fill(closed, 0.0)


def has_masked_attention(program: torch.export.ExportedProgram) -> bool:
    """True when ``program`` calls ``scaled_dot_product_attention`` with a mask, in its graph or
    in a branch of a ``torch.cond`` (as the portable attention does)."""
    graphs = [m.graph for m in program.graph_module.modules() if isinstance(m, fx.GraphModule)]
    for node in (node for graph in graphs for node in graph.nodes):
        if node.op == "call_function" and node.target is aten.scaled_dot_product_attention.default:
            mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
            if mask is not None:
                return True
    return False


def with_eager_attention(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """``program`` with each masked attention in plain ops (see the module's docstring);
    ``program`` itself when it has none."""
    if not has_masked_attention(program):
        return program
    return program.run_decompositions({aten.scaled_dot_product_attention.default: _eager_attention})
