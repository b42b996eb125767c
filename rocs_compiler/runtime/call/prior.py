"""The FLOP prior of the program choice: a call's shared and plain FLOPs, as the pipeline counted
them per request and per candidate, and the lead the shared program needs in a measured bucket.

Identity: shared FLOPs = R * per request + N * per candidate; plain FLOPs = N * (both).
"""

from __future__ import annotations

from ..choice.program_choice import margin_for


def margin(cm, rows: int, num_requests: int, margin: float = 0.0) -> float:
    """The lead the shared program needs in a measured bucket (``margin_for``)."""
    shared, plain = flops(cm, rows, num_requests)
    return margin_for(plain / shared if shared > 0 else 0.0, margin)


def flops(cm, rows: int, num_requests: int) -> tuple[float, float]:
    """(shared, plain) FLOPs of a call, by the pipeline's counts; (0, 0) when unknown."""
    if cm._unit_flops is None:
        object.__setattr__(cm, "_unit_flops", flops_per_unit(cm))
    per_request, per_candidate = cm._unit_flops
    return num_requests * per_request + rows * per_candidate, rows * (per_request + per_candidate)


def flops_per_unit(cm) -> tuple[float, float]:
    """(FLOPs per request, FLOPs per candidate), as the pipeline counted them; (0, 0), which
    settles nothing, when it gave none or cannot count them (a data-dependent graph)."""
    if cm._unit_flops_of is None:
        return 0.0, 0.0
    try:
        return cm._unit_flops_of()
    except Exception:  # noqa: BLE001 - the prior is optional: without it buckets are measured
        return 0.0, 0.0
