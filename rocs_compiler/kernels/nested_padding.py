"""``rocs::nested_padding``: the zeros ``nn.TransformerEncoder``'s nested fast path leaves.

In eager, an ``nn.TransformerEncoder`` in inference runs its layers on a nested tensor of the
valid positions when the batch allows it, and pads the result back with zeros *before* its
final norm; ``torch.export`` (which capture runs) takes the padded path instead, where the
padded positions hold the layers' values. Capture (``capture/nested_fast_path.py``) ends the
encoder's layers with this op, which restores eager's zeros::

    nested_padding(states [B, L, D], padding_mask [B, L], idx [N] = None)
        = where(nests, states.masked_fill(padding_mask[..., None], 0), states)

``padding_mask`` is bool, True at padding (the encoder's canonical mask). ``nests`` is what
eager decides at the call: the fast path is open (``torch.backends.mha.get_fastpath_enabled()``
and not :func:`fast_path_state`-blocked for this call) and every row of the batch is *left
aligned* (its valid positions are a prefix; a fully padded row counts), the check
``torch._nested_tensor_from_mask_left_aligned`` makes. With ``idx``, only the rows ``idx``
references count: rows of requests without candidates are not in eager's batch.

Identities. (1) At valid positions eager's nested path computes what the padded path computes
with ``src_key_padding_mask`` (attention reads valid keys only, every other op is per position),
to rounding; at padded positions it gives zeros. (2) Role (``register`` below, ``request_index``):
eager's batch is the request rows gathered by ``idx``, whose rows are all aligned exactly when
every row ``idx`` references is, so ``op(x[idx], m[idx]) == op(x, m, idx)[idx]``: the op is
row-wise once the share pass hands its request-placed copies the index. Without the index (the
captured graph, candidate placement) the flag is over every row, which is then eager's batch.

Call-time conditions eager reads that the graph cannot: the runtime wraps a call in
:func:`fast_path_state` with the parameters eager's check reads (:func:`blocks_fast_path`); an
exported program runs with the default, not blocked, which is eager's under ``no_grad``. The
flag is a tensor, so a CUDA call never waits for the device. No Triton kernel: the torch path
is two elementwise passes. Backward: ``where(nests, grad.masked_fill(pad, 0), grad)``, with the
flag as the forward saw it (the backward runs in its forward's context). Tested in
``tests/test_nested_fast_path.py`` and with every op in ``tests/kernels/``.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Iterable, Optional

import torch

from rocs_compiler.analysis.role_rules import ROWWISE, Lane, RuleContext, register
from rocs_compiler.kernels.rocs_op import RocsOp, define

# Set by the runtime around one call (:class:`fast_path_state`), per thread and per task.
_BLOCKED: ContextVar[bool] = ContextVar("rocs_nested_fast_path_blocked", default=False)
# The parameters whose call the decision in force was made for (:func:`decided_for`).
_DECIDED: ContextVar[object] = ContextVar("rocs_nested_fast_path_decided", default=None)


def blocks_fast_path(params: Iterable[torch.Tensor]) -> bool:
    """True when eager's encoder would refuse its nested fast path at this call for reasons of
    the call: autocast is on, or grad is enabled and one of ``params`` (the parameters eager's
    check reads, as capture recorded them) requires grad."""
    if torch.is_autocast_enabled():
        return True
    return torch.is_grad_enabled() and any(p.requires_grad for p in params)


class fast_path_state:  # noqa: N801 - used as a function: ``with fast_path_state(params):``
    """Within the block, ``rocs::nested_padding`` follows eager's decision for a call made in
    the current grad and autocast state with ``params`` (:func:`blocks_fast_path`). A plain
    class, not a generator: it opens every call."""

    __slots__ = ("_params", "_blocked", "_tokens")

    def __init__(self, params: Iterable[torch.Tensor]):
        self._params = params
        self._blocked = blocks_fast_path(params)

    def __enter__(self) -> None:
        self._tokens = (_BLOCKED.set(self._blocked), _DECIDED.set(self._params))

    def __exit__(self, *exc) -> None:
        blocked, decided = self._tokens
        _DECIDED.reset(decided)
        _BLOCKED.reset(blocked)


def decided_for(params: object) -> bool:
    """True inside :class:`fast_path_state` of these very ``params`` (the same object): the call
    in progress already has its decision."""
    return _DECIDED.get() is params


def fast_path_open() -> bool:
    """True when eager's encoder may nest at this call, alignment aside."""
    return torch.backends.mha.get_fastpath_enabled() and not _BLOCKED.get()


def nests(padding_mask: torch.Tensor, candidate_to_request: Optional[torch.Tensor]) -> torch.Tensor:
    """0-dim bool: every row (every row ``candidate_to_request`` references) is left aligned,
    i.e. no padded position is followed by a valid one."""
    misaligned = (padding_mask[:, :-1] & ~padding_mask[:, 1:]).any(1)
    if candidate_to_request is not None:
        misaligned = misaligned.index_select(0, candidate_to_request)
    return ~misaligned.any()


def _nested_padding(states, padding_mask, candidate_to_request=None):
    """The module docstring's formula in plain torch: the op's torch path and its reference."""
    if not fast_path_open():
        return states.clone(memory_format=torch.contiguous_format)
    states = states.contiguous()
    flag = nests(padding_mask, candidate_to_request)
    return torch.where(flag, states.masked_fill(padding_mask.unsqueeze(-1), 0), states)


def _check(states, padding_mask, candidate_to_request=None):
    if states.dim() != 3:
        raise ValueError(
            f"rocs::nested_padding: states must be [B, L, D], got {list(states.shape)}"
        )
    if padding_mask.dtype != torch.bool or padding_mask.shape != states.shape[:2]:
        raise ValueError(
            "rocs::nested_padding: padding_mask must be bool [B, L] = "
            f"{list(states.shape[:2])}, got {padding_mask.dtype} {list(padding_mask.shape)}"
        )
    if candidate_to_request is not None and (
        candidate_to_request.dtype != torch.int64 or candidate_to_request.dim() != 1
    ):
        raise ValueError("rocs::nested_padding: candidate_to_request must be int64 [N]")
    return None, None


def _fake(states, padding_mask, candidate_to_request=None):
    return torch.empty_like(states, memory_format=torch.contiguous_format)


def _backward(needs, grad, states, padding_mask, candidate_to_request=None):
    """``(d states, None, None)``: the forward's mask applied to ``grad``."""
    if not needs[0]:
        return None, None, None
    if not fast_path_open():
        return grad, None, None
    flag = nests(padding_mask, candidate_to_request)
    return torch.where(flag, grad.masked_fill(padding_mask.unsqueeze(-1), 0), grad), None, None


NESTED_PADDING = define(
    RocsOp(
        name="nested_padding",
        check=_check,
        fake=_fake,
        cpu=_nested_padding,
        reference=_nested_padding,
        backward=_backward,
    )
)


@register(torch.ops.rocs.nested_padding, lane=Lane.WHOLE, request_index="candidate_to_request")
def _nested_padding_rule(ctx: RuleContext) -> Optional[str]:
    """Row-wise given the index (identity (2) of the module docstring), with the batch on dim 0
    of both the states and the mask."""
    for name in ("states", "padding_mask"):
        axis = ctx.axis(ctx.arg(name))
        if axis is None or axis.dim != 0 or not axis.plain:
            return f"the batch is not dim 0 of {name}"
    return ROWWISE
