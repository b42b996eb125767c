"""The global set of requests a partition places: their costs, lengths and home ranks."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Requests:
    """The global set of requests, rank by rank in each rank's local order (all ``[G]``)."""

    fixed: np.ndarray  # float64: a request's cost at length 0
    per_length: np.ndarray  # float64: its cost per unit of history width
    lengths: np.ndarray  # int64: its history length (0 without histories)
    candidates: np.ndarray  # int64
    home: np.ndarray  # int64: the rank that loaded it
    padded: bool  # a rank pads its histories to its longest request
    # A rank groups its requests by length (``runtime/call/jagged.py``): each request runs at its
    # length rounded up to a power of two (these ``widths``), at most the rank's longest length.
    widths: np.ndarray | None = None

    @property
    def own(self) -> np.ndarray:
        """Each request's cost at its own length (grouped: at its group's width, the most it
        runs at on any rank)."""
        return self.fixed + self.per_length * self._own_widths

    @property
    def run_widths(self) -> np.ndarray:
        """float64 ``[G]``: the width each request runs at on a rank whose longest request has
        length ``W`` is ``min(run_widths, W)``: infinite when a rank pads to its longest, the
        group's width when it groups them, the request's length otherwise."""
        if self.padded:
            return np.full(self.lengths.shape, np.inf)
        return self._own_widths.astype(np.float64)

    @property
    def _own_widths(self) -> np.ndarray:
        return self.lengths if self.widths is None else self.widths
