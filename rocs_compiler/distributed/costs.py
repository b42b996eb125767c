"""A request's predicted cost, read from a compiled model: the FLOPs of its request work and of
its candidates' work, linear in its history length.

``cost(lengths, candidates)`` takes int64 ``[R]`` history lengths (None for a model without a
history length) and int64 ``[R]`` candidate counts, and returns float64 ``[R]``. The balancer
needs it affine in the length (``a + b * L`` per request, as :class:`LinearCost` is): it reads
the cost of a request padded to another width from the cost at length 0 and at length 1.

Two sources:

- :func:`flops_cost`: ``runtime/call/jagged_groups.py::unit_costs`` (the pipeline's FLOPs per
  request and per candidate at length 1 and at the example's length), or
  ``PipelineResult.unit_flops`` for a model without a dynamic length;
- :func:`calibrated_cost`: milliseconds, ``cm.cost()`` (every op's FLOPs, bytes, items and
  launch) priced by a ``rocs.Calibration`` of this machine and fitted by non-negative least
  squares to ``c + R (a_r + b_r L) + N (a_c + b_c L)`` over calls of a few sizes; ``c``, what a
  call pays once, is the same on every rank and left out.

Both are forward costs; a training step's backward costs about twice its forward for every
request alike, which leaves a balance unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
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


def calibrated_cost(
    cm,
    calibration,
    *,
    requests: Sequence[int] = (1, 4, 16, 64),
    candidates: Sequence[int] = (1, 8, 64),
    lengths: Sequence[int] = (8, 64, 512),
) -> LinearCost:
    """Milliseconds of a request of ``cm`` on the machine ``calibration`` measured
    (``rocs.calibrate()``): ``cm.cost().predict_ms`` at every ``requests`` x ``candidates`` (per
    request) x ``lengths`` (of every dynamic length; ignored without one), fitted to
    ``c + R (a_r + b_r L) + N (a_c + b_c L)`` by non-negative least squares on relative error.
    The calibrated prediction is not affine where an op's output passes a cache or allocator
    threshold; the fit is its best affine reading over these sizes."""
    from ..runtime.program.calibration import nnls

    call = cm.cost()
    names = list(call.lengths)
    rows, times = [], []
    for r in requests:
        for k in candidates:
            for length in lengths if names else (0,):
                n = r * k
                rows.append([1.0, r, r * length, n, n * length])
                times.append(call.predict_ms(calibration, R=r, N=n, **dict.fromkeys(names, length)))
    used = [0, 1, 2, 3, 4] if names else [0, 1, 3]  # without a length, no per-length terms
    a, b = np.array(rows, dtype=np.float64)[:, used], np.array(times)
    coef = np.zeros(5)
    coef[used], _ = nnls(a / b[:, None], np.ones_like(b))
    return LinearCost((float(coef[1]), float(coef[2])), (float(coef[3]), float(coef[4])))


def runs_grouped(cm) -> bool:
    """Whether ``cm``'s calls run their requests grouped by history length
    (``runtime/call/jagged.py``): each request then costs about its own length rounded up to a
    power of two, not the call's width."""
    jagged = getattr(cm, "_jagged", None)
    return jagged is not None and jagged.truncation is not None
