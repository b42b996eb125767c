"""Plain-torch references for the IKBO ops: materialize the broadcast, then the plain op.

Each reference gathers the request tensors to N rows with ``index_select`` and applies
the op the unfused graph would have run. They share no code with the ops' own paths
(except the pointwise program evaluator, which is the definition of a program), so tests
can use them as oracles, and ``OPS`` lets a verifier check that every fused op in a graph
has one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from rocs_compiler.kernels.pointwise_program import evaluate, parse_program


def broadcast_linear(
    c: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    request_term: torch.Tensor,
    candidate_to_request: torch.Tensor,
) -> torch.Tensor:
    return F.linear(c, weight, bias) + request_term.index_select(0, candidate_to_request)


def broadcast_linear_compression(
    ec: torch.Tensor,
    weight: torch.Tensor,
    request_term: torch.Tensor,
    candidate_to_request: torch.Tensor,
) -> torch.Tensor:
    return torch.matmul(weight, ec) + request_term.index_select(0, candidate_to_request)


def broadcast_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    candidate_to_request: torch.Tensor,
    key_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    mask = None
    if key_mask is not None:
        mask = key_mask.index_select(0, candidate_to_request)[:, None, None, :]
    return F.scaled_dot_product_attention(
        q,
        k.index_select(0, candidate_to_request),
        v.index_select(0, candidate_to_request),
        attn_mask=mask,
        scale=scale,
    )


def broadcast_interaction(
    request_stack: torch.Tensor,
    candidate_stack: torch.Tensor,
    candidate_to_request: torch.Tensor,
) -> torch.Tensor:
    gathered = request_stack.index_select(0, candidate_to_request)
    return torch.bmm(candidate_stack, gathered.transpose(1, 2))


def broadcast_pointwise(
    program: str,
    candidate_inputs: list[torch.Tensor],
    request_inputs: list[torch.Tensor],
    candidate_to_request: torch.Tensor,
) -> torch.Tensor:
    env = {f"c{i}": t for i, t in enumerate(candidate_inputs)}
    env.update(
        {f"r{i}": t.index_select(0, candidate_to_request) for i, t in enumerate(request_inputs)}
    )
    first = (list(candidate_inputs) + list(request_inputs))[0]
    result = evaluate(parse_program(program), env, like=first)
    shape = (candidate_to_request.shape[0], *first.shape[1:])
    fresh = isinstance(result, torch.Tensor) and all(result is not t for t in env.values())
    if fresh and result.shape == shape and result.dtype == first.dtype:
        return result
    # Constant programs, or a program that is just one input: broadcast / copy.
    return torch.as_tensor(result, dtype=first.dtype, device=first.device).expand(shape).clone()


# Op name (``torch.ops.rocs.<name>``) -> reference with the op's signature.
OPS: dict[str, Callable[..., torch.Tensor]] = {
    "broadcast_linear": broadcast_linear,
    "broadcast_linear_compression": broadcast_linear_compression,
    "broadcast_attention": broadcast_attention,
    "broadcast_interaction": broadcast_interaction,
    "broadcast_pointwise": broadcast_pointwise,
}


def reference_for(target) -> Callable[..., torch.Tensor] | None:
    """Reference of a graph node target: an OpOverload, OpOverloadPacket or ``"rocs::name"``.

    Returns None for anything that is not a ``rocs::`` op with a reference.
    """
    if isinstance(target, str):
        namespace, _, name = target.partition("::")
        if not name:
            return None
    else:
        schema_name = getattr(getattr(target, "_schema", None), "name", None)
        if schema_name is None:
            packet = getattr(target, "_qualified_op_name", None)  # OpOverloadPacket
            schema_name = packet
        if not isinstance(schema_name, str):
            return None
        namespace, _, name = schema_name.partition("::")
    return OPS.get(name) if namespace == "rocs" else None
