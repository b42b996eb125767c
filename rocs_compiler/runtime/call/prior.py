"""The FLOP prior of the program choice: a call's shared and plain FLOPs, as the pipeline counted
them per request and per candidate at the call's lengths, and the lead the shared program needs
in a measured bucket.

Identity: shared FLOPs = R * per request + N * per candidate; plain FLOPs = N * (both), each
counted at the lengths of the first call of the bucket's length class (``lengths.py``; a model
without dynamic lengths: at the example's sizes, once).
"""

from __future__ import annotations

from ..choice.program_choice import margin_for


def margin(
    cm, rows: int, num_requests: int, margin: float = 0.0, lengths: tuple = (), leaves=None
) -> float:
    """The lead the shared program needs in a measured bucket (``margin_for``) of the length
    class ``lengths`` (:func:`flops`)."""
    shared, plain = flops(cm, rows, num_requests, lengths, leaves)
    return margin_for(plain / shared if shared > 0 else 0.0, margin)


def flops(
    cm, rows: int, num_requests: int, lengths: tuple = (), leaves=None
) -> tuple[float, float]:
    """(shared, plain) FLOPs of a call of the length class ``lengths`` (``lengths.py``) by the
    pipeline's counts, at the lengths of the first call of that class (named ``leaves``; None:
    at the example's); (0, 0) when unknown."""
    unit = cm._unit_flops.get(lengths)
    if unit is None:
        unit = cm._unit_flops[lengths] = flops_per_unit(cm, leaves)
    per_request, per_candidate = unit
    return num_requests * per_request + rows * per_candidate, rows * (per_request + per_candidate)


def flops_per_unit(cm, leaves=None) -> tuple[float, float]:
    """(FLOPs per request, FLOPs per candidate) at the lengths of the call named ``leaves`` (None:
    the example's), as the pipeline counted them; (0, 0), which settles nothing, when it gave
    none or cannot count them (a data-dependent graph)."""
    if cm._unit_flops_of is None:
        return 0.0, 0.0
    try:
        if cm._lengths is None or leaves is None:
            return cm._unit_flops_of()
        return cm._unit_flops_of(cm._lengths.sizes(leaves))
    except Exception:  # noqa: BLE001 - the prior is optional: without it buckets are measured
        return 0.0, 0.0
