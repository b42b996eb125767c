"""Recommendation models written for replicated inputs, with example-batch makers.

Every model is plain PyTorch for the replicated layout (one row per (request, candidate)
pair); `ZOO[name].make_batch(counts)` draws a batch in shared layout and
`Batch.replicated()` turns it into the model's keyword arguments.
"""

from .batch import Batch, request_index
from .registry import ZOO, ZooEntry, get_entry, names

__all__ = ["ZOO", "Batch", "ZooEntry", "get_entry", "names", "request_index"]
