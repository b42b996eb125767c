"""A ``KeyedJaggedTensor``'s lengths against its values, checked before its keys are padded
(``kjt.py``): TorchRec itself reads lengths that are negative or do not add up to the values
without a word, or fails deep in a split."""

from __future__ import annotations

import torch

from ..errors import InputError


def check_lengths(argument: str, kjt) -> None:
    """Refuse a KJT (the model's argument ``argument``) whose lengths are negative or do not add
    up to its values, naming the key."""
    lengths, total = kjt.lengths(), kjt.values().shape[0]
    if not lengths.numel():
        return
    low, stated = torch.stack([lengths.min(), lengths.sum()]).tolist()  # one read of the device
    if low < 0:
        at = int((lengths < 0).nonzero()[0])
        key, row = _key_row(kjt.keys(), kjt.stride_per_key(), at)
        raise InputError(
            f"KeyedJaggedTensor {argument!r}: key {key!r} has a negative length "
            f"({int(lengths[at])}) at row {row}"
        )
    if stated != total:
        raise InputError(
            f"KeyedJaggedTensor {argument!r}: its lengths add up to {stated} ids but it holds "
            f"{total} values (ids per key: {dict(zip(kjt.keys(), kjt.length_per_key()))})"
        )


def _key_row(keys, strides, at: int) -> tuple[str, int]:
    """The key and row of position ``at`` of a KJT's lengths (``strides``: rows per key)."""
    for key, stride in zip(keys, strides):
        if at < stride:
            return key, at
        at -= stride
    return keys[-1], at
