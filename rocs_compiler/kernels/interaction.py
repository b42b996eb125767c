"""Pairwise dots between candidate and request features: ``rocs::broadcast_interaction``.

Axis letters: R requests, N candidates, Fu request features, Fc candidate features, D feature.

``broadcast_interaction(request_stack [R, Fu, D], candidate_stack [N, Fc, D], idx [N])
-> [N, Fc, Fu]`` with ``out[n] = candidate_stack[n] @ request_stack[idx[n]].T``: the
request-candidate block of a DLRM/FM dot interaction, without the replicated
``[N, Fu, D]`` request stack. (The request-request block is request-only and computed
once per request by the caller.)

CPU path: candidates grouped by request (``request_groups.py``); a group of G requests with c
candidates each is one ``bmm([G, c * Fc, D], [G, D, Fu])``. CUDA path:
``interaction_triton.py``. FLOPs: ``2 N Fc Fu D``.

Backward (torch, any device), from ``out[n] = C[n] @ U[idx[n]].T`` with ``g = d out``:
``d C[n] = g[n] @ U[idx[n]]`` and ``d U[r] = sum over the candidates n of r of g[n].T @ C[n]``.
Grouped as the forward is, each is one bmm per group: ``[G, c * Fc, Fu] @ [G, Fu, D]`` and
``[G, Fu, c * Fc] @ [G, c * Fc, D]``, whose reduction over ``c * Fc`` is the per-request sum.
Only the inputs are saved (U at R rows); no request row is replicated and nothing of the
forward is recomputed.
"""

from __future__ import annotations

import torch

from rocs_compiler.kernels.common import check_same_dtype, check_shape
from rocs_compiler.kernels.request_groups import group_by_request
from rocs_compiler.kernels.rocs_op import RocsOp, define


def _check(request_stack, candidate_stack, candidate_to_request):
    op = "broadcast_interaction"
    check_shape(op, "request_stack", request_stack, (None, None, None))
    num_requests, fu, d = request_stack.shape
    check_shape(op, "candidate_stack", candidate_stack, (None, None, d))
    check_same_dtype(op, request_stack=request_stack, candidate_stack=candidate_stack)
    return candidate_stack.shape[0], num_requests


def _cpu(request_stack, candidate_stack, candidate_to_request) -> torch.Tensor:
    num_requests, fu, d = request_stack.shape
    num_candidates, fc, _ = candidate_stack.shape
    out = candidate_stack.new_empty((num_candidates, fc, fu))
    if out.numel() == 0:
        return out
    for group in group_by_request(candidate_to_request, num_requests):
        g, c = group.candidates.shape
        cg = group.gather_candidates(candidate_stack).reshape(g, c * fc, d)
        og = torch.bmm(cg, group.gather_requests(request_stack).transpose(1, 2))
        group.scatter_candidates(out, og.view(g, c, fc, fu))
    return out


def _backward(needs, grad, request_stack, candidate_stack, candidate_to_request):
    """The module docstring's formulas: ``(d request_stack, d candidate_stack, None)``."""
    num_requests, fu, d = request_stack.shape
    num_candidates, fc, _ = candidate_stack.shape
    want_request, want_candidate = needs[0], needs[1]
    grad_request = grad_candidate = None
    if want_candidate:
        grad_candidate = candidate_stack.new_empty((num_candidates, fc, d))
    if want_request:
        # Requests without candidates get no group: their gradient stays zero.
        grad_request = request_stack.new_zeros(request_stack.shape)
    if num_candidates == 0 or not (want_request or want_candidate):
        return grad_request, grad_candidate, None
    grad = grad.contiguous()
    for group in group_by_request(candidate_to_request, num_requests):
        g, c = group.candidates.shape
        gg = group.gather_candidates(grad).reshape(g, c * fc, fu)
        if want_candidate:
            dc = torch.bmm(gg, group.gather_requests(request_stack))
            group.scatter_candidates(grad_candidate, dc.view(g, c, fc, d))
        if want_request:
            cg = group.gather_candidates(candidate_stack).reshape(g, c * fc, d)
            du = torch.bmm(gg.transpose(1, 2), cg)
            if group.all_requests:  # the only group: every request has c candidates
                grad_request = du
            else:
                grad_request.index_copy_(0, group.requests, du)
    return grad_request, grad_candidate, None


def _fake(request_stack, candidate_stack, candidate_to_request):
    torch._check(request_stack.dim() == 3 and candidate_stack.dim() == 3)
    torch._check(candidate_stack.shape[2] == request_stack.shape[2])
    torch._check(candidate_to_request.shape[0] == candidate_stack.shape[0])
    return candidate_stack.new_empty(
        (candidate_stack.shape[0], candidate_stack.shape[1], request_stack.shape[1])
    )


def _flops(request_stack_shape, candidate_stack_shape, idx_shape, **kwargs):
    n, fc, d = candidate_stack_shape
    return 2 * n * fc * request_stack_shape[1] * d


def _reference(request_stack, candidate_stack, candidate_to_request):
    gathered = request_stack.index_select(0, candidate_to_request)
    return torch.bmm(candidate_stack, gathered.transpose(1, 2))


BROADCAST_INTERACTION = define(
    RocsOp(
        name="broadcast_interaction",
        check=_check,
        fake=_fake,
        flops=_flops,
        cpu=_cpu,
        triton="interaction_triton:broadcast_interaction",
        reference=_reference,
        backward=_backward,
        index_arg=2,
        dispatch=lambda request_stack, candidate_stack, index: candidate_stack,
    )
)
