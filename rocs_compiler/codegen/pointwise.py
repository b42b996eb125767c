"""Elementwise chains over candidate and request tensors: ``rocs::broadcast_pointwise``.

Axis letters: R requests, N candidates; S is the trailing shape shared by all inputs.

``broadcast_pointwise(program: str, candidate_inputs: [N, *S] list, request_inputs: [R, *S]
list, idx [N]) -> [N, *S]`` evaluates ``program`` (see ``pointwise_program.py``) where
``c<i>`` is ``candidate_inputs[i]`` and ``r<i>`` is ``request_inputs[i][idx]``. All inputs
share one dtype and the trailing shape S; callers expand beforehand (expanded inputs are
made contiguous, which copies them).

CPU path: torch ops in the inputs' dtype (the eager chain's own arithmetic), over chunks of
candidates sized so that each gathered request input (and each temporary) is at most
``CHUNK_BYTES``; the full ``[N, *S]`` request gather never exists, and peak memory is the
output plus a few chunks. CUDA path: a kernel generated from the
program (``pointwise_kernels.py``), math in float32. FLOPs: one per op application per
output element (torch's own counter does not count elementwise ops; these do, so that
fused chains are visible in reports).
"""

from __future__ import annotations

import math

import torch
from torch.utils.flop_counter import register_flop_formula

from rocs_compiler.codegen._common import check_candidate_index, use_triton
from rocs_compiler.codegen.pointwise_program import (
    check_program,
    evaluate,
    num_ops,
    used_inputs,
)

# Size of one chunk of each input or temporary on the CPU path: small enough that a chain's
# live values stay in cache, large enough that per-chunk Python overhead does not show.
CHUNK_BYTES = 1 << 20


def _check_inputs(candidate_inputs, request_inputs, idx):
    tensors = list(candidate_inputs) + list(request_inputs)
    first = tensors[0]
    trailing = tuple(first.shape[1:])
    for name, group in (("c", candidate_inputs), ("r", request_inputs)):
        for i, t in enumerate(group):
            if t.dtype != first.dtype or tuple(t.shape[1:]) != trailing:
                raise ValueError(
                    f"rocs::broadcast_pointwise: {name}{i} is {t.dtype} {list(t.shape)}, "
                    f"expected {first.dtype} [*, {', '.join(map(str, trailing))}]"
                )
            if t.device != idx.device:
                raise ValueError(f"rocs::broadcast_pointwise: {name}{i} is on {t.device}")
    for i, t in enumerate(candidate_inputs):
        if t.shape[0] != idx.shape[0]:
            raise ValueError(f"rocs::broadcast_pointwise: c{i} has {t.shape[0]} rows, expected N")
    if any(t.shape[0] != request_inputs[0].shape[0] for t in request_inputs):
        raise ValueError("rocs::broadcast_pointwise: request inputs have different row counts")
    return first, trailing


@torch.library.custom_op("rocs::broadcast_pointwise", mutates_args=())
def broadcast_pointwise(
    program: str,
    candidate_inputs: list[torch.Tensor],
    request_inputs: list[torch.Tensor],
    candidate_to_request: torch.Tensor,
) -> torch.Tensor:
    """Evaluate ``program`` per candidate, reading request inputs through the index."""
    node = check_program(program, len(candidate_inputs), len(request_inputs))
    first, trailing = _check_inputs(candidate_inputs, request_inputs, candidate_to_request)
    num_candidates = candidate_to_request.shape[0]
    num_requests = request_inputs[0].shape[0] if request_inputs else 0
    check_candidate_index(
        candidate_to_request,
        num_candidates,
        num_requests if request_inputs else None,
        "broadcast_pointwise",
    )
    if use_triton(first):
        from rocs_compiler.codegen import pointwise_kernels

        return pointwise_kernels.broadcast_pointwise(
            node, candidate_inputs, request_inputs, candidate_to_request
        )

    out = first.new_empty((num_candidates, *trailing))
    if out.numel() == 0:
        return out
    cand, req = used_inputs(node)
    inner = math.prod(trailing)
    rows = max(1, CHUNK_BYTES // max(1, inner * first.element_size()))
    for start in range(0, num_candidates, rows):
        chunk = slice(start, start + rows)
        env = {f"c{i}": candidate_inputs[i][chunk] for i in sorted(cand)}
        idx_chunk = candidate_to_request[chunk]
        env.update({f"r{i}": request_inputs[i].index_select(0, idx_chunk) for i in sorted(req)})
        out[chunk] = evaluate(node, env, like=first)
    return out


@broadcast_pointwise.register_fake
def _(program, candidate_inputs, request_inputs, candidate_to_request):
    check_program(program, len(candidate_inputs), len(request_inputs))
    first = (list(candidate_inputs) + list(request_inputs))[0]
    for t in candidate_inputs:
        torch._check(t.shape[0] == candidate_to_request.shape[0])
    return first.new_empty((candidate_to_request.shape[0], *first.shape[1:]))


@register_flop_formula(torch.ops.rocs.broadcast_pointwise)
def _(program, candidate_shapes, request_shapes, idx_shape, out_shape=None, **kwargs):
    first = (list(candidate_shapes) + list(request_shapes))[0]
    return num_ops(program) * idx_shape[0] * math.prod(first[1:])
