"""History lengths of a batch's requests, and histories cut or padded to a width.

Histories are request tensors padded along dim 1 (``[R, W, ...]``) with a padding id. A
request's length is one past its last position holding anything but padding, in any of the
histories (as ``runtime/call/jagged.py`` reads it), or the length the loader gives, checked
against the ids: at most the width, and no id past it.

Identity the exchange relies on: a model that takes padded histories gives the same outputs
for any width at or past each request's length (what padding a batch to its longest already
assumes), so a rank's histories may be cut or padded to the longest request it receives.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..errors import InputError


def content_lengths(history: torch.Tensor, padding_id) -> torch.Tensor:
    """int64 ``[R]``: one past the last position of dim 1 where ``history`` holds anything but
    ``padding_id`` (0 for a history of padding only)."""
    content = history != padding_id
    if content.dim() > 2:
        content = content.flatten(2).any(2)
    positions = torch.arange(1, content.shape[1] + 1, device=history.device)
    return (content * positions).amax(1) if content.shape[1] else content.sum(1)


def request_lengths(
    request: Mapping[str, torch.Tensor],
    histories: Sequence[str],
    padding_id,
    given: torch.Tensor | None,
) -> torch.Tensor | None:
    """int64 ``[R]``: each request's history length (None without histories or given
    lengths). ``given`` lengths are refused, naming the request, when negative, past the
    histories' width, or short of an id the histories hold."""
    read = None
    for name in histories:
        lengths = content_lengths(request[name], padding_id)
        read = lengths if read is None else torch.maximum(read, lengths)
    if given is None:
        return read
    rows = next(iter(request.values())).shape[0]
    if given.dim() != 1 or given.shape[0] != rows or given.is_floating_point():
        raise InputError(
            f"lengths must be an integer tensor of a row per request ({rows}), got shape "
            f"{tuple(given.shape)} ({given.dtype})"
        )
    lengths = given.to(torch.int64)
    if rows and int(lengths.min()) < 0:
        row = int((lengths < 0).nonzero()[0])
        raise InputError(f"lengths holds {int(lengths[row])} for request {row}: negative")
    if histories:
        width = request[histories[0]].shape[1]
        if rows and int(lengths.max()) > width:
            row = int((lengths > width).nonzero()[0])
            raise InputError(
                f"lengths holds {int(lengths[row])} for request {row}, past the histories' "
                f"width {width} ({', '.join(histories)})"
            )
        short = lengths < read
        if bool(short.any()):
            row = int(short.nonzero()[0])
            raise InputError(
                f"lengths holds {int(lengths[row])} for request {row}, but its histories hold "
                f"ids up to position {int(read[row])} ({', '.join(histories)})"
            )
    return lengths


def fit_width(history: torch.Tensor, width: int, padding_id) -> torch.Tensor:
    """``history`` cut to ``width`` along dim 1, or padded there with ``padding_id``."""
    have = history.shape[1]
    if have >= width:
        return history.narrow(1, 0, width)
    pad = history.new_full((history.shape[0], width - have, *history.shape[2:]), padding_id)
    return torch.cat([history, pad], dim=1)
