"""The contract of ``candidate_to_request``, checked in one place.

``candidate_to_request`` is a ``torch.Tensor`` of dtype int64 and shape ``[N]`` whose values lie
in ``[0, R)``: entry n is the request row of candidate n. The runtime checks it once per call
before the compiled graph runs; a ``rocs::`` op called on its own checks it in its body; the
compiled program's direct op calls and the Triton launchers rely on those checks. Each failure
has one message and one exception type, which is both an :class:`InputError` and the builtin
error Python code expects for it (``TypeError`` for the type, ``IndexError`` for the range).

A serving caller that builds the index itself may skip the checks that read its values (the range
and, for R = N, the permutation check; on CUDA each is a device sync) with
``with rocs.trusted_index(): ...``; the type, dtype, shape and device checks still run.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Optional

import torch

from ..errors import InputError
from ..ir.graph_meta import INDEX_NAME


_SMALL = 64  # indexes up to this length are range-checked in Python
_TRUSTED = contextvars.ContextVar("rocs_trusted_index", default=False)


class trusted_index(contextlib.ContextDecorator):  # noqa: N801 - used as a function
    """Within this context, compiled models take ``candidate_to_request`` values on trust.

    For serving code that builds the index itself. A value outside ``[0, R)`` is then not
    reported as :class:`IndexRangeError`: an op may fail on it, compute garbage or, on CUDA,
    read out of bounds. A KJT's inverse indices, in a bucket that runs the original model as
    called, are not read at all: the model reads them itself. The setting is per thread (and
    asyncio task).

    A class rather than a generator context manager: entered once per served call, it costs
    a context variable's set and reset and nothing more.
    """

    def __enter__(self) -> None:
        self._token = _TRUSTED.set(True)

    def __exit__(self, *exc_info: Any) -> None:
        _TRUSTED.reset(self._token)

    def _recreate_cm(self) -> "trusted_index":
        return type(self)()  # as a decorator: one token per call, whatever the nesting


def index_trusted() -> bool:
    """True inside :func:`trusted_index`."""
    return _TRUSTED.get()


class IndexTypeError(InputError, TypeError):
    """``candidate_to_request`` is not an int64 tensor."""


class IndexRangeError(InputError, IndexError):
    """A value of ``candidate_to_request`` is not a request row."""


def check_candidate_to_request(
    index: Any,
    num_candidates: Optional[int],
    num_requests: Optional[int],
    *,
    device: Optional[torch.device] = None,
    where: str = "",
    check_range: bool = True,
) -> None:
    """Raise unless ``index`` is int64 ``[num_candidates]`` on ``device`` with values in
    ``[0, num_requests)``.

    ``num_candidates=None`` accepts any length and ``device=None`` any device; ``num_requests=None``
    or ``check_range=False`` skips the range check (it reads the values: a device sync on CUDA).
    """
    prefix = f"{where}: " if where else ""
    if not isinstance(index, torch.Tensor):
        raise IndexTypeError(
            f"{prefix}{INDEX_NAME} must be a torch.Tensor (int64 [N]), got {type(index).__name__}"
        )
    if index.dtype != torch.int64:
        raise IndexTypeError(f"{prefix}{INDEX_NAME} must have dtype torch.int64, got {index.dtype}")
    if index.dim() != 1:
        raise InputError(f"{prefix}{INDEX_NAME} must be 1-D [N], got shape {tuple(index.shape)}")
    if device is not None and index.device != device:
        raise InputError(f"{prefix}{INDEX_NAME} is on {index.device} but the inputs are on {device}")
    if num_candidates is not None and index.shape[0] != num_candidates:
        raise InputError(
            f"{prefix}{INDEX_NAME} has {index.shape[0]} entries but the candidate inputs have "
            f"{num_candidates} rows"
        )
    if check_range and num_requests is not None:
        check_index_range(index, num_requests, where=where)


def index_bounds(index: torch.Tensor) -> tuple[int, int]:
    """(min, max) of a non-empty int64 ``[N]`` ``index``, read with one device sync."""
    if not index.is_cuda:
        if index.shape[0] <= _SMALL:  # reading a few values beats a reduction and two reads
            values = index.tolist()
            return min(values), max(values)
        low, high = torch.aminmax(index)
        return low.item(), high.item()
    low, high = torch.stack(torch.aminmax(index)).tolist()
    return low, high


def distinct_values(index: torch.Tensor) -> int:
    """The number of distinct values of the int64 ``[N]`` ``index`` (a device sync on CUDA)."""
    if not index.is_cuda and index.shape[0] <= _SMALL:  # a set of a few values beats a sort
        return len(set(index.tolist()))
    return int(torch.unique(index).numel())


def check_index_range(index: torch.Tensor, num_requests: int, *, where: str = "") -> int:
    """Raise unless every value of the int64 ``[N]`` ``index`` lies in ``[0, num_requests)``;
    return the largest value plus one (0 for an empty index): the requests it reaches."""
    if index.shape[0] == 0:
        return 0
    low, high = index_bounds(index)
    if low < 0 or high >= num_requests:
        raise out_of_range(low, high, num_requests, where)
    return high + 1


def out_of_range(low: int, high: int, num_requests: int, where: str = "") -> IndexRangeError:
    """The error for an index whose values span ``[low, high]`` against ``num_requests`` rows."""
    prefix = f"{where}: " if where else ""
    return IndexRangeError(
        f"{prefix}{INDEX_NAME} values must lie in [0, {num_requests}) (R = rows of the "
        f"request inputs); got values in [{low}, {high}]"
    )
