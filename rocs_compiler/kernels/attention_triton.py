"""Triton kernel for ``rocs::broadcast_attention`` (imports triton; loaded lazily).

Axis letters: R requests, N candidates, H heads, Lq query length, L key length, D feature.

``broadcast_attention_kernel``: for candidate n, head h and a block of BLOCK_Q queries,
online-softmax attention (FlashAttention-style, exp2 with a folded ``scale * log2(e)``)
over ``k[idx[n], h]`` / ``v[idx[n], h]`` in blocks of BLOCK_L keys, with an optional
per-request key mask [R, L] (nonzero = attend).

Grid: 1-D over (candidate in request order, head, query block), fastest last. The launcher
passes ``order = argsort(idx)`` and program p works on candidate ``order[p // ...]``, so
consecutive programs read the same request's K/V while it is hot in L2; reads and writes
go through ``order``, so nothing is permuted or scattered in memory.

Fully masked rows: the running max stays -inf, every probability is 0 and the row sum is
0; the kernel writes zeros there, as ``F.scaled_dot_product_attention`` does.

Tested in ``tests/kernels/triton_cases.py``. Limits: float16/bfloat16/float32; D up to 256
(one D block); contiguous q/k/v (the launcher makes them so).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from rocs_compiler.kernels.common import check_contiguous, check_launch_device, check_launch_dtypes
from rocs_compiler.kernels.attention import default_scale
from rocs_compiler.kernels.triton_utils import autotune_configs, input_precision, next_pow2_at_least


def _prune_configs(configs, named_args, **kwargs):
    # Query blocks larger than the (padded) query length only add masked rows.
    block_q_max = next_pow2_at_least(named_args["LQ"])
    kept = [cfg for cfg in configs if cfg.kwargs["BLOCK_Q"] <= block_q_max]
    return kept or configs[:1]


def _attention_configs():
    def cfg(block_q, block_l, stages, warps):
        meta = {"BLOCK_Q": block_q, "BLOCK_L": block_l}
        return triton.Config(meta, num_stages=stages, num_warps=warps)

    return autotune_configs(
        [
            cfg(16, 64, stages=3, warps=4),
            cfg(32, 64, stages=3, warps=4),
            cfg(64, 64, stages=3, warps=4),
            cfg(64, 128, stages=3, warps=8),
            cfg(128, 64, stages=3, warps=8),
            cfg(128, 128, stages=2, warps=8),
        ],
        interpret=cfg(16, 64, stages=1, warps=4),
    )


@triton.autotune(
    configs=_attention_configs(),
    key=["LQ", "L", "BLOCK_D"],
    prune_configs_by={"early_config_prune": _prune_configs},
)
@triton.jit
def broadcast_attention_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, bias_ptr, idx_ptr, order_ptr, out_ptr,
    H, LQ, L, D, qk_scale,
    stride_qn, stride_qh, stride_ql, stride_qd,
    stride_kr, stride_kh, stride_kl, stride_kd,
    stride_vr, stride_vh, stride_vl, stride_vd,
    stride_maskr, stride_maskl,
    stride_biasr, stride_biash, stride_biasl,
    stride_outn, stride_outh, stride_outl, stride_outd,
    HAS_MASK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    num_q_blocks = tl.cdiv(LQ, BLOCK_Q)
    pid_q = pid % num_q_blocks
    pid_nh = pid // num_q_blocks
    h = pid_nh % H
    n = tl.load(order_ptr + pid_nh // H)
    r = tl.load(idx_ptr + n)

    offs_q = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs_l = tl.arange(0, BLOCK_L)
    offs_d = tl.arange(0, BLOCK_D)
    mask_q = offs_q < LQ
    mask_d = offs_d < D

    q_base = q_ptr + n * stride_qn + h * stride_qh
    k_base = k_ptr + r * stride_kr + h * stride_kh
    v_base = v_ptr + r * stride_vr + h * stride_vh
    q_ptrs = q_base + offs_q[:, None] * stride_ql + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=mask_q[:, None] & mask_d[None, :], other=0.0)
    # K is read transposed, [BLOCK_D, BLOCK_L], so q @ k_tile is the score block.
    k_ptrs = k_base + offs_d[:, None] * stride_kd + offs_l[None, :] * stride_kl
    v_ptrs = v_base + offs_l[:, None] * stride_vl + offs_d[None, :] * stride_vd
    mask_ptrs = mask_ptr + r * stride_maskr + offs_l * stride_maskl
    bias_ptrs = bias_ptr + r * stride_biasr + h * stride_biash + offs_l * stride_biasl

    m_i = tl.full((BLOCK_Q,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_Q,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_Q, BLOCK_D), dtype=tl.float32)
    for start in range(0, L, BLOCK_L):
        valid = (start + offs_l) < L
        k_tile = tl.load(k_ptrs, mask=mask_d[:, None] & valid[None, :], other=0.0)
        v_tile = tl.load(v_ptrs, mask=valid[:, None] & mask_d[None, :], other=0.0)
        if HAS_MASK:
            valid &= tl.load(mask_ptrs, mask=valid, other=0) != 0
        qk = tl.dot(q, k_tile, input_precision=INPUT_PRECISION) * qk_scale
        if HAS_BIAS:
            bias = tl.load(bias_ptrs, mask=valid, other=0.0).to(tl.float32)
            qk += bias[None, :] * 1.4426950408889634  # log2(e): the scores are base 2
        qk = tl.where(valid[None, :], qk, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # A row with no valid key so far keeps m = -inf; subtract 0 instead so that
        # exp2(-inf - (-inf)) never produces NaN and the row's probabilities stay 0.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v_tile.dtype), v_tile, acc, input_precision=INPUT_PRECISION)
        m_i = m_new

        k_ptrs += BLOCK_L * stride_kl
        v_ptrs += BLOCK_L * stride_vl
        mask_ptrs += BLOCK_L * stride_maskl
        bias_ptrs += BLOCK_L * stride_biasl

    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    out_base = out_ptr + n * stride_outn + h * stride_outh
    out_ptrs = out_base + offs_q[:, None] * stride_outl + offs_d[None, :] * stride_outd
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_q[:, None] & mask_d[None, :])


def broadcast_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    idx: torch.Tensor,
    key_mask: torch.Tensor | None = None,
    scale: float | None = None,
    key_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    op = "broadcast_attention"
    q, k, v, idx = q.contiguous(), k.contiguous(), v.contiguous(), idx.contiguous()
    num_candidates, h, lq, d = q.shape
    key_len = k.shape[2]
    # Masks travel as uint8 (same storage as bool), which every Triton backend loads.
    mask = key_mask.contiguous().view(torch.uint8) if key_mask is not None else None
    extra = [t for t in (mask, key_bias) if t is not None]
    check_launch_device(q, k, v, idx, *extra)
    check_contiguous(op, q=q, k=k, v=v)
    check_launch_dtypes(op, q=q, k=k, v=v)
    if d > 256:
        raise ValueError(f"rocs::{op}: head dim {d} > 256 is not supported by the kernel")

    out = torch.empty_like(q)
    if out.numel() == 0:
        return out
    # Candidates in request order: consecutive programs share K/V.
    order = torch.argsort(idx, stable=True)
    block_d = next_pow2_at_least(d)

    def grid(meta):
        return (num_candidates * h * triton.cdiv(lq, meta["BLOCK_Q"]),)

    stride_mask = mask.stride() if mask is not None else (0, 0)
    stride_bias = (0, 0, 0)
    if key_bias is not None:
        stride_bias = (key_bias.stride(0), key_bias.stride(1), key_bias.stride(3))
    broadcast_attention_kernel[grid](
        q, k, v, mask if mask is not None else idx, key_bias if key_bias is not None else q,
        idx, order, out,
        h, lq, key_len, d, default_scale(d, scale) * math.log2(math.e),
        *q.stride(), *k.stride(), *v.stride(), *stride_mask, *stride_bias, *out.stride(),
        HAS_MASK=mask is not None,
        HAS_BIAS=key_bias is not None,
        INPUT_PRECISION=input_precision(q.dtype),
        BLOCK_D=block_d,
    )  # fmt: skip
    return out
