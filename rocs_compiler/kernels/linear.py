"""GEMMs with a broadcast request term in the epilogue: ``rocs::broadcast_linear`` and
``rocs::broadcast_linear_compression``.

Axis letters: R requests, N candidates, K reduction, M output, D feature.

``broadcast_linear(c [N, K], weight [M, K], bias [M]?, request_term [R, M], idx [N]) -> [N, M]``
    ``out[n] = weight @ c[n] + bias + request_term[idx[n]]``. This is the deferred form of
    ``linear(cat(u[idx], c))``: the request half ``request_term = u @ W_u.T`` is computed once
    per request and added in the GEMM epilogue instead of being replicated to N rows.

``broadcast_linear_compression(ec [N, Kc, D], weight [M, Kc], request_term [R, M, D], idx [N])
-> [N, M, D]``
    ``out[n] = weight @ ec[n] + request_term[idx[n]]``: DHEN/Wukong linear compression over
    a concatenated embedding axis, with the request embeddings already compressed once per
    request (``request_term = W_u @ E_u``).

CPU path: the output buffer is initialised with the gathered request term (plus bias), and
the GEMM accumulates into it in place (``addmm_`` / ``baddbmm_`` with beta = 1), so no
``[N, M]`` temporary exists besides the output; with one request (R = 1, every index 0) the
request row is the GEMM's broadcast bias. A compression with a tiny weight
(``M * Kc <= FOLD_CANDIDATES_MAX_MK``) runs as one GEMM over a ``[Kc, N * D]`` copy of ``ec``
instead of N tiny ones. CUDA path: Triton kernels in
``linear_triton.py``. FLOPs count the candidate GEMM only (``2 N M K`` and ``2 N M Kc D``);
the broadcast add is not a per-candidate matmul.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import register_flop_formula

from rocs_compiler.kernels.common import (
    check_candidate_index,
    check_same_dtype,
    check_shape,
    use_triton,
)


# Largest M * Kc for which the CPU path of broadcast_linear_compression folds the candidates
# into one GEMM's columns (a copy of ``ec``) instead of a batched GEMM. Measured on x86 with
# D = 16..64: folding is 2-6x faster at M * Kc <= 12 and slower from M * Kc = 32 on.
FOLD_CANDIDATES_MAX_MK = 16


@torch.library.custom_op("rocs::broadcast_linear", mutates_args=())
def broadcast_linear(
    c: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    request_term: torch.Tensor,
    candidate_to_request: torch.Tensor,
) -> torch.Tensor:
    """``c @ weight.T + bias + request_term[candidate_to_request]`` without the [N, M] gather."""
    check_shape("broadcast_linear", "c", c, (None, None))
    num_candidates, k = c.shape
    m = weight.shape[0]
    check_shape("broadcast_linear", "weight", weight, (m, k))
    check_shape("broadcast_linear", "request_term", request_term, (None, m))
    if bias is not None:
        check_shape("broadcast_linear", "bias", bias, (m,))
        check_same_dtype(
            "broadcast_linear", c=c, weight=weight, bias=bias, request_term=request_term
        )
    else:
        check_same_dtype("broadcast_linear", c=c, weight=weight, request_term=request_term)
    check_candidate_index(
        candidate_to_request, num_candidates, request_term.shape[0], "broadcast_linear"
    )
    return run_broadcast_linear(c, weight, bias, request_term, candidate_to_request)


def run_broadcast_linear(c, weight, bias, request_term, candidate_to_request) -> torch.Tensor:
    """The op's device dispatch without its argument checks (callers checked them)."""
    if use_triton(c):
        from rocs_compiler.kernels import linear_triton

        return linear_triton.broadcast_linear(c, weight, bias, request_term, candidate_to_request)

    # Fold the bias into the R-row request term (R x M adds instead of N x M), gather it into
    # the output buffer, then let the GEMM accumulate into that buffer.
    request_rows = request_term if bias is None else request_term + bias
    if request_rows.shape[0] == 1:
        # One request: every index is 0, the request row is a bias for all candidates.
        return torch.addmm(request_rows[0], c, weight.t())
    out = request_rows.index_select(0, candidate_to_request)
    return out.addmm_(c, weight.t())


