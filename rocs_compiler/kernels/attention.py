"""Candidate queries attending to per-request keys/values: ``rocs::broadcast_attention``.

Axis letters: R requests, N candidates, H heads, Lq query length, L key length, D feature.

``broadcast_attention(q [N, H, Lq, D], k [R, H, L, D], v [R, H, L, D], idx [N],
key_mask [R, L]? (bool, True = attend), scale?, key_bias [R, H, 1, L]? (added to the scores))
-> [N, H, Lq, D]``

equals ``F.scaled_dot_product_attention(q, k[idx], v[idx],
attn_mask=key_mask[idx][:, None, None, :], scale=scale)`` (or ``attn_mask=key_bias[idx]``)
without replicating K/V. This is the candidate half of Deep Cross Attention: the history K/V
stack is request-only. ``key_bias`` is the float mask ``nn.MultiheadAttention`` builds from a
key padding mask (0 or -inf per key, the same for every query).

Fully masked rows (a request whose ``key_mask`` row is all False) produce zeros, which is
what ``F.scaled_dot_product_attention`` returns for such rows (torch >= 2.5); the Triton
kernel does the same.

CPU path: candidates are grouped by request (``request_groups.py``). For a group of G requests
with c candidates each, the queries of a request's candidates are stacked along the query
axis, ``[G, H, c * Lq, D]``, and one SDPA call runs against that request's K/V, so each
K/V is read once and never replicated. CUDA path: flash-attention style kernel in
``attention_triton.py``. FLOPs: ``4 N H Lq L D`` (the two matmuls, as torch counts SDPA).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from rocs_compiler.kernels.common import check_same_dtype, check_shape
from rocs_compiler.kernels.request_groups import group_by_request
from rocs_compiler.kernels.rocs_op import RocsOp, define


def default_scale(head_dim: int, scale: float | None) -> float:
    """SDPA's softmax scale: ``1 / sqrt(D)`` unless given."""
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def _check(q, k, v, candidate_to_request, key_mask=None, scale=None, key_bias=None):
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
    if key_bias is not None:
        if key_mask is not None:
            raise ValueError(f"rocs::{op}: give key_mask or key_bias, not both")
        check_shape(op, "key_bias", key_bias, (num_requests, h, 1, key_len))
        check_same_dtype(op, q=q, key_bias=key_bias)
    return num_candidates, num_requests


def _cpu(q, k, v, candidate_to_request, key_mask=None, scale=None, key_bias=None) -> torch.Tensor:
    num_requests, h, _, d = k.shape
    scale = default_scale(d, scale)
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
        if key_bias is not None:
            mask = group.gather_requests(key_bias)  # [G, H, 1, L]: one row for every query
        og = F.scaled_dot_product_attention(
            qg, group.gather_requests(k), group.gather_requests(v), attn_mask=mask, scale=scale
        )
        group.scatter_candidates(out, og.view(g, h, c, lq, d).transpose(1, 2))
    return out


def _fake(q, k, v, candidate_to_request, key_mask=None, scale=None, key_bias=None):
    torch._check(q.dim() == 4 and k.dim() == 4 and v.dim() == 4)
    torch._check(k.shape[1] == q.shape[1] and k.shape[3] == q.shape[3])
    torch._check(v.shape[0] == k.shape[0] and v.shape[2] == k.shape[2])
    torch._check(candidate_to_request.shape[0] == q.shape[0])
    if key_mask is not None:
        torch._check(key_mask.shape[0] == k.shape[0] and key_mask.shape[1] == k.shape[2])
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _flops(q_shape, k_shape, v_shape, idx_shape, key_mask_shape=None, scale=None, **kwargs):
    n, h, lq, d = q_shape
    key_len = k_shape[2]
    return 4 * n * h * lq * key_len * d


def _reference(q, k, v, candidate_to_request, key_mask=None, scale=None, key_bias=None):
    mask = None
    if key_mask is not None:
        mask = key_mask.index_select(0, candidate_to_request)[:, None, None, :]
    if key_bias is not None:
        mask = key_bias.index_select(0, candidate_to_request)
    return F.scaled_dot_product_attention(
        q,
        k.index_select(0, candidate_to_request),
        v.index_select(0, candidate_to_request),
        attn_mask=mask,
        scale=scale,
    )


BROADCAST_ATTENTION = define(
    RocsOp(
        name="broadcast_attention",
        schema="(Tensor q, Tensor k, Tensor v, Tensor candidate_to_request, Tensor? key_mask=None, "
        "float? scale=None, Tensor? key_bias=None) -> Tensor",
        check=_check,
        fake=_fake,
        flops=_flops,
        cpu=_cpu,
        triton="attention_triton:broadcast_attention",
        reference=_reference,
        differentiable=_cpu,  # grouped by request: K/V are never replicated, forward or backward
        index_arg=3,
    )
)
