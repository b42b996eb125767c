"""Candidate queries attending to per-request keys/values: ``rocs::broadcast_attention``.

Axis letters: R requests, N candidates, H heads, Lq query length, L key length, D feature.

``broadcast_attention(q [N, H, Lq, D], k [R, H, L, D], v [R, H, L, D], idx [N],
key_mask [R, L]? (bool, True = attend), scale?) -> [N, H, Lq, D]``

equals ``F.scaled_dot_product_attention(q, k[idx], v[idx],
attn_mask=key_mask[idx][:, None, None, :], scale=scale)`` without replicating K/V. This
is the candidate half of Deep Cross Attention: the history K/V stack is request-only.

Fully masked rows (a request whose ``key_mask`` row is all False) produce zeros, which is
what ``F.scaled_dot_product_attention`` returns for such rows (torch >= 2.5); the Triton
kernel does the same.

CPU path: candidates are grouped by request (``grouping.py``). For a group of G requests
with c candidates each, the queries of a request's candidates are stacked along the query
axis, ``[G, H, c * Lq, D]``, and one SDPA call runs against that request's K/V, so each
K/V is read once and never replicated. CUDA path: flash-attention style kernel in
``attention_triton.py``. FLOPs: ``4 N H Lq L D`` (the two matmuls, as torch counts SDPA).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import register_flop_formula

from rocs_compiler.kernels.common import (
    check_candidate_index,
    check_same_dtype,
    check_shape,
    use_triton,
)
from rocs_compiler.kernels.request_groups import group_by_request


@torch.library.custom_op("rocs::broadcast_attention", mutates_args=())
def broadcast_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    candidate_to_request: torch.Tensor,
    key_mask: torch.Tensor | None,
    scale: float | None,
) -> torch.Tensor:
    """SDPA of candidate queries against the K/V of their request."""
    op = "broadcast_attention"
    check_shape(op, "q", q, (None, None, None, None))
    num_candidates, h, _, d = q.shape
    check_shape(op, "k", k, (None, h, None, d))
    num_requests, _, key_len, _ = k.shape
    check_shape(op, "v", v, (num_requests, h, key_len, d))
    check_same_dtype(op, q=q, k=k, v=v)
    if key_mask is not None:
        check_shape(op, "key_mask", key_mask, (num_requests, key_len))
        if key_mask.dtype != torch.bool:
            raise TypeError(f"rocs::{op}: key_mask must be bool, got {key_mask.dtype}")
    check_candidate_index(candidate_to_request, num_candidates, num_requests, op)
    return run_broadcast_attention(q, k, v, candidate_to_request, key_mask, scale)


def run_broadcast_attention(q, k, v, candidate_to_request, key_mask, scale) -> torch.Tensor:
    """The op's device dispatch without its argument checks (callers checked them)."""
    num_requests, h, _, d = k.shape
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if use_triton(q):
        from rocs_compiler.kernels import attention_triton

        return attention_triton.broadcast_attention(q, k, v, candidate_to_request, key_mask, scale)

    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if q.numel() == 0:
        return out
    for group in group_by_request(candidate_to_request, num_requests):
        g, c = group.candidates.shape
        lq = q.shape[2]
        # [G, c, H, Lq, D] -> [G, H, c * Lq, D]: the candidates of a request become one
        # longer query sequence against that request's keys.
        qg = group.gather_candidates(q).transpose(1, 2).reshape(g, h, c * lq, d)
        mask = None
        if key_mask is not None:
            mask = group.gather_requests(key_mask)[:, None, None, :]
        og = F.scaled_dot_product_attention(
            qg, group.gather_requests(k), group.gather_requests(v), attn_mask=mask, scale=scale
        )
        group.scatter_candidates(out, og.view(g, h, c, lq, d).transpose(1, 2))
    return out


@broadcast_attention.register_fake
def _(q, k, v, candidate_to_request, key_mask, scale):
    torch._check(q.dim() == 4 and k.dim() == 4 and v.dim() == 4)
    torch._check(k.shape[1] == q.shape[1] and k.shape[3] == q.shape[3])
    torch._check(v.shape[0] == k.shape[0] and v.shape[2] == k.shape[2])
    torch._check(candidate_to_request.shape[0] == q.shape[0])
    if key_mask is not None:
        torch._check(key_mask.shape[0] == k.shape[0] and key_mask.shape[1] == k.shape[2])
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@register_flop_formula(torch.ops.rocs.broadcast_attention)
def _(q_shape, k_shape, v_shape, idx_shape, key_mask_shape, scale, out_shape=None, **kwargs):
    n, h, lq, d = q_shape
    key_len = k_shape[2]
    return 4 * n * h * lq * key_len * d
