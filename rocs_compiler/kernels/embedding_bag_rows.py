"""Row-wise helper ops that normalization rewrites produce (not IKBO ops).

``rocs::embedding_bag_rows(weight, indices [B, L], mode, padding_idx)`` pools each row of a
fixed-length index matrix into one bag. It calls ``aten.embedding_bag`` exactly as
``nn.EmbeddingBag`` does for 2-D input, so results are bit-identical; unlike the flattened
spelling it is visibly row-wise.
"""

from __future__ import annotations

from typing import Optional

import torch


@torch.library.custom_op("rocs::embedding_bag_rows", mutates_args=())
def embedding_bag_rows(
    weight: torch.Tensor, indices: torch.Tensor, mode: int, padding_idx: Optional[int]
) -> torch.Tensor:
    rows, width = indices.shape
    offsets = torch.arange(0, rows * width, width, dtype=indices.dtype, device=indices.device)
    return torch.ops.aten.embedding_bag.padding_idx(
        weight, indices.reshape(-1), offsets, False, mode, False, None, False, padding_idx
    )[0]


@embedding_bag_rows.register_fake
def _(weight, indices, mode, padding_idx):
    return weight.new_empty((indices.shape[0], weight.shape[1]))


def embedding_bag_rows_reference(weight, indices, mode, padding_idx):
    """The spelling ``nn.EmbeddingBag`` uses for 2-D input."""
    return torch.nn.functional.embedding_bag(
        indices, weight, mode=("sum", "mean", "max")[mode], padding_idx=padding_idx
    )


REFERENCES = {"embedding_bag_rows": embedding_bag_rows_reference}
