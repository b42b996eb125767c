"""A request's predicted cost, read from a compiled model: the FLOPs of its request work and of
its candidates' work, linear in its history length.

``cost(lengths, candidates)`` takes int64 ``[R]`` history lengths (None for a model without a
history length) and int64 ``[R]`` candidate counts, and returns float64 ``[R]``. The balancer
needs it affine in the length (``a + b * L`` per request, as :class:`LinearCost` is): it reads
the cost of a request padded to another width from the cost at length 0 and at length 1.

Source: ``runtime/call/jagged_groups.py::unit_costs`` (the pipeline's FLOPs per request and per
candidate at length 1 and at the example's length), or ``PipelineResult.unit_flops`` for a model
without a dynamic length. They are forward FLOPs; a training step's are about three times as
many for every request alike, which leaves a balance unchanged. Milliseconds per op family (a
calibrated model) are not read here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InputError


@dataclass(frozen=True)
class LinearCost:
    """``cost(L, k) = a_r + b_r * L + k * (a_c + b_c * L)``: ``request = (a_r, b_r)``,
    ``candidate = (a_c, b_c)``."""

    request: tuple[float, float]
    candidate: tuple[float, float]

    def __call__(self, lengths: torch.Tensor | None, candidates: torch.Tensor) -> torch.Tensor:
        (ar, br), (ac, bc) = self.request, self.candidate
        k = candidates.to(torch.float64)
        if lengths is None:
            return ar + k * ac
        length = lengths.to(torch.float64)
        return ar + br * length + k * (ac + bc * length)


def flops_cost(cm) -> LinearCost:
    """The FLOPs of a request of ``cm`` (a compiled model) at its history length, with its
    candidates: linear in the length of ``cm``'s first dynamic-length input (the example's
    history lengths marked with ``torch._dynamo.mark_dynamic``), constant without one."""
    result = getattr(cm, "pipeline_result", None)
    if result is None:
        raise InputError(
            "the compiled model has no pipeline result (an eager fallback?): give the balancer "
            "cost=callable(lengths, candidates) instead"
        )
    sizes = result.length_sizes()
    if not sizes:
        per_request, per_candidate = result.unit_flops()
        return LinearCost((per_request, 0.0), (per_candidate, 0.0))
    from ..runtime.call.jagged_groups import unit_costs

    name, size = next(iter(sizes.items()))
    units = unit_costs(result, name, int(size.node.hint))
    return LinearCost(tuple(units.request), tuple(units.candidate))


def history_inputs(cm) -> tuple[str, ...]:
    """``cm``'s request inputs with a dynamic length (dim 1 of a padded history)."""
    result = getattr(cm, "pipeline_result", None)
    if result is None:
        return ()
    request = set(cm.contract.request_inputs)
    return tuple(name for name in result.length_sizes() if name in request)
