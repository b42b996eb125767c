"""Triton kernel for ``rocs::broadcast_interaction`` (imports triton; loaded lazily).

Axis letters: R requests, N candidates, Fu request features, Fc candidate features, D feature.

``broadcast_interaction_kernel``: program (n, Fc block, Fu block) computes
``candidate_stack[n] [Fc, D] @ request_stack[idx[n]].T [D, Fu]`` in BLOCK_D chunks and
writes ``out[n]`` [Fc, Fu]. The request stack is read through ``idx`` inside the kernel.
Feature counts are small in practice (tens), so a program usually covers a whole
``[Fc, Fu]`` block and the grid is one program per candidate; ``tl.dot`` needs blocks of
at least 16, so smaller feature counts are padded by masking.

Tested in ``tests/kernels/triton_cases.py``. Limits: float16/bfloat16/float32;
contiguous inputs (the launcher makes them so).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rocs_compiler.kernels.common import check_contiguous, check_launch_device, check_launch_dtypes
from rocs_compiler.kernels.triton_utils import autotune_configs, input_precision, next_pow2_at_least


def _interaction_configs():
    cfg = triton.Config
    return autotune_configs(
        [
            cfg({"BLOCK_D": 32}, num_stages=3, num_warps=4),
            cfg({"BLOCK_D": 64}, num_stages=3, num_warps=4),
            cfg({"BLOCK_D": 128}, num_stages=2, num_warps=4),
            cfg({"BLOCK_D": 64}, num_stages=3, num_warps=2),
        ],
        interpret=cfg({"BLOCK_D": 64}),
    )


@triton.autotune(configs=_interaction_configs(), key=["FC", "FU", "D"])
@triton.jit
def broadcast_interaction_kernel(
    rs_ptr, cs_ptr, idx_ptr, out_ptr,
    FC, FU, D,
    stride_rsr, stride_rsf, stride_rsd,
    stride_csn, stride_csf, stride_csd,
    stride_outn, stride_outc, stride_outu,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_FC: tl.constexpr, BLOCK_FU: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    num_pid_fc = tl.cdiv(FC, BLOCK_FC)
    num_tiles = num_pid_fc * tl.cdiv(FU, BLOCK_FU)
    n = (pid // num_tiles).to(tl.int64)
    pid_fc = (pid % num_tiles) % num_pid_fc
    pid_fu = (pid % num_tiles) // num_pid_fc
    r = tl.load(idx_ptr + n)

    offs_fc = pid_fc * BLOCK_FC + tl.arange(0, BLOCK_FC)
    offs_fu = pid_fu * BLOCK_FU + tl.arange(0, BLOCK_FU)
    offs_d = tl.arange(0, BLOCK_D)
    mask_fc = offs_fc < FC
    mask_fu = offs_fu < FU

    cs_ptrs = cs_ptr + n * stride_csn + offs_fc[:, None] * stride_csf + offs_d[None, :] * stride_csd
    # Request rows read transposed, [BLOCK_D, BLOCK_FU].
    rs_ptrs = rs_ptr + r * stride_rsr + offs_d[:, None] * stride_rsd + offs_fu[None, :] * stride_rsf
    acc = tl.zeros((BLOCK_FC, BLOCK_FU), dtype=tl.float32)
    for start in range(0, D, BLOCK_D):
        mask_d = (start + offs_d) < D
        cs_tile = tl.load(cs_ptrs, mask=mask_fc[:, None] & mask_d[None, :], other=0.0)
        rs_tile = tl.load(rs_ptrs, mask=mask_d[:, None] & mask_fu[None, :], other=0.0)
        acc = tl.dot(cs_tile, rs_tile, acc, input_precision=INPUT_PRECISION)
        cs_ptrs += BLOCK_D * stride_csd
        rs_ptrs += BLOCK_D * stride_rsd

    out_ptrs = (
        out_ptr + n * stride_outn + offs_fc[:, None] * stride_outc + offs_fu[None, :] * stride_outu
    )
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_fc[:, None] & mask_fu[None, :])


def broadcast_interaction(
    request_stack: torch.Tensor, candidate_stack: torch.Tensor, idx: torch.Tensor
) -> torch.Tensor:
    op = "broadcast_interaction"
    rs, cs, idx = request_stack.contiguous(), candidate_stack.contiguous(), idx.contiguous()
    _, fu, d = rs.shape
    num_candidates, fc, _ = cs.shape
    check_launch_device(rs, cs, idx)
    check_contiguous(op, request_stack=rs, candidate_stack=cs)
    check_launch_dtypes(op, request_stack=rs, candidate_stack=cs)

    out = torch.empty((num_candidates, fc, fu), dtype=cs.dtype, device=cs.device)
    if out.numel() == 0:
        return out
    block_fc = min(next_pow2_at_least(fc), 64)
    block_fu = min(next_pow2_at_least(fu), 64)
    grid = (num_candidates * triton.cdiv(fc, block_fc) * triton.cdiv(fu, block_fu),)
    broadcast_interaction_kernel[grid](
        rs, cs, idx, out,
        fc, fu, d,
        *rs.stride(), *cs.stride(), *out.stride(),
        INPUT_PRECISION=input_precision(cs.dtype),
        BLOCK_FC=block_fc, BLOCK_FU=block_fu,
    )  # fmt: skip
    return out
