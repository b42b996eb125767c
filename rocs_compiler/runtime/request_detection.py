"""Request detection for drop-in (replicated-layout) calls.

Consecutive rows whose request-side inputs are bit-for-bit equal form one request. Bitwise
comparison keeps the rewrite exact: gathering a request row reproduces the original bits, NaNs
and signed zeros included. A user that reappears later in the batch simply forms a new request.
"""

from __future__ import annotations

from typing import Sequence

import torch

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bit_rows(x: torch.Tensor) -> torch.Tensor:
    """``x``'s rows as integers with the same bits (complex128 as pairs of int64)."""
    flat = x.reshape(x.shape[0], -1)
    if flat.is_floating_point() or flat.is_complex():
        flat = flat.contiguous().view(_BITS[min(flat.element_size(), 8)])
    return flat


def group_requests(request_leaves: Sequence[torch.Tensor], rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(starts, candidate_to_request): the first row of each request and each row's request."""
    device = request_leaves[0].device if request_leaves else torch.device("cpu")
    if rows == 0:
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return empty, empty
    change = torch.zeros(rows - 1, dtype=torch.bool, device=device)
    for leaf in request_leaves:
        bits = _bit_rows(leaf)
        if bits.shape[1]:  # a leaf with no elements per row cannot tell requests apart
            change |= (bits[1:] != bits[:-1]).any(dim=1)
    is_start = torch.cat([torch.ones(1, dtype=torch.bool, device=device), change])
    starts = is_start.nonzero().squeeze(1)
    return starts, torch.cumsum(is_start, 0) - 1


def rows_consistent(replicated: torch.Tensor, shared: torch.Tensor, index: torch.Tensor) -> bool:
    """True when every replicated row equals its request's shared row, bit for bit."""
    return bool((_bit_rows(shared.index_select(0, index)) == _bit_rows(replicated)).all())
