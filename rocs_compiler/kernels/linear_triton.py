"""Triton kernels for the broadcast-epilogue GEMMs (imports triton; loaded lazily by ``linear.py``).

Axis letters: R requests, N candidates, K reduction, M output, D feature.

``broadcast_linear_kernel``: ``out [N, M] = c [N, K] @ weight[M, K].T (+ bias [M])
+ request_term[idx] ([R, M] rows looked up per output row in the epilogue)``. Grouped
tile ordering as in Triton's matmul tutorial, so GROUP_N row blocks reuse weight tiles
from L2.

``broadcast_linear_compression_kernel``: ``out [N, M, D] = weight [M, Kc] @ ec[n] [Kc, D]
+ request_term[idx[n]] ([R, M, D])``, a batched GEMM over candidates that shares one
weight. The grid is 1-D (candidate-major, then output tiles), so the tiles of one
candidate run back to back and its ``ec[n]`` stays in cache.

Accumulation is float32; the dot precision follows torch's TF32 setting for float32
inputs. Tested in ``tests/kernels/triton_cases.py`` (interpreter on CPU, real GPU via
``benchmarks/gpu_check.sh``). Limits: float16/bfloat16/float32 only; every tensor
contiguous (the op makes them so); row offsets are computed in int64.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from rocs_compiler.kernels.common import check_contiguous, check_launch_device, check_launch_dtypes
from rocs_compiler.kernels.triton_utils import autotune_configs, input_precision


def _linear_configs():
    def cfg(block_n, block_m, block_k, stages, warps):
        meta = {"BLOCK_N": block_n, "BLOCK_M": block_m, "BLOCK_K": block_k, "GROUP_N": 8}
        return triton.Config(meta, num_stages=stages, num_warps=warps)

    return autotune_configs(
        [
            cfg(128, 256, 64, stages=3, warps=8),
            cfg(64, 256, 32, stages=4, warps=4),
            cfg(128, 128, 32, stages=4, warps=4),
            cfg(128, 64, 32, stages=4, warps=4),
            cfg(64, 128, 32, stages=4, warps=4),
            cfg(128, 32, 32, stages=4, warps=4),
            cfg(64, 32, 32, stages=5, warps=2),
            cfg(32, 64, 32, stages=5, warps=2),
        ],
        interpret=cfg(64, 64, 64, stages=1, warps=4),
    )


# N changes with every batch; tuning per power-of-two bucket of N instead of per N keeps the
# autotuner from re-benchmarking on each new batch size.
@triton.autotune(configs=_linear_configs(), key=["N_BUCKET", "M", "K"])
@triton.jit
def broadcast_linear_kernel(
    c_ptr, weight_ptr, bias_ptr, rt_ptr, idx_ptr, out_ptr,
    N, M, K, N_BUCKET,
    stride_cn, stride_ck,
    stride_wm, stride_wk,
    stride_rtr, stride_rtm,
    stride_outn, stride_outm,
    HAS_BIAS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_N: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_in_group = GROUP_N * num_pid_m
    first_pid_n = (pid // num_pid_in_group) * GROUP_N
    group_size_n = min(num_pid_n - first_pid_n, GROUP_N)
    pid_n = first_pid_n + (pid % num_pid_in_group) % group_size_n
    pid_m = (pid % num_pid_in_group) // group_size_n

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    mask_m = offs_m < M

    c_ptrs = c_ptr + offs_n[:, None].to(tl.int64) * stride_cn + offs_k[None, :] * stride_ck
    w_ptrs = weight_ptr + offs_k[:, None] * stride_wk + offs_m[None, :] * stride_wm
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        c_tile = tl.load(c_ptrs, mask=mask_n[:, None] & (offs_k[None, :] < k_left), other=0.0)
        w_tile = tl.load(w_ptrs, mask=(offs_k[:, None] < k_left) & mask_m[None, :], other=0.0)
        acc = tl.dot(c_tile, w_tile, acc, input_precision=INPUT_PRECISION)
        c_ptrs += BLOCK_K * stride_ck
        w_ptrs += BLOCK_K * stride_wk

    # Epilogue: each output row adds the request-term row of its request.
    mask_out = mask_n[:, None] & mask_m[None, :]
    offs_r = tl.load(idx_ptr + offs_n, mask=mask_n, other=0)
    rt_ptrs = rt_ptr + offs_r[:, None] * stride_rtr + offs_m[None, :] * stride_rtm
    acc += tl.load(rt_ptrs, mask=mask_out, other=0.0).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_m, mask=mask_m, other=0.0).to(tl.float32)
        acc += bias[None, :]
    out_ptrs = out_ptr + offs_n[:, None].to(tl.int64) * stride_outn + offs_m[None, :] * stride_outm
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_out)


def pad_k(weight: torch.Tensor, c: torch.Tensor, multiple: int = 8):
    """Zero-pad the reduction axis of ``weight`` [M, K] and ``c`` [N, K] to a multiple.

    16-bit rows whose length is not a multiple of 8 elements are not 16-byte aligned, which
    rules out vectorized loads in the GEMM. Zero columns add exact zeros to every dot
    product, so the result is unchanged.
    """
    pad = -weight.shape[1] % multiple
    if pad == 0:
        return weight, c
    return F.pad(weight, (0, pad)), F.pad(c, (0, pad))


def broadcast_linear(
    c: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    request_term: torch.Tensor,
    idx: torch.Tensor,
) -> torch.Tensor:
    op = "broadcast_linear"
    c, weight, request_term = c.contiguous(), weight.contiguous(), request_term.contiguous()
    bias = bias.contiguous() if bias is not None else None
    idx = idx.contiguous()
    num_candidates, k = c.shape
    m = weight.shape[0]
    check_launch_device(c, weight, request_term, idx, *([bias] if bias is not None else []))
    check_contiguous(op, c=c, weight=weight, request_term=request_term)
    extra = {"bias": bias} if bias is not None else {}
    check_launch_dtypes(op, c=c, weight=weight, request_term=request_term, **extra)
    # ROCS_LINEAR_PAD_K=0 turns padding off (it costs two small copies per call; whether
    # aligned loads win that back depends on the shape, see benchmarks/kernels.py).
    if c.is_cuda and c.dtype in (torch.float16, torch.bfloat16):
        if os.environ.get("ROCS_LINEAR_PAD_K", "1") != "0":
            weight, c = pad_k(weight, c)
            k = c.shape[1]

    out = torch.empty((num_candidates, m), dtype=c.dtype, device=c.device)
    if num_candidates == 0 or m == 0:
        return out

    def grid(meta):
        return (triton.cdiv(num_candidates, meta["BLOCK_N"]) * triton.cdiv(m, meta["BLOCK_M"]),)

    broadcast_linear_kernel[grid](
        c, weight, bias if bias is not None else out, request_term, idx, out,
        num_candidates, m, k, triton.next_power_of_2(num_candidates),
        c.stride(0), c.stride(1),
        weight.stride(0), weight.stride(1),
        request_term.stride(0), request_term.stride(1),
        out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None,
        INPUT_PRECISION=input_precision(c.dtype),
    )  # fmt: skip
    return out


def _compression_configs():
    def cfg(block_m, block_d, block_k, stages, warps):
        meta = {"BLOCK_M": block_m, "BLOCK_D": block_d, "BLOCK_K": block_k}
        return triton.Config(meta, num_stages=stages, num_warps=warps)

    return autotune_configs(
        [
            cfg(128, 128, 32, stages=4, warps=8),
            cfg(128, 64, 32, stages=4, warps=4),
            cfg(64, 128, 32, stages=4, warps=4),
            cfg(64, 64, 64, stages=3, warps=4),
            cfg(128, 256, 32, stages=3, warps=8),
            cfg(32, 64, 32, stages=5, warps=2),
        ],
        interpret=cfg(64, 64, 64, stages=1, warps=4),
    )


@triton.autotune(configs=_compression_configs(), key=["M", "D", "K"])
@triton.jit
def broadcast_linear_compression_kernel(
    ec_ptr, weight_ptr, rt_ptr, idx_ptr, out_ptr,
    M, D, K,
    stride_ecn, stride_eck, stride_ecd,
    stride_wm, stride_wk,
    stride_rtr, stride_rtm, stride_rtd,
    stride_outn, stride_outm, stride_outd,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_tiles = num_pid_m * tl.cdiv(D, BLOCK_D)
    n = (pid // num_tiles).to(tl.int64)
    pid_m = (pid % num_tiles) % num_pid_m
    pid_d = (pid % num_tiles) // num_pid_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_d = offs_d < D

    w_ptrs = weight_ptr + offs_m[:, None] * stride_wm + offs_k[None, :] * stride_wk
    ec_ptrs = ec_ptr + n * stride_ecn + offs_k[:, None] * stride_eck + offs_d[None, :] * stride_ecd
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        w_tile = tl.load(w_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
        ec_tile = tl.load(ec_ptrs, mask=(offs_k[:, None] < k_left) & mask_d[None, :], other=0.0)
        acc = tl.dot(w_tile, ec_tile, acc, input_precision=INPUT_PRECISION)
        w_ptrs += BLOCK_K * stride_wk
        ec_ptrs += BLOCK_K * stride_eck

    # Epilogue: add the request's compressed embeddings.
    mask_out = mask_m[:, None] & mask_d[None, :]
    r = tl.load(idx_ptr + n)
    rt_ptrs = rt_ptr + r * stride_rtr + offs_m[:, None] * stride_rtm + offs_d[None, :] * stride_rtd
    acc += tl.load(rt_ptrs, mask=mask_out, other=0.0).to(tl.float32)
    out_ptrs = (
        out_ptr + n * stride_outn + offs_m[:, None] * stride_outm + offs_d[None, :] * stride_outd
    )
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_out)


def broadcast_linear_compression(
    ec: torch.Tensor, weight: torch.Tensor, request_term: torch.Tensor, idx: torch.Tensor
) -> torch.Tensor:
    op = "broadcast_linear_compression"
    ec, weight = ec.contiguous(), weight.contiguous()
    request_term, idx = request_term.contiguous(), idx.contiguous()
    num_candidates, kc, d = ec.shape
    m = weight.shape[0]
    check_launch_device(ec, weight, request_term, idx)
    check_contiguous(op, ec=ec, weight=weight, request_term=request_term)
    check_launch_dtypes(op, ec=ec, weight=weight, request_term=request_term)

    out = torch.empty((num_candidates, m, d), dtype=ec.dtype, device=ec.device)
    if out.numel() == 0:
        return out

    def grid(meta):
        tiles = triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(d, meta["BLOCK_D"])
        return (num_candidates * tiles,)

    broadcast_linear_compression_kernel[grid](
        ec, weight, request_term, idx, out,
        m, d, kc,
        ec.stride(0), ec.stride(1), ec.stride(2),
        weight.stride(0), weight.stride(1),
        request_term.stride(0), request_term.stride(1), request_term.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        INPUT_PRECISION=input_precision(ec.dtype),
    )  # fmt: skip
    return out
