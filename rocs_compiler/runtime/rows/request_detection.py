"""Request detection for drop-in (replicated-layout) calls.

Consecutive rows whose request-side inputs are bit-for-bit equal form one request. Bitwise
comparison keeps the rewrite exact: gathering a request row reproduces the original bits, NaNs
and signed zeros included. A user that reappears later in the batch simply forms a new request.

The scan is a handful of array ops whatever the number of request inputs (their rows are
compared as bytes, side by side; through numpy for small CPU batches, torch otherwise), and one
read of the request starts, which the caller needs anyway: it gives the request sizes, so a batch
of equal-sized requests is recognized without another pass over the index, and its grouping
tensors are made once per shape.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import numpy as np
import torch

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class Requests(NamedTuple):
    """``starts`` [R]: the first row of each request; ``index`` [N]: each row's request;
    ``counts``: the rows of each request (a Python list, R entries)."""

    starts: torch.Tensor
    index: torch.Tensor
    counts: list[int]


def _dense_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, k]`` with strides ``(k, 1)``, which a view as another dtype needs.

    ``contiguous()`` is not enough: a ``[B, 1]`` column of a column-major array (strides
    ``(1, B)``) counts as contiguous, since the stride of a size-1 dim addresses nothing, and is
    returned as it is; its elements are dense, so it is re-strided without a copy."""
    flat = x.reshape(x.shape[0], -1).contiguous()
    if flat.shape[1] == 1 and flat.stride(1) != 1:
        flat = flat.as_strided(flat.shape, (1, 1))
    return flat


def _bit_rows(x: torch.Tensor) -> torch.Tensor:
    """``x``'s rows as integers with the same bits (complex128 as pairs of int64)."""
    flat = _dense_rows(x.resolve_conj().resolve_neg())
    if flat.is_floating_point() or flat.is_complex():
        flat = flat.view(_BITS[min(flat.element_size(), 8)])
    return flat


def _byte_rows(x: torch.Tensor) -> torch.Tensor:
    """``x``'s rows as bytes (so rows of inputs of different dtypes can be compared at once)."""
    x = x.resolve_conj().resolve_neg()  # lazy conjugate/negative views hold other bits
    return _dense_rows(x).view(torch.uint8)


# Up to this many rows, CPU leaves are compared through numpy: a few microseconds per call
# against about 25 for the torch ops below at 16 rows (numpy's small-array overhead is lower);
# from about a thousand rows the two cost the same.
NUMPY_ROWS = 512


def _numpy_byte_rows(x: torch.Tensor, rows: int) -> np.ndarray:
    """``x``'s rows as a C-contiguous uint8 array (the bits of ``_byte_rows``, read by numpy)."""
    x = x.detach()
    if x.dtype not in _NUMPY_DTYPES or x.is_conj() or x.is_neg():
        return _byte_rows(x).numpy()
    return np.ascontiguousarray(x.numpy().reshape(rows, -1)).view(np.uint8)


_NUMPY_DTYPES = {
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128,
}


def _change_rows_numpy(request_leaves: Sequence[torch.Tensor], rows: int) -> list[int]:
    parts = [b for b in (_numpy_byte_rows(x, rows) for x in request_leaves) if b.shape[1]]
    if not parts:
        return []
    rows_bytes = parts[0] if len(parts) == 1 else np.concatenate(parts, 1)
    return (np.flatnonzero((rows_bytes[1:] != rows_bytes[:-1]).any(1)) + 1).tolist()


def _change_rows_torch(request_leaves: Sequence[torch.Tensor], rows: int) -> list[int]:
    parts = [b for b in map(_byte_rows, request_leaves) if b.shape[1]]
    if not parts:
        return []
    rows_bytes = parts[0] if len(parts) == 1 else torch.cat(parts, 1)
    # amax over uint8 flags, not any(dim=1): on the CPU the latter is about 9x slower
    # over short rows (180 us vs 20 us for 1024 rows of 128 bytes).
    change = (rows_bytes[1:] != rows_bytes[:-1]).view(torch.uint8).amax(dim=1)
    return [i + 1 for i in change.nonzero().flatten().tolist()]


def request_starts(request_leaves: Sequence[torch.Tensor], rows: int) -> list[int]:
    """The first row of each run of consecutive rows equal in every leaf (bit for bit)."""
    if rows <= 1:
        return [0][:rows]
    small_cpu = rows <= NUMPY_ROWS and all(x.device.type == "cpu" for x in request_leaves)
    change = _change_rows_numpy if small_cpu else _change_rows_torch
    return [0] + change(request_leaves, rows)


@functools.lru_cache(maxsize=64)
def _uniform_grouping(rows: int, size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(starts, index) of ``rows // size`` requests of ``size`` rows each, made once per shape:
    read-only, never handed to the caller, and ordinary tensors (not inference tensors, which
    a call that records autograd could not save) whatever mode the first call ran in."""
    with torch.inference_mode(False):
        index = torch.arange(rows, device=device).floor_divide_(size)
        return torch.arange(0, rows, size, device=device), index


def detect_requests(request_leaves: Sequence[torch.Tensor], rows: int) -> Requests:
    """The requests of a replicated batch: runs of consecutive rows equal in every leaf."""
    device = request_leaves[0].device if request_leaves else torch.device("cpu")
    if rows == 0:
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return Requests(empty, empty, [])
    starts = request_starts(request_leaves, rows)
    counts = [b - a for a, b in zip(starts, starts[1:] + [rows])]
    if counts.count(counts[0]) == len(counts):  # equal-sized requests: no per-request tensor
        return Requests(*_uniform_grouping(rows, counts[0], device), counts)
    index = torch.repeat_interleave(torch.tensor(counts, device=device))
    return Requests(torch.tensor(starts, device=device), index, counts)


def group_requests(request_leaves: Sequence[torch.Tensor], rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(starts, candidate_to_request): the first row of each request and each row's request."""
    found = detect_requests(request_leaves, rows)
    return found.starts, found.index


def rows_consistent(replicated: torch.Tensor, shared: torch.Tensor, index: torch.Tensor) -> bool:
    """True when every replicated row equals its request's shared row, bit for bit."""
    return bool((_bit_rows(shared.index_select(0, index)) == _bit_rows(replicated)).all())


def reduce_rows(replicated: torch.Tensor, index: torch.Tensor, num_requests: int):
    """``(shared, consistent)``: one row per request, taken from one of its rows (from another
    request's for a request without rows, zeros when there are none), and whether every
    replicated row equals its request's row, bit for bit. Small CPU batches are compared
    through numpy (see ``NUMPY_ROWS``)."""
    rows = replicated.shape[0]
    small_cpu = replicated.device.type == "cpu" and index.device.type == "cpu"
    if 0 < rows <= NUMPY_ROWS and small_cpu:
        bits = _numpy_byte_rows(replicated, rows)
        where = index.numpy()
        row_of = np.zeros(num_requests, dtype=np.int64)
        row_of[where] = np.arange(rows)  # a row of each request (any one: all must be equal)
        consistent = bits[row_of[where]].tobytes() == bits.tobytes()  # one memcmp
        return replicated.index_select(0, torch.from_numpy(row_of)), consistent
    shared = replicated.new_zeros((num_requests, *replicated.shape[1:]))
    shared.index_copy_(0, index, replicated)
    return shared, not rows or rows_consistent(replicated, shared, index)
