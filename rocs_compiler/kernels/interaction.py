"""Pairwise dots between candidate and request features: ``rocs::broadcast_interaction``.

Axis letters: R requests, N candidates, Fu request features, Fc candidate features, D feature.

``broadcast_interaction(request_stack [R, Fu, D], candidate_stack [N, Fc, D], idx [N])
-> [N, Fc, Fu]`` with ``out[n] = candidate_stack[n] @ request_stack[idx[n]].T``: the
request-candidate block of a DLRM/FM dot interaction, without the replicated
``[N, Fu, D]`` request stack. (The request-request block is request-only and computed
once per request by the caller.)

CPU path: candidates grouped by request (``grouping.py``); a group of G requests with c
candidates each is one ``bmm([G, c * Fc, D], [G, D, Fu])``. CUDA path:
``interaction_triton.py``. FLOPs: ``2 N Fc Fu D``.
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
from rocs_compiler.kernels.request_groups import group_by_request


@torch.library.custom_op("rocs::broadcast_interaction", mutates_args=())
def broadcast_interaction(
    request_stack: torch.Tensor,
    candidate_stack: torch.Tensor,
    candidate_to_request: torch.Tensor,
) -> torch.Tensor:
    """``candidate_stack[n] @ request_stack[candidate_to_request[n]].T`` for every candidate n."""
    op = "broadcast_interaction"
    check_shape(op, "request_stack", request_stack, (None, None, None))
    num_requests, fu, d = request_stack.shape
    check_shape(op, "candidate_stack", candidate_stack, (None, None, d))
    num_candidates, fc, _ = candidate_stack.shape
    check_same_dtype(op, request_stack=request_stack, candidate_stack=candidate_stack)
    check_candidate_index(candidate_to_request, num_candidates, num_requests, op)
    return run_broadcast_interaction(request_stack, candidate_stack, candidate_to_request)


def run_broadcast_interaction(request_stack, candidate_stack, candidate_to_request) -> torch.Tensor:
    """The op's device dispatch without its argument checks (callers checked them)."""
    if use_triton(candidate_stack):
        from rocs_compiler.kernels import interaction_triton

        return interaction_triton.broadcast_interaction(
            request_stack, candidate_stack, candidate_to_request
        )

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


@broadcast_interaction.register_fake
def _(request_stack, candidate_stack, candidate_to_request):
    torch._check(request_stack.dim() == 3 and candidate_stack.dim() == 3)
    torch._check(candidate_stack.shape[2] == request_stack.shape[2])
    torch._check(candidate_to_request.shape[0] == candidate_stack.shape[0])
    return candidate_stack.new_empty(
        (candidate_stack.shape[0], candidate_stack.shape[1], request_stack.shape[1])
    )


@register_flop_formula(torch.ops.rocs.broadcast_interaction)
def _(request_stack_shape, candidate_stack_shape, idx_shape, out_shape=None, **kwargs):
    n, fc, d = candidate_stack_shape
    return 2 * n * fc * request_stack_shape[1] * d
