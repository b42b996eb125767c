"""GLM masking: the mask ``[[1, 0], [1, 1]]``, its parametrization ``W = W_raw * mask``, the
block-lower-triangular base of the masked layers, and the column ranges of request lanes.

A masked weight's request rows read request columns only, wherever the lanes sit: ``take``
gathers a layer's request (or candidate) columns, ``interleave`` puts the two groups' outputs
back at their columns, so ``cat`` of the per-group results equals the plain layer's output
with the masked block zero. A state dict of the unmasked layer loads with that block zeroed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn.utils import parametrize


def glm_mask(
    in_request: int, in_candidate: int, out_request: int, out_candidate: int
) -> torch.Tensor:
    """The GLM mask ``[[1, 0], [1, 1]]`` of shape [out, in]: request rows see request columns only."""
    mask = torch.ones(out_request + out_candidate, in_request + in_candidate)
    mask[:out_request, in_request:] = 0
    return mask


class BlockMask(nn.Module):
    """Parametrization ``W = W_raw * mask`` with a constant (non-trainable) mask buffer."""

    def __init__(self, mask: torch.Tensor):
        super().__init__()
        self.register_buffer("mask", mask)

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * self.mask

    def right_inverse(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * self.mask


def _check_groups(
    kind: str, in_request: int, in_candidate: int, out_request: int, out_candidate: int
):
    sizes = (in_request, in_candidate, out_request, out_candidate)
    if (
        any(s < 0 for s in sizes)
        or in_request + in_candidate == 0
        or out_request + out_candidate == 0
    ):
        raise ValueError(
            f"{kind}: group sizes must be >= 0 with non-empty input and output: {sizes}"
        )
    if out_request > 0 and in_request == 0:
        raise ValueError(
            f"{kind}: {out_request} request outputs but no request inputs (they could only be constants)"
        )


def init_rows(weight: torch.Tensor, bias: torch.Tensor | None, fans: Sequence[tuple[int, int]]):
    """nn.Linear's default init, with each row block drawn for its own fan-in."""
    with torch.no_grad():
        start = 0
        for rows, fan_in in fans:
            bound = 1.0 / math.sqrt(max(fan_in, 1))
            weight[start : start + rows].uniform_(-bound, bound)
            if bias is not None:
                bias[start : start + rows].uniform_(-bound, bound)
            start += rows


Ranges = tuple[tuple[int, int], ...]


def as_ranges(ranges: Sequence[tuple[int, int]] | None, prefix: int) -> Ranges:
    return ((0, prefix),) if ranges is None else tuple((int(a), int(b)) for a, b in ranges)


def complement(ranges: Ranges, width: int) -> Ranges:
    out, start = [], 0
    for a, b in ranges:
        if a > start:
            out.append((start, a))
        start = b
    return tuple(out + ([(start, width)] if start < width else []))


def take(t: torch.Tensor | None, ranges: Ranges, dim: int = -1) -> torch.Tensor | None:
    """The ``ranges`` of ``t`` along ``dim``, concatenated (one range: a slice)."""
    if t is None:
        return None
    pieces = [t.narrow(dim, a, b - a) for a, b in ranges]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def _lanes_mask(out: int, inp: int, request_out: Ranges, request_in: Ranges) -> torch.Tensor:
    """The GLM mask [out, in]: zero where a request output row meets a candidate input column."""
    rows = torch.zeros(out, dtype=torch.bool)
    cols = torch.zeros(inp, dtype=torch.bool)
    for a, b in request_out:
        rows[a:b] = True
    for a, b in request_in:
        cols[a:b] = True
    return (~(rows[:, None] & ~cols[None, :])).float()


class BlockLowerTriangular(nn.Module):
    """A module whose ``weight`` [out, in] keeps the GLM mask: request rows read request inputs only.

    ``request_in`` / ``request_out`` are the (start, stop) ranges of the request columns of the
    input and of the request rows of the output (default: the first ``in_request`` /
    ``out_request``). Subclasses set ``self.weight`` and then call ``_mask_weight()``. A state
    dict of the unmasked layer (a plain ``weight``) loads with the masked entries zeroed.
    """

    def __init__(
        self,
        layer: str,
        in_request: int,
        in_candidate: int,
        out_request: int,
        out_candidate: int,
        request_in: Sequence[tuple[int, int]] | None = None,
        request_out: Sequence[tuple[int, int]] | None = None,
    ):
        super().__init__()
        _check_groups(layer, in_request, in_candidate, out_request, out_candidate)
        self.in_request, self.in_candidate = in_request, in_candidate
        self.out_request, self.out_candidate = out_request, out_candidate
        self.request_in = as_ranges(request_in, in_request)
        self.request_out = as_ranges(request_out, out_request)
        width_in, width_out = in_request + in_candidate, out_request + out_candidate
        if (
            sum(b - a for a, b in self.request_in) != in_request
            or any(b > width_in for _, b in self.request_in)
            or sum(b - a for a, b in self.request_out) != out_request
            or any(b > width_out for _, b in self.request_out)
        ):
            raise ValueError(
                f"{layer}: lane ranges {self.request_in} -> {self.request_out} do not hold "
                f"{in_request} -> {out_request} request lanes"
            )
        self.prefix = self.request_in == ((0, in_request),) and self.request_out == (
            (0, out_request),
        )

    def _mask_weight(self) -> None:
        mask = _lanes_mask(
            self.out_request + self.out_candidate,
            self.in_request + self.in_candidate,
            self.request_out,
            self.request_in,
        )
        parametrize.register_parametrization(self, "weight", BlockMask(mask))
        self.register_load_state_dict_pre_hook(_load_plain_weight)

    @property
    def mask(self) -> torch.Tensor:
        return self.parametrizations.weight[0].mask


def _load_plain_weight(module, state_dict, prefix, *_) -> None:
    """Read a plain layer's ``weight`` as the raw weight with the masked block zeroed."""
    plain, raw = prefix + "weight", prefix + "parametrizations.weight.original"
    if plain in state_dict and raw not in state_dict:
        state_dict[raw] = state_dict.pop(plain) * module.mask
        state_dict.setdefault(prefix + "parametrizations.weight.0.mask", module.mask)


def interleave(
    request: torch.Tensor, candidate: torch.Tensor, rows: Ranges, width: int
) -> list[torch.Tensor]:
    """Slices of ``request`` and ``candidate`` (their columns in output order) put back in the
    order of the output's ``width`` columns, request columns at ``rows``."""
    pieces, taken = [], {"r": 0, "c": 0}
    other = complement(rows, width)
    segments = sorted([(a, b, "r") for a, b in rows] + [(a, b, "c") for a, b in other])
    for a, b, group in segments:
        source = request if group == "r" else candidate
        pieces.append(source[..., taken[group] : taken[group] + b - a])
        taken[group] += b - a
    return pieces
