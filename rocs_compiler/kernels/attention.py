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
``attention_triton.py``. Portable programs (``export/portable.py``) run
``attention_portable.py`` instead of the reference: the same value, the candidates of a request
as rows of one query sequence, in ops that export with dynamic R and N. FLOPs: ``4 N H Lq L D``
(the two matmuls, as torch counts SDPA).

Backward (torch, any device), grouped as the CPU forward is: per group the probabilities
``P = softmax(scale * Q K.T + mask)`` are recomputed (one matmul; fully masked rows are zero, as
in the forward), then with ``g = d out``: ``dV = P.T @ g``, ``dP = g @ V.T``,
``dS = P * (dP - rowsum(P * dP))``, ``dQ = scale * dS @ K``, ``dK = scale * dS.T @ Q`` and
``d key_bias = sum over queries of dS``. The candidates of a request are rows of the stacked
query axis, so the products ``P.T @ g`` and ``dS.T @ Q`` sum over them: the per-request sum of
the broadcast's backward. Only the inputs are saved (K, V at R rows); float16/bfloat16 inputs
are differentiated in float32. Above ``EXPLICIT_BACKWARD_MAX_SCORES`` score entries
(``N H Lq L``) the backward is instead the vector-Jacobian product of the grouped torch path,
whose fused SDPA backward (one kernel per group) beats the formula's five batched matmuls there;
neither replicates K/V.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from rocs_compiler.kernels.attention_portable import per_request_attention
from rocs_compiler.kernels.common import check_same_dtype, check_shape
from rocs_compiler.kernels.request_groups import group_by_request
from rocs_compiler.kernels.rocs_op import RocsOp, define, vjp

# Largest number of attention scores (N * H * Lq * L) whose backward runs the explicit formula.
# Measured on x86 (one thread, float32): the formula is 1.2-2x faster than the grouped SDPA's
# autograd at 6k-20k scores (no forward replay, no autograd graph), even at 200k, and 1.6x slower
# at 800k, where torch's fused attention backward keeps the score blocks in cache.
EXPLICIT_BACKWARD_MAX_SCORES = 1 << 18


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


def _backward(needs, grad, q, k, v, candidate_to_request, key_mask=None, scale=None, key_bias=None):
    """The module docstring's formulas: gradients of ``(q, k, v, idx, key_mask, scale,
    key_bias)``."""
    num_requests, h, key_len, d = k.shape
    num_candidates, _, lq, _ = q.shape
    if num_candidates * h * lq * key_len > EXPLICIT_BACKWARD_MAX_SCORES:
        args = (q, k, v, candidate_to_request, key_mask, scale, key_bias)
        return vjp(_cpu, grad, args, needs)
    scale = default_scale(d, scale)
    want_q, want_k, want_v = needs[0], needs[1], needs[2]
    want_bias = key_bias is not None and needs[6]
    dtype = q.dtype
    work = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    grads = {}
    if want_q:
        grads["q"] = q.new_empty(q.shape, dtype=work)
    per_request = {"k": (want_k, k), "v": (want_v, v), "bias": (want_bias, key_bias)}
    if q.numel() and (want_q or want_k or want_v or want_bias):
        grad = grad.to(work).contiguous()
        for group in group_by_request(candidate_to_request, num_requests):
            g, c = group.candidates.shape
            # [N, H, Lq, D] -> [G, H, c * Lq, D], as the forward stacks the queries
            qg, gg = (
                group.gather_candidates(x).transpose(1, 2).reshape(g, h, c * lq, d)
                for x in (q.to(work), grad)
            )
            kg, vg = group.gather_requests(k).to(work), group.gather_requests(v).to(work)
            scores = torch.matmul(qg, kg.transpose(-1, -2)).mul_(scale)
            if key_mask is not None:
                drop = group.gather_requests(key_mask).logical_not()[:, None, None, :]
                scores.masked_fill_(drop, float("-inf"))
            if key_bias is not None:
                scores.add_(group.gather_requests(key_bias).to(work))
            probs = torch.softmax(scores, dim=-1)
            if key_mask is not None or key_bias is not None:
                probs.nan_to_num_(0.0)  # a fully masked row: softmax of -inf is NaN
            dscores = torch.matmul(gg, vg.transpose(-1, -2))  # d probs, made d scores in place
            # rowsum(P * dP), its product written over the scores (fresh memory is slow to fault in)
            delta = torch.mul(probs, dscores, out=scores).sum(-1, keepdim=True)
            del scores
            dscores.sub_(delta).mul_(probs)
            if want_q:
                dq = torch.matmul(dscores, kg).mul_(scale)
                group.scatter_candidates(grads["q"], dq.view(g, h, c, lq, d).transpose(1, 2))
            for name, (wanted, like) in per_request.items():
                if not wanted:
                    continue
                if name == "k":
                    value = torch.matmul(dscores.transpose(-1, -2), qg).mul_(scale)
                elif name == "v":
                    value = torch.matmul(probs.transpose(-1, -2), gg)
                else:
                    value = dscores.sum(2, keepdim=True)
                if group.all_requests:  # the only group: every request has c candidates
                    grads[name] = value
                    continue
                if name not in grads:  # requests without candidates keep a zero gradient
                    grads[name] = like.new_zeros(like.shape, dtype=work)
                grads[name].index_copy_(0, group.requests, value)
    for name, (wanted, like) in per_request.items():
        if wanted and name not in grads:  # no candidates at all
            grads[name] = like.new_zeros(like.shape, dtype=work)
    out = [grads.get(name) for name in ("q", "k", "v")]
    out = [None if t is None else t.to(dtype) for t in out]
    bias = grads.get("bias")
    return (*out, None, None, None, None if bias is None else bias.to(key_bias.dtype))


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
        check=_check,
        fake=_fake,
        flops=_flops,
        cpu=_cpu,
        triton="attention_triton:broadcast_attention",
        reference=_reference,
        portable=per_request_attention,
        backward=_backward,
        index_arg=3,
    )
)
