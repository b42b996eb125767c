"""Requests packed into one shared-layout call, and the call's outputs split back per request.

Packing R checked requests (``schema.Request``) with ``n_r`` candidates each gives the layout
every compiled model takes (``docs/contract.md``): request rows stacked to ``[R, ...]``, candidate
rows concatenated to ``[N, ...]`` with ``N = sum(n_r)``, request r's candidates contiguous, and
``candidate_to_request = repeat_interleave(arange(R), n)``. The identity relied on is the
contract's exactness: row r of the request leaves gathered with that index is request r's row
repeated ``n_r`` times, so the call equals the original model on each request's replicated rows,
and every output row ``j`` of request r's block ``[start_r, start_r + n_r)`` belongs to it.

Plain module: no Ray, no HTTP; the deployment and the tests call it directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .schema import Request, Schema


@dataclass
class Jagged:
    """One jagged field of a batch (a KeyedJaggedTensor key): every row's ids back to back and
    each row's length."""

    values: torch.Tensor
    lengths: torch.Tensor


@dataclass
class Packed:
    """One shared-layout call: leaves by field name, ``candidate_to_request`` and the number of
    candidates of each request (in order)."""

    leaves: dict[str, torch.Tensor | Jagged]
    index: torch.Tensor
    counts: list[int]

    @property
    def num_requests(self) -> int:
        return len(self.counts)

    @property
    def num_candidates(self) -> int:
        return int(self.index.shape[0])


def pack(schema: Schema, requests: Sequence[Request]) -> Packed:
    """One call for ``requests``, in order (each checked by ``schema.check``)."""
    counts = [r.num_candidates for r in requests]
    leaves: dict[str, torch.Tensor | Jagged] = {}
    for f in schema.request_fields:
        rows = [r.request[f.name] for r in requests]
        leaves[f.name] = _jagged(rows) if f.jagged else _stack(rows)
    for f in schema.candidate_fields:
        blocks = [r.candidates[f.name] for r in requests]
        if f.jagged:
            leaves[f.name] = _jagged([row for block in blocks for row in block])
        elif isinstance(blocks[0], list):  # rows with a dim of any length
            leaves[f.name] = _stack([row for block in blocks for row in block])
        else:
            leaves[f.name] = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
    index = torch.repeat_interleave(
        torch.arange(len(counts)), torch.tensor(counts, dtype=torch.int64)
    )
    return Packed(leaves, index, counts)


def split(outputs: Any, counts: Sequence[int]) -> list[Any]:
    """The model's outputs for a packed call, one structure per request: every tensor with one
    row per candidate split into each request's rows; any other leaf given to every request."""
    leaves, spec = pytree.tree_flatten(outputs)
    total = sum(counts)
    counts = list(counts)
    columns = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() and leaf.shape[0] == total:
            columns.append(leaf.split(counts))
        else:
            columns.append([leaf] * len(counts))
    return [pytree.tree_unflatten([c[i] for c in columns], spec) for i in range(len(counts))]


def _stack(rows: list[torch.Tensor]) -> torch.Tensor:
    """Rows stacked along a new dim 0, each padded with zeros to the longest in every dim."""
    shapes = {tuple(r.shape) for r in rows}
    if len(shapes) == 1:
        return torch.stack(rows)
    ndim = rows[0].dim()
    widest = [max(r.shape[d] for r in rows) for d in range(ndim)]
    out = rows[0].new_zeros((len(rows), *widest))
    for i, row in enumerate(rows):
        out[(i, *(slice(0, s) for s in row.shape))] = row
    return out


def _jagged(rows: list[torch.Tensor]) -> Jagged:
    lengths = torch.tensor([r.shape[0] for r in rows], dtype=torch.int64)
    values = torch.cat(rows) if rows else torch.empty(0, dtype=torch.int64)
    return Jagged(values, lengths)
