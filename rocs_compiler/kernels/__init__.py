"""IKBO (in-kernel broadcast) custom ops in the ``rocs::`` namespace.

Axis letters: R requests, N candidates, K reduction, M output, D feature, H heads,
L sequence. ``candidate_to_request`` is int64 [N] with values in [0, R).

=================================  ==========================================================
op                                 computes (``u[idx]`` never materialized)
=================================  ==========================================================
``broadcast_linear``               ``c @ W.T + b + request_term[idx]``          -> [N, M]
``broadcast_linear_compression``   ``W @ ec[n] + request_term[idx[n]]``          -> [N, M, D]
``broadcast_attention``            ``sdpa(q, k[idx], v[idx], key_mask[idx])``    -> [N, H, Lq, D]
``broadcast_interaction``          ``cs[n] @ rs[idx[n]].T``                      -> [N, Fc, Fu]
``broadcast_pointwise``            elementwise ``program`` over c* and r*[idx]   -> [N, *S]
=================================  ==========================================================

Importing this package registers the ops (``torch.ops.rocs.*``), their fake kernels and
FLOP formulas. Each op dispatches on device at call time: CUDA tensors run a Triton kernel,
CPU tensors a torch path that groups or chunks by request instead of replicating; set
``ROCS_TRITON_ON_CPU=1`` (with ``TRITON_INTERPRET=1``) to run the Triton launchers on CPU.
Triton is optional: it is imported only when a Triton path runs.

``OPS`` maps each op name to its plain-torch reference (gather with ``index_select``, then
the unfused op); ``reference_for(node.target)`` looks one up from a graph node.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rocs_compiler.kernels import attention, interaction, linear, pointwise  # noqa: F401 (registers ops)
from rocs_compiler.kernels.pointwise_program import (
    Node,
    ProgramError,
    format_program,
    kernel_source,
    parse_program,
)
from rocs_compiler.kernels.reference import OPS, reference_for

__all__ = [
    "OPS",
    "ProgramError",
    "broadcast_attention",
    "broadcast_interaction",
    "broadcast_linear",
    "broadcast_linear_compression",
    "broadcast_pointwise",
    "format_program",
    "kernel_source",
    "parse_program",
    "reference_for",
]


def broadcast_linear(
    c: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    request_term: torch.Tensor,
    candidate_to_request: torch.Tensor,
) -> torch.Tensor:
    """``c [N, K] @ weight[M, K].T + bias [M] + request_term [R, M][candidate_to_request]``."""
    return torch.ops.rocs.broadcast_linear(c, weight, bias, request_term, candidate_to_request)


def broadcast_linear_compression(
    ec: torch.Tensor,
    weight: torch.Tensor,
    request_term: torch.Tensor,
    candidate_to_request: torch.Tensor,
) -> torch.Tensor:
    """``weight [M, Kc] @ ec[n] [Kc, D] + request_term [R, M, D][candidate_to_request[n]]``."""
    return torch.ops.rocs.broadcast_linear_compression(
        ec, weight, request_term, candidate_to_request
    )


def broadcast_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    candidate_to_request: torch.Tensor,
    key_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """SDPA of q [N, H, Lq, D] against k/v [R, H, L, D] of each candidate's request."""
    return torch.ops.rocs.broadcast_attention(q, k, v, candidate_to_request, key_mask, scale)


def broadcast_interaction(
    request_stack: torch.Tensor,
    candidate_stack: torch.Tensor,
    candidate_to_request: torch.Tensor,
) -> torch.Tensor:
    """``candidate_stack [N, Fc, D] @ request_stack [R, Fu, D][idx].T`` -> [N, Fc, Fu]."""
    return torch.ops.rocs.broadcast_interaction(
        request_stack, candidate_stack, candidate_to_request
    )


def broadcast_pointwise(
    program: str | Node,
    candidate_inputs: Sequence[torch.Tensor],
    request_inputs: Sequence[torch.Tensor],
    candidate_to_request: torch.Tensor,
) -> torch.Tensor:
    """Evaluate ``program`` (text or AST) over c* [N, *S] and r* [R, *S] read via the index."""
    # Text goes through as is (the op parses it); an AST is printed in canonical form.
    text = program if isinstance(program, str) else format_program(program)
    return torch.ops.rocs.broadcast_pointwise(
        text, list(candidate_inputs), list(request_inputs), candidate_to_request
    )