@broadcast_linear.register_fake
def _(c, weight, bias, request_term, candidate_to_request):
    torch._check(c.dim() == 2 and weight.dim() == 2 and request_term.dim() == 2)
    torch._check(weight.shape[1] == c.shape[1])
    torch._check(request_term.shape[1] == weight.shape[0])
    torch._check(candidate_to_request.shape[0] == c.shape[0])
    return c.new_empty((c.shape[0], weight.shape[0]))


@register_flop_formula(torch.ops.rocs.broadcast_linear)
def _(c_shape, weight_shape, bias_shape, request_term_shape, idx_shape, out_shape=None, **kwargs):
    n, k = c_shape
    return 2 * n * weight_shape[0] * k


@torch.library.custom_op("rocs::broadcast_linear_compression", mutates_args=())
def broadcast_linear_compression(
    ec: torch.Tensor,
    weight: torch.Tensor,
    request_term: torch.Tensor,
    candidate_to_request: torch.Tensor,
) -> torch.Tensor:
    """``weight @ ec[n] + request_term[candidate_to_request[n]]`` for every candidate n."""
    op = "broadcast_linear_compression"
    check_shape(op, "ec", ec, (None, None, None))
    num_candidates, kc, d = ec.shape
    m = weight.shape[0]
    check_shape(op, "weight", weight, (m, kc))
    check_shape(op, "request_term", request_term, (None, m, d))
    check_same_dtype(op, ec=ec, weight=weight, request_term=request_term)
    check_candidate_index(candidate_to_request, num_candidates, request_term.shape[0], op)
    return run_broadcast_linear_compression(ec, weight, request_term, candidate_to_request)


def run_broadcast_linear_compression(ec, weight, request_term, candidate_to_request) -> torch.Tensor:
    """The op's device dispatch without its argument checks (callers checked them)."""
    if use_triton(ec):
        from rocs_compiler.kernels import linear_triton

        return linear_triton.broadcast_linear_compression(
            ec, weight, request_term, candidate_to_request
        )

    num_candidates, kc, d = ec.shape
    m = weight.shape[0]
    if m * kc <= FOLD_CANDIDATES_MAX_MK:
        # A tiny [M, Kc] weight: one GEMM over all candidates' columns beats N tiny GEMMs.
        columns = ec.permute(1, 0, 2).reshape(kc, num_candidates * d)
        product = (weight @ columns).view(m, num_candidates, d).permute(1, 0, 2)
        if request_term.shape[0] == 1:  # one request: every index is 0
            out = ec.new_empty((num_candidates, m, d))  # contiguous, as the fake kernel says
            return torch.add(product, request_term, out=out)
        return request_term.index_select(0, candidate_to_request).add_(product)
    out = request_term.index_select(0, candidate_to_request)
    # The expanded weight has batch stride 0: bmm reads the one [M, Kc] matrix for every n.
    return out.baddbmm_(weight.expand(num_candidates, m, kc), ec)


@broadcast_linear_compression.register_fake
def _(ec, weight, request_term, candidate_to_request):
    torch._check(ec.dim() == 3 and weight.dim() == 2 and request_term.dim() == 3)
    torch._check(weight.shape[1] == ec.shape[1])
    torch._check(request_term.shape[1] == weight.shape[0])
    torch._check(request_term.shape[2] == ec.shape[2])
    torch._check(candidate_to_request.shape[0] == ec.shape[0])
    return ec.new_empty((ec.shape[0], weight.shape[0], ec.shape[2]))


@register_flop_formula(torch.ops.rocs.broadcast_linear_compression)
def _(ec_shape, weight_shape, request_term_shape, idx_shape, out_shape=None, **kwargs):
    n, kc, d = ec_shape
    return 2 * n * weight_shape[0] * kc * d
