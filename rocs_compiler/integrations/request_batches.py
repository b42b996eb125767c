"""Training batches made of whole requests (RecD's batching), for a training compile.

A training compile computes the request side once per request of a batch, so a batch gains in
proportion to the impressions per request it holds. Logged impressions of one request (same user,
same moment) usually sit near each other in a log but not in one shuffled batch.
:func:`request_batches` reads the dataset's request ids in windows of ``window`` consecutive rows,
groups each window's rows by request id, shuffles the requests (not the rows), and packs whole
requests into batches of at most ``max_impressions`` rows (a larger request forms a batch of its
own). Each batch lists the dataset rows in request order and ``candidate_to_request``, and
``request_rows`` (the first row of each request) selects the rows to take request features from:
the shared layout of ``rocs.compile(..., training=True)``.

Loss of IID-ness (stated, not hidden): impressions of one request always share a batch, so a
batch's gradient averages correlated examples and the order of examples is shuffled only across
requests and only within a window. Models trained this way see the same examples per epoch but a
different batch composition than with row-level shuffling; RecD (MLSys 2023) reports no quality
loss with request-grouped batches, but measure on your data (``window`` bounds how far apart two
impressions of one request may be found; a request split across two windows forms two requests,
which stays exact).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RequestBatch:
    """One batch: ``rows`` (int64 [N], dataset rows, grouped by request), ``candidate_to_request``
    (int64 [N], values in [0, R)) and ``request_rows`` (int64 [R], a dataset row of each request)."""

    rows: torch.Tensor
    candidate_to_request: torch.Tensor
    request_rows: torch.Tensor


def request_batches(
    request_ids: Sequence[int] | torch.Tensor,
    max_impressions: int,
    window: int = 65536,
    *,
    generator: torch.Generator | None = None,
    drop_last: bool = False,
) -> Iterator[RequestBatch]:
    """Batches of whole requests over a dataset whose row ``i`` belongs to request
    ``request_ids[i]`` (the module docstring has the method and what it costs in IID-ness).

    Every row appears in exactly one batch per pass; ``drop_last`` drops the last, smaller batch
    of each window.
    """
    if max_impressions < 1 or window < 1:
        raise ValueError("max_impressions and window must be positive")
    ids = torch.as_tensor(request_ids, dtype=torch.int64)
    if ids.dim() != 1:
        raise ValueError(f"request_ids must be 1-D, got shape {tuple(ids.shape)}")
    for start in range(0, ids.shape[0], window):
        yield from _window_batches(
            ids[start : start + window], start, max_impressions, generator, drop_last
        )


def _window_batches(ids, offset, max_impressions, generator, drop_last) -> Iterator[RequestBatch]:
    # Group by request id (stable, so rows of a request keep their log order).
    order = torch.argsort(ids, stable=True)
    _, counts = torch.unique_consecutive(ids[order], return_counts=True)
    groups = list(torch.split(order + offset, counts.tolist()))
    permutation = torch.randperm(len(groups), generator=generator).tolist()
    batch: list[torch.Tensor] = []
    size = 0
    for i in permutation:
        group = groups[i]
        if batch and size + group.shape[0] > max_impressions:
            yield _batch(batch)
            batch, size = [], 0
        batch.append(group)
        size += group.shape[0]
    if batch and not (drop_last and size < max_impressions):
        yield _batch(batch)


def _batch(groups: list[torch.Tensor]) -> RequestBatch:
    counts = torch.tensor([g.shape[0] for g in groups])
    index = torch.repeat_interleave(torch.arange(len(groups)), counts)
    return RequestBatch(torch.cat(groups), index, torch.stack([g[0] for g in groups]))
