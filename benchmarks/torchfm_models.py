"""Two models written as pytorch-fm (torchfm) writes them, for the no-regression benchmark.

torchfm's models take one int64 tensor ``x`` of field ids ``[B, F]`` and offset every field into
one shared table (``FeaturesLinear``, ``FeaturesEmbedding``); the request features are the first
fields, named by column range (``"x[:, 0:3]"``). Both models have next to nothing to share at
these sizes (a lookup per user field), so a compiled call's cost over eager is its per-call
floor:

- ``lr``: ``LogisticRegressionModel``, a sigmoid over the linear part;
- ``fm``: ``FactorizationMachineModel``, the linear part plus the factorization-machine term
  over 16-wide field embeddings.

:func:`draw` gives a batch in the call's layout: ``x`` with the user fields replicated to the
candidates (how torchfm models are called) and ``candidate_to_request``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

FIELDS = (1000, 50, 20, 5000, 300, 40)  # field vocabularies: 3 user fields, then 3 item fields
USER_FIELDS = 3
REQUEST = (f"x[:, 0:{USER_FIELDS}]",)
EMBED_DIM = 16


class FeaturesLinear(nn.Module):
    def __init__(self, field_dims: Sequence[int], output_dim: int = 1):
        super().__init__()
        self.fc = nn.Embedding(sum(field_dims), output_dim)
        self.bias = nn.Parameter(torch.zeros((output_dim,)))
        self.offsets = np.array((0, *np.cumsum(field_dims)[:-1]), dtype=np.int64)

    def forward(self, x):
        x = x + x.new_tensor(self.offsets).unsqueeze(0)
        return torch.sum(self.fc(x), dim=1) + self.bias


class FeaturesEmbedding(nn.Module):
    def __init__(self, field_dims: Sequence[int], embed_dim: int):
        super().__init__()
        self.embedding = nn.Embedding(sum(field_dims), embed_dim)
        self.offsets = np.array((0, *np.cumsum(field_dims)[:-1]), dtype=np.int64)
        nn.init.xavier_uniform_(self.embedding.weight.data)

    def forward(self, x):
        x = x + x.new_tensor(self.offsets).unsqueeze(0)
        return self.embedding(x)


class FactorizationMachine(nn.Module):
    def __init__(self, reduce_sum: bool = True):
        super().__init__()
        self.reduce_sum = reduce_sum

    def forward(self, x):
        square_of_sum = torch.sum(x, dim=1) ** 2
        sum_of_square = torch.sum(x**2, dim=1)
        ix = square_of_sum - sum_of_square
        if self.reduce_sum:
            ix = torch.sum(ix, dim=1, keepdim=True)
        return 0.5 * ix


class LogisticRegressionModel(nn.Module):
    def __init__(self, field_dims: Sequence[int] = FIELDS):
        super().__init__()
        self.linear = FeaturesLinear(field_dims)

    def forward(self, x):
        return torch.sigmoid(self.linear(x).squeeze(1))


class FactorizationMachineModel(nn.Module):
    def __init__(self, field_dims: Sequence[int] = FIELDS, embed_dim: int = EMBED_DIM):
        super().__init__()
        self.embedding = FeaturesEmbedding(field_dims, embed_dim)
        self.linear = FeaturesLinear(field_dims)
        self.fm = FactorizationMachine(reduce_sum=True)

    def forward(self, x):
        x = self.linear(x) + self.fm(self.embedding(x))
        return torch.sigmoid(x.squeeze(1))


MODELS = {"lr": LogisticRegressionModel, "fm": FactorizationMachineModel}


def draw(counts: Sequence[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, candidate_to_request)`` for ``len(counts)`` requests of ``counts[r]`` candidates."""
    g = torch.Generator().manual_seed(seed)
    index = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(list(counts)))
    n = index.shape[0]
    user_fields = FIELDS[:USER_FIELDS]
    user = torch.stack([torch.randint(0, v, (len(counts),), generator=g) for v in user_fields], 1)
    item = torch.stack([torch.randint(0, v, (n,), generator=g) for v in FIELDS[USER_FIELDS:]], 1)
    return torch.cat([user[index], item], 1), index
