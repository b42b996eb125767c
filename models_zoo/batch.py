"""Serving batches in shared layout and their replicated view.

A serving batch scores R requests against N candidates. In *shared* layout every request
leaf has R rows and every candidate leaf has N rows; `candidate_to_request` (int64 [N])
says which request each candidate belongs to. The zoo models themselves are written for
the *replicated* layout, where request leaves are gathered to N rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["Batch", "get_leaf", "request_index", "set_leaf"]


def get_leaf(kwargs: dict, dotted: str) -> torch.Tensor:
    """Return the leaf named `dotted` ("user_ids" or "features.user_age") in nested dicts."""
    node = kwargs
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            raise KeyError(f"no input named {dotted!r} (missing key {key!r})")
        node = node[key]
    return node


def set_leaf(kwargs: dict, dotted: str, value: torch.Tensor) -> None:
    """Replace the leaf named `dotted` in nested dicts; the leaf must already exist."""
    *path, last = dotted.split(".")
    node = kwargs
    for key in path:
        node = node[key]
    if last not in node:
        raise KeyError(f"no input named {dotted!r} (missing key {last!r})")
    node[last] = value


def _copy_structure(tree):
    """Copy nested dicts, sharing the tensors at the leaves."""
    if isinstance(tree, dict):
        return {key: _copy_structure(value) for key, value in tree.items()}
    return tree


def request_index(
    counts: Sequence[int], *, shuffle: bool = False, generator: torch.Generator | None = None
) -> torch.Tensor:
    """`candidate_to_request` for requests with `counts[r]` candidates each.

    Candidates are grouped by request (`repeat_interleave(arange(R), counts)`); with
    `shuffle` they are put in a random order, which is just as valid a serving batch.
    """
    counts_t = torch.as_tensor(list(counts), dtype=torch.int64)
    if counts_t.dim() != 1 or counts_t.numel() == 0:
        raise ValueError(f"counts must be a non-empty sequence of ints, got {counts!r}")
    if bool((counts_t < 0).any()):
        raise ValueError(f"counts must be non-negative, got {counts!r}")
    index = torch.repeat_interleave(torch.arange(counts_t.numel()), counts_t)
    if shuffle:
        index = index[torch.randperm(index.numel(), generator=generator)]
    return index


@dataclass
class Batch:
    """One serving batch in shared layout: request leaves have R rows, candidate leaves N rows."""

    kwargs: dict
    candidate_to_request: torch.Tensor
    request_inputs: tuple[str, ...]

    @property
    def num_requests(self) -> int:
        return get_leaf(self.kwargs, self.request_inputs[0]).shape[0]

    @property
    def num_candidates(self) -> int:
        return self.candidate_to_request.shape[0]

    def replicated(self) -> dict:
        """The kwargs in replicated layout: every request leaf gathered to N rows.

        Candidate leaves are the same tensor objects; the dict structure is a fresh copy.
        """
        out = _copy_structure(self.kwargs)
        for name in self.request_inputs:
            leaf = get_leaf(self.kwargs, name)
            set_leaf(out, name, leaf.index_select(0, self.candidate_to_request))
        return out
