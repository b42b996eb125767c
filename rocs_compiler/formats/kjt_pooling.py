"""TorchRec's pooled lookups (``EmbeddingBagCollection``) over padded, per-row features.

A ``KeyedJaggedTensor`` holds every key's rows as one flat ``values`` tensor cut by
``lengths``; ``nn.EmbeddingBag`` pools it with offsets, one op across the whole batch, which no
row-wise analysis can split by request. Here each key arrives as dense rows instead
(:class:`PaddedKJT`): ids ``[B, W]`` padded past each row's length, lengths ``[B]``, and
per-id weights ``[B, W]`` for weighted collections. Every op on them is row-wise, so the
lookups of request keys run once per request.

Identity, for a bag of ``n <= W`` ids ``x_j`` (weights ``w_j``, 1 when unweighted) padded with
any ids to width ``W``, ``E`` the table and ``m_j = [j < n]``::

    sum:  EB = sum_j  m_j * w_j * E[x_j]
    mean: EB = (sum_j m_j * E[x_j]) / max(n, 1)
    max:  EB = max_{j < n} E[x_j], and 0 when n == 0

which is what ``nn.EmbeddingBag`` computes for the bag (an empty bag pools to zeros), up to the
order of the additions. Masking selects (``where``), so a padded id's row never enters the sum,
even when it holds an infinity or a NaN.

``kjt_lookups.py`` puts :class:`PaddedEmbeddingBagCollection` in place of the model's
collections.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import CompileError
from .kjt_padded import PaddedKey, PaddedKJT


def pool(table: torch.Tensor, key: PaddedKey, mode: str, weighted: bool) -> torch.Tensor:
    """``nn.EmbeddingBag`` (``mode`` sum, mean or max) of each row of ``key``: ``[B, D]``."""
    ids, lengths = key.ids, key.lengths
    # Positions 1..W spelled from ids, not arange(W): the padded width is a size of the call
    # (a dynamic dim), which an arange would read as a scalar; this stays row-wise.
    positions = torch.ones_like(ids, dtype=torch.long).cumsum(1)
    valid = positions <= lengths.unsqueeze(1)  # [B, W]
    rows = torch.nn.functional.embedding(ids, table)  # [B, W, D]
    if weighted:
        rows = rows * key.weights.unsqueeze(2).to(rows.dtype)
    mask = valid.unsqueeze(2)
    # Fill values as 0-dim tensors: ``where`` with a Python scalar is an overload that PyTorch
    # does not tag elementwise.
    zero = torch.zeros((), dtype=rows.dtype, device=rows.device)
    if mode == "sum":
        return torch.where(mask, rows, zero).sum(1)
    if mode == "mean":
        count = lengths.clamp(min=1).unsqueeze(1).to(rows.dtype)
        return torch.where(mask, rows, zero).sum(1) / count
    if mode == "max":
        lowest = torch.full((), float("-inf"), dtype=rows.dtype, device=rows.device)
        peak = torch.where(mask, rows, lowest).amax(1)
        return torch.where((lengths > 0).unsqueeze(1), peak, zero)
    raise CompileError(f"EmbeddingBag mode {mode!r} is not supported (sum, mean or max)")


class PaddedEmbeddingBagCollection(nn.Module):
    """An ``EmbeddingBagCollection`` that takes :class:`PaddedKJT`; same ``KeyedTensor`` out
    (keys and column order of the original)."""

    def __init__(self, collection: nn.Module):
        super().__init__()
        self.collection = collection
        self._check(collection)

    @staticmethod
    def _check(collection: nn.Module) -> None:
        for name, bag in collection.embedding_bags.items():
            if bag.padding_idx is not None or bag.max_norm is not None:
                raise CompileError(
                    f"EmbeddingBag {name!r} has padding_idx or max_norm set; rocs pools "
                    "TorchRec's own tables, which set neither"
                )
            if collection.is_weighted() and bag.mode != "sum":
                raise CompileError(f"weighted EmbeddingBag {name!r} pools with {bag.mode!r}")

    def forward(self, features):
        from torchrec.modules.embedding_modules import get_embedding_names_by_table
        from torchrec.sparse.jagged_tensor import KeyedTensor

        if not isinstance(features, PaddedKJT):
            return self.collection(features)
        collection = self.collection
        configs = collection.embedding_bag_configs()
        weighted = collection.is_weighted()
        pooled, dims = [], []
        for config, bag in zip(configs, collection.embedding_bags.values()):
            for feature in config.feature_names:
                key = features.key(feature)
                pooled.append(pool(bag.weight, key, bag.mode, weighted).float())
                dims.append(config.embedding_dim)
        names = [n for table in get_embedding_names_by_table(configs) for n in table]
        return KeyedTensor(keys=names, values=torch.cat(pooled, dim=1), length_per_key=dims)
