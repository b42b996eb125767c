"""How a jagged call groups its requests (``jagged.py``): each request's width rounded up to a
power of two (at most the call's), then neighbouring widths merged while the FLOPs a merge adds
cost less than one more call (:data:`CALL_FLOPS`). FLOPs per request and per candidate are the
pipeline's, linear in the length: read at length one and at the example's
(``PipelineResult.costs_at``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...ir.graph_meta import ROLE
from ...ir.roles import Role

# FLOPs one more call of the compiled model costs besides its work (a few hundred microseconds
# of Python, checks and launches on one CPU thread: docs/SPEED.md, "Jagged histories").
CALL_FLOPS = 4e6


@dataclass(frozen=True)
class UnitCosts:
    """FLOPs of one request and of one candidate at history length ``L``: ``a + b * L``."""

    request: tuple[float, float]
    candidate: tuple[float, float]

    def of(self, requests: int, candidates: int, width: int) -> float:
        (ar, br), (ac, bc) = self.request, self.candidate
        return requests * (ar + br * width) + candidates * (ac + bc * width) + CALL_FLOPS


def power_of_two_widths(lengths: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """Each length rounded up to a power of two (at least 1; at most ``width`` when given): the
    width a request's group runs at before neighbouring groups merge."""
    padded = torch.clamp(lengths, min=1).to(torch.float64)
    widths = (2 ** torch.ceil(torch.log2(padded))).to(torch.int64)
    return widths if width is None else torch.clamp(widths, max=width)


def plan_groups(lengths, counts, width: int, costs: UnitCosts, needs_content: bool) -> list:
    """``[(requests, width)]``: each request's power-of-two width (at most ``width``), then
    neighbouring widths merged while a merge saves FLOPs (:meth:`UnitCosts.of`)."""
    widths = power_of_two_widths(lengths, width)
    if needs_content:
        widths = torch.where(lengths == 0, torch.full_like(widths, width), widths)
    buckets = []  # [width, requests, candidates], ascending
    for w in torch.unique(widths).tolist():
        members = widths == w
        buckets.append([w, int(members.sum()), int(counts[members].sum())])
    while len(buckets) > 1:
        best, saving = None, 0.0
        for i in range(len(buckets) - 1):
            (w1, r1, n1), (w2, r2, n2) = buckets[i], buckets[i + 1]
            apart = costs.of(r1, n1, w1) + costs.of(r2, n2, w2)
            together = costs.of(r1 + r2, n1 + n2, w2)
            if apart - together > saving:
                best, saving = i, apart - together
        if best is None:
            break
        (w1, r1, n1), (w2, r2, n2) = buckets[best], buckets[best + 1]
        buckets[best : best + 2] = [[w2, r1 + r2, n1 + n2]]
    groups = []
    lower = 0
    for w, _, _ in buckets:
        members = ((widths > lower) & (widths <= w)).nonzero().squeeze(1)
        groups.append((members, w))
        lower = w
    return groups


def unit_costs(result, length_input: str, example_length: int) -> UnitCosts:
    """FLOPs per request and per candidate as ``a + b * L``, from the pipeline's counts at
    length 1 and at the example's length."""
    low, high = 1, max(example_length, 2)
    points = []
    for length in (low, high):
        costs = result.costs_at({length_input: length})
        per = {Role.REQUEST: 0.0, Role.CANDIDATE: 0.0}
        for node in result.logical_graph.graph.nodes:
            cost, role = costs.get(node.name), node.meta.get(ROLE)
            if cost is not None and role in per:
                per[role] += cost.per_row
        points.append(per)
    slopes = {
        r: (points[1][r] - points[0][r]) / (high - low) for r in (Role.REQUEST, Role.CANDIDATE)
    }
    fixed = {r: points[0][r] - slopes[r] * low for r in slopes}
    return UnitCosts(
        (fixed[Role.REQUEST], slopes[Role.REQUEST]),
        (fixed[Role.CANDIDATE], slopes[Role.CANDIDATE]),
    )
