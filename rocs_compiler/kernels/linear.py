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
instead of N tiny ones, and one with column vectors (``D = 1``) is the broadcast linear of
``ec`` viewed as ``[N, Kc]``. CUDA path: Triton kernels in
``linear_triton.py``. FLOPs count the candidate GEMM only (``2 N M K`` and ``2 N M Kc D``);
the broadcast add is not a per-candidate matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rocs_compiler.kernels.common import check_same_dtype, check_shape
from rocs_compiler.kernels.rocs_op import RocsOp, define

# Largest M * Kc for which the CPU path of broadcast_linear_compression folds the candidates
# into one GEMM's columns (a copy of ``ec``) instead of a batched GEMM. Measured on x86 with
# D = 16..64: folding is 2-6x faster at M * Kc <= 12 and slower from M * Kc = 32 on.
FOLD_CANDIDATES_MAX_MK = 16


# -- broadcast_linear ---------------------------------------------------------------------------


def _check_linear(c, weight, bias, request_term, candidate_to_request):
    op = "broadcast_linear"
    check_shape(op, "c", c, (None, None))
    num_candidates, k = c.shape
    m = weight.shape[0]
    check_shape(op, "weight", weight, (m, k))
    check_shape(op, "request_term", request_term, (None, m))
    tensors = dict(c=c, weight=weight, request_term=request_term)
    if bias is not None:
        check_shape(op, "bias", bias, (m,))
        tensors["bias"] = bias
    check_same_dtype(op, **tensors)
    return num_candidates, request_term.shape[0]


def _linear_cpu(c, weight, bias, request_term, candidate_to_request) -> torch.Tensor:
    # Fold the bias into the R-row request term (R x M adds instead of N x M), gather it into
    # the output buffer, then let the GEMM accumulate into that buffer.
    request_rows = request_term if bias is None else request_term + bias
    if request_rows.shape[0] == 1:
        # One request: every index is 0, the request row is a bias for all candidates.
        return torch.addmm(request_rows[0], c, weight.t())
    out = request_rows.index_select(0, candidate_to_request)
    return out.addmm_(c, weight.t())


def _linear_fake(c, weight, bias, request_term, candidate_to_request):
    torch._check(c.dim() == 2 and weight.dim() == 2 and request_term.dim() == 2)
    torch._check(weight.shape[1] == c.shape[1])
    torch._check(request_term.shape[1] == weight.shape[0])
    torch._check(candidate_to_request.shape[0] == c.shape[0])
    return c.new_empty((c.shape[0], weight.shape[0]))


def _linear_flops(c_shape, weight_shape, bias_shape, request_term_shape, idx_shape, **kwargs):
    n, k = c_shape
    return 2 * n * weight_shape[0] * k


def _linear_reference(c, weight, bias, request_term, candidate_to_request):
    return F.linear(c, weight, bias) + request_term.index_select(0, candidate_to_request)


def _linear_backward(needs, grad, c, weight, bias, request_term, candidate_to_request):
    """``d c = g @ W``, ``d W = g.T @ c``, ``d b = sum_n g[n]``, ``d request_term[r] = sum of
    g[n] over the candidates n of request r`` (an ``index_add``: the backward of the in-kernel
    broadcast, at R rows)."""
    grad_c = grad @ weight if needs[0] else None
    grad_weight = grad.t() @ c if needs[1] else None
    grad_bias = grad.sum(0) if bias is not None and needs[2] else None
    grad_request = _request_sum(grad, request_term, candidate_to_request) if needs[3] else None
    return grad_c, grad_weight, grad_bias, grad_request, None


def _request_sum(grad, request_term, candidate_to_request):
    """Per-request sums of candidate rows: the backward of ``request_term[idx]``."""
    return grad.new_zeros(request_term.shape).index_add_(0, candidate_to_request, grad)


BROADCAST_LINEAR = define(
    RocsOp(
        name="broadcast_linear",
        check=_check_linear,
        fake=_linear_fake,
        flops=_linear_flops,
        cpu=_linear_cpu,
        triton="linear_triton:broadcast_linear",
        reference=_linear_reference,
        index_arg=4,
        backward=_linear_backward,
    )
)


# -- broadcast_linear_compression ---------------------------------------------------------------


def _check_compression(ec, weight, request_term, candidate_to_request):
    op = "broadcast_linear_compression"
    check_shape(op, "ec", ec, (None, None, None))
    num_candidates, kc, d = ec.shape
    m = weight.shape[0]
    check_shape(op, "weight", weight, (m, kc))
    check_shape(op, "request_term", request_term, (None, m, d))
    check_same_dtype(op, ec=ec, weight=weight, request_term=request_term)
    return num_candidates, request_term.shape[0]


def _compression_cpu(ec, weight, request_term, candidate_to_request) -> torch.Tensor:
    num_candidates, kc, d = ec.shape
    m = weight.shape[0]
    if d == 1:
        # Column vectors (DCN-mixture style): out[n] = W @ ec[n] is a row of one [N, Kc] @ W.T
        # GEMM, the broadcast linear; N tiny batched products would be 5-20x slower.
        rows = _linear_cpu(
            ec.reshape(num_candidates, kc), weight, None,
            request_term.reshape(-1, m), candidate_to_request,
        )  # fmt: skip
        return rows.view(num_candidates, m, 1)
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


def _compression_fake(ec, weight, request_term, candidate_to_request):
    torch._check(ec.dim() == 3 and weight.dim() == 2 and request_term.dim() == 3)
    torch._check(weight.shape[1] == ec.shape[1])
    torch._check(request_term.shape[1] == weight.shape[0])
    torch._check(request_term.shape[2] == ec.shape[2])
    torch._check(candidate_to_request.shape[0] == ec.shape[0])
    return ec.new_empty((ec.shape[0], weight.shape[0], ec.shape[2]))


def _compression_flops(ec_shape, weight_shape, request_term_shape, idx_shape, **kwargs):
    n, kc, d = ec_shape
    return 2 * n * weight_shape[0] * kc * d


def _compression_reference(ec, weight, request_term, candidate_to_request):
    return torch.matmul(weight, ec) + request_term.index_select(0, candidate_to_request)


def _compression_backward(needs, grad, ec, weight, request_term, candidate_to_request):
    """``d ec[n] = W.T @ g[n]``, ``d W = sum_n g[n] @ ec[n].T`` (one GEMM over the candidates'
    columns), ``d request_term``: per-request sums of ``g``."""
    num_candidates, kc, d = ec.shape
    m = weight.shape[0]
    grad_ec = torch.matmul(weight.t(), grad) if needs[0] else None
    grad_weight = None
    if needs[1]:
        g_columns = grad.permute(1, 0, 2).reshape(m, num_candidates * d)
        ec_columns = ec.permute(1, 0, 2).reshape(kc, num_candidates * d)
        grad_weight = g_columns @ ec_columns.t()
    grad_request = _request_sum(grad, request_term, candidate_to_request) if needs[2] else None
    return grad_ec, grad_weight, grad_request, None


BROADCAST_LINEAR_COMPRESSION = define(
    RocsOp(
        name="broadcast_linear_compression",
        check=_check_compression,
        fake=_compression_fake,
        flops=_compression_flops,
        cpu=_compression_cpu,
        triton="linear_triton:broadcast_linear_compression",
        reference=_compression_reference,
        index_arg=3,
        backward=_compression_backward,
    )
)
