"""The records of the ``rocs::`` custom ops: IKBO (in-kernel broadcast) ops and their kernels.

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
``embedding_bag_rows``             ``embedding_bag`` pooling each row of [B, L] ids (no index)
``nested_padding``                 ``where(nested, masked_fill(states, pad, 0), states)``
=================================  ==========================================================

Each op is one :class:`~rocs_compiler.kernels.rocs_op.RocsOp` record in its module (schema,
checks, fake kernel, FLOP formula, CPU path, Triton launcher, reference, autograd formula);
importing this module
imports them all (``torch.ops.rocs.*`` are defined by ``library.register``, which the package's
import calls, and run these records). ``ROCS_OPS`` maps each op's name to its record. An op
dispatches on device at call time: CUDA tensors run its Triton kernel, CPU tensors its torch
path, which groups or chunks by request instead of replicating; ``ROCS_TRITON_ON_CPU=1`` (with
``TRITON_INTERPRET=1``) runs the Triton launchers on CPU. Triton is imported only when a Triton
path runs.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from rocs_compiler.kernels.attention import BROADCAST_ATTENTION
from rocs_compiler.kernels.embedding_bag_rows import EMBEDDING_BAG_ROWS
from rocs_compiler.kernels.interaction import BROADCAST_INTERACTION
from rocs_compiler.kernels.linear import BROADCAST_LINEAR, BROADCAST_LINEAR_COMPRESSION
from rocs_compiler.kernels.nested_padding import NESTED_PADDING
from rocs_compiler.kernels.pointwise import BROADCAST_POINTWISE
from rocs_compiler.kernels.pointwise_program import (
    ProgramError,
    format_program,
    kernel_source,
    parse_program,
)
from rocs_compiler.kernels.rocs_op import RocsOp

ROCS_OPS: dict[str, RocsOp] = {
    op.name: op
    for op in (
        BROADCAST_LINEAR,
        BROADCAST_LINEAR_COMPRESSION,
        BROADCAST_ATTENTION,
        BROADCAST_INTERACTION,
        BROADCAST_POINTWISE,
        EMBEDDING_BAG_ROWS,
        NESTED_PADDING,
    )
}

__all__ = [
    "ROCS_OPS",
    "ProgramError",
    "RocsOp",
    "format_program",
    "kernel_source",
    "parse_program",
    "reference_for",
    "rocs_op_for",
]


def rocs_op_for(target: Any) -> Optional[RocsOp]:
    """The record of a graph node's target: an OpOverload, OpOverloadPacket or ``"rocs::name"``;
    None for anything that is not a ``rocs::`` op."""
    if isinstance(target, str):
        qualified = target
    else:
        qualified = getattr(getattr(target, "_schema", None), "name", None)
        if qualified is None:
            qualified = getattr(target, "_qualified_op_name", None)  # OpOverloadPacket
        if not isinstance(qualified, str):
            return None
    namespace, _, name = qualified.partition("::")
    return ROCS_OPS.get(name) if namespace == "rocs" else None


def reference_for(target: Any) -> Optional[Callable]:
    """The plain-torch reference of a ``rocs::`` op (see :func:`rocs_op_for`), else None."""
    op = rocs_op_for(target)
    return op.reference if op is not None else None
