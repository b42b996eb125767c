"""The balancer's input contract: a :class:`~.batch.RequestBatch` is checked once here, and what
the check derives (candidates per request, history lengths) is passed on.

Refusals name the culprit: the input whose rows disagree, the candidate whose request does not
exist, the request without candidates, the request whose given length disagrees with its ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import InputError
from .batch import RequestBatch
from .histories import request_lengths


@dataclass(frozen=True)
class Checked:
    """A checked batch: candidates per request (int64 ``[R]``), history lengths (int64 ``[R]``
    or None) and the histories' width (0 without histories)."""

    counts: torch.Tensor
    lengths: torch.Tensor | None
    width: int


def check_batch(batch: RequestBatch, histories: Sequence[str], padding_id) -> Checked:
    """Checks ``batch`` and derives :class:`Checked`; raises :class:`InputError` naming the
    input, candidate or request at fault. A batch of no requests (and no candidates) passes."""
    if not batch.request:
        raise InputError("the batch has no request tensors: the balancer moves whole requests")
    index = batch.candidate_to_request
    if not isinstance(index, torch.Tensor) or index.dim() != 1 or index.dtype != torch.int64:
        got = type(index).__name__
        if isinstance(index, torch.Tensor):
            got = f"shape {tuple(index.shape)} ({index.dtype})"
        raise InputError(f"candidate_to_request must be an int64 tensor [N], got {got}")
    rows = _rows("request", batch.request)
    _rows("candidate", batch.candidate, index.shape[0])
    if index.numel():
        bad = (index < 0) | (index >= rows)
        if bool(bad.any()):
            row = int(bad.nonzero()[0])
            raise InputError(
                f"candidate {row} belongs to request {int(index[row])}, but the batch has "
                f"{rows} requests"
            )
    counts = torch.bincount(index, minlength=rows)
    if rows and bool((counts == 0).any()):
        request = int((counts == 0).nonzero()[0])
        raise InputError(
            f"request {request} has no candidates (candidate_to_request never names it): a "
            "request without candidates has no loss to train on; leave it out of the batch"
        )
    width = _width(batch, histories)
    lengths = request_lengths(batch.request, histories, padding_id, batch.lengths)
    return Checked(counts, lengths, width)


def _rows(kind: str, tensors: dict, want: int | None = None) -> int:
    """The tensors' common row count; raises naming the first that differs."""
    for name, value in tensors.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            raise InputError(f"{kind} input {name!r} is not a tensor with a row per {kind}")
        if want is None:
            want, first = value.shape[0], name
        elif value.shape[0] != want:
            against = f"input {first!r}" if kind == "request" else "candidate_to_request"
            raise InputError(
                f"{kind} input {name!r} has {value.shape[0]} rows, {against} {want}: every "
                f"{kind} tensor has a row per {kind}"
            )
    return 0 if want is None else want


def _width(batch: RequestBatch, histories: Sequence[str]) -> int:
    widths = {}
    for name in histories:
        value = batch.request.get(name)
        if value is None or value.dim() < 2:
            raise InputError(
                f"history {name!r} is not a request tensor padded along dim 1 (request tensors: "
                f"{list(batch.request)})"
            )
        widths[name] = value.shape[1]
    if len(set(widths.values())) > 1:
        raise InputError(f"histories of one batch are padded to different widths: {widths}")
    return next(iter(widths.values()), 0)
