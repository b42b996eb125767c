"""Rows of a ``KeyedJaggedTensor`` gathered by request: the replicated (drop-in) KJT of a
shared-layout one, as the original model takes it."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def replicated_kjt(kjt, candidate_to_request: torch.Tensor, request_keys: Iterable[str]):
    """The drop-in KJT of a shared-layout one: every key of ``request_keys`` gets the rows of
    ``candidate_to_request`` (one per candidate), the other keys stay as they are."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    request_keys = set(request_keys)
    sizes = kjt.length_per_key()
    lengths = kjt.lengths().split(kjt.stride_per_key())
    values = kjt.values().split(sizes)
    weights = kjt.weights_or_none()
    weights = weights.split(sizes) if weights is not None else [None] * len(sizes)
    out_lengths, out_values, out_weights = [], [], []
    for key, key_lengths, key_values, key_weights in zip(kjt.keys(), lengths, values, weights):
        if key in request_keys:
            key_lengths, key_values, key_weights = _gather_rows(
                key_lengths, key_values, key_weights, candidate_to_request
            )
        out_lengths.append(key_lengths)
        out_values.append(key_values)
        out_weights.append(key_weights)
    return KeyedJaggedTensor(
        keys=list(kjt.keys()),
        values=torch.cat(out_values),
        lengths=torch.cat(out_lengths),
        weights=torch.cat(out_weights) if weights[0] is not None else None,
    )


def _gather_rows(lengths, values, weights, index):
    """Rows ``index`` of one key's jagged rows: (lengths, values, weights)."""
    starts = torch.cumsum(lengths, 0) - lengths
    new_lengths = lengths.index_select(0, index)
    total = int(new_lengths.sum())
    new_starts = torch.cumsum(new_lengths, 0) - new_lengths
    shift = torch.repeat_interleave(
        starts.index_select(0, index) - new_starts, new_lengths, output_size=total
    )
    positions = torch.arange(total, device=values.device) + shift
    gathered = None if weights is None else weights.index_select(0, positions)
    return new_lengths, values.index_select(0, positions), gathered
