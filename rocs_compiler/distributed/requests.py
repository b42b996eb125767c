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

    @property
    def own(self) -> np.ndarray:
        """Each request's cost at its own length."""
        return self.fixed + self.per_length * self.lengths
