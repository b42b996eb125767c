"""How a GLM layer's hidden width splits into request and candidate lanes."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Lanes:
    """How a hidden width splits into (request, candidate) lanes."""

    fraction: float = 0.5
    scale: float = 1.0

    def split(self, width: int, multiple: int = 1) -> tuple[int, int]:
        """(request, candidate) widths for a layer that is ``width`` wide in the vanilla model.

        The base split is ``round(width * fraction)`` request lanes (at least one of each group);
        the request lanes are then scaled. With ``multiple`` > 1 the request lanes are rounded up
        so that the total is a multiple of it (for layers that split into heads).
        """
        if width < 2:
            raise ValueError(
                f"a layer of width {width} cannot hold a request and a candidate group"
            )
        base = min(max(round(width * self.fraction), 1), width - 1)
        candidate = width - base
        request = max(1, round(base * self.scale))
        if multiple > 1:
            request = math.ceil((request + candidate) / multiple) * multiple - candidate
        return request, candidate
