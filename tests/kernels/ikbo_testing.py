"""Shared test helpers for the IKBO ops: index strategies and random inputs.

``candidate_to_request`` batches are drawn the way serving produces them and the way they
break kernels: R = 1, ragged counts, requests with one candidate or none, equal counts
(the grouped fast path), sorted or shuffled order.
"""

from __future__ import annotations

import torch

try:  # the Triton cases also run on machines without hypothesis
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover
    st = None


def make_index(counts: list[int], perm_seed: int | None = None) -> torch.Tensor:
    """int64 [N] index with ``counts[r]`` candidates for request r, optionally shuffled."""
    idx = torch.repeat_interleave(
        torch.arange(len(counts)), torch.tensor(counts, dtype=torch.int64)
    )
    if perm_seed is not None:
        gen = torch.Generator().manual_seed(perm_seed)
        idx = idx[torch.randperm(idx.shape[0], generator=gen)]
    return idx


def _candidate_index(draw, max_requests: int = 5, max_per_request: int = 6):
    """Draw ``(R, idx)`` covering the shapes listed in the module docstring."""
    num_requests = draw(st.integers(1, max_requests))
    if draw(st.booleans()):
        counts = [draw(st.integers(1, max_per_request))] * num_requests
    else:
        counts = draw(
            st.lists(st.integers(0, max_per_request), min_size=num_requests, max_size=num_requests)
        )
    if sum(counts) == 0:
        counts[0] = 1
    shuffle = draw(st.booleans())
    perm_seed = draw(st.integers(0, 2**16)) if shuffle else None
    return num_requests, make_index(counts, perm_seed)


candidate_index = st.composite(_candidate_index) if st is not None else None


def randn(*shape, seed: int, dtype=torch.float32, device="cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype=dtype, device=device)


def random_mask(num_requests: int, length: int, seed: int, fully_masked: int | None = None):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(num_requests, length, generator=gen) > 0.3
    if fully_masked is not None:
        mask[fully_masked] = False
    return mask
