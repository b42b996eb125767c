"""DCNv2 (Wang et al., 2021), stacked: low-rank cross network on x0, then a deep MLP.

Inputs, replicated layout (N rows):
    user_dense   float32 [N, 8]  request    continuous user/context features
    user_sparse  int64   [N, 3]  request    user id, age bucket, region
    item_sparse  int64   [N, 3]  candidate  item id, category, seller
    item_dense   float32 [N, 4]  candidate  price, age, popularity, ...
Output: logit [N].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from . import _sampling as S
from ._layers import MLP, embedding, seeded

DESCRIPTION = "DCNv2 (stacked): x0 = cat(dense, 6 embs), 3 low-rank cross layers, deep MLP"
REQUEST_INPUTS = ("user_dense", "user_sparse")

USER_DENSE_DIM = 8
ITEM_DENSE_DIM = 4
USER_VOCABS = (20_000, 20, 300)
ITEM_VOCABS = (50_000, 1_000, 3_000)


class CrossLayer(nn.Module):
    """x_{l+1} = x0 * (W x_l + b) + x_l, with W = U V (rank r) or full rank when r is None."""

    def __init__(self, dim: int, rank: int | None = None):
        super().__init__()
        if rank is None:
            self.w = nn.Linear(dim, dim)
        else:
            self.w = nn.Sequential(nn.Linear(dim, rank, bias=False), nn.Linear(rank, dim))

    def forward(self, x0: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x0 * self.w(x) + x


class DCNv2(nn.Module):
    # apply_glm's conversion; a module of its own so the zoo imports without rocs_compiler
    __rocs_conversions__ = "models_zoo.glm_conversions"

    def __init__(
        self,
        emb_dim: int = 16,
        num_cross: int = 3,
        rank: int | None = 32,
        deep: Sequence[int] = (256, 128),
    ):
        super().__init__()
        self.user_tables = nn.ModuleList(embedding(v, emb_dim) for v in USER_VOCABS)
        self.item_tables = nn.ModuleList(embedding(v, emb_dim) for v in ITEM_VOCABS)
        dim = USER_DENSE_DIM + ITEM_DENSE_DIM + emb_dim * (len(USER_VOCABS) + len(ITEM_VOCABS))
        self.cross = nn.ModuleList(CrossLayer(dim, rank) for _ in range(num_cross))
        self.deep = MLP(dim, deep, dropout=0.1, last_activation=True)
        self.head = nn.Linear(deep[-1], 1)

    def forward(
        self,
        user_dense: torch.Tensor,
        user_sparse: torch.Tensor,
        item_sparse: torch.Tensor,
        item_dense: torch.Tensor,
    ) -> torch.Tensor:
        embs = [t(user_sparse[:, i]) for i, t in enumerate(self.user_tables)]
        embs += [t(item_sparse[:, i]) for i, t in enumerate(self.item_tables)]
        x0 = torch.cat([user_dense, *embs, item_dense], dim=-1)
        x = x0
        for layer in self.cross:
            x = layer(x0, x)
        return self.head(self.deep(x)).squeeze(-1)


def build(seed: int = 0) -> DCNv2:
    return seeded(DCNv2, seed)


def make_batch(counts: Sequence[int], *, seed: int = 0, shuffle: bool = False):
    R, N = S.sizes(counts)
    g = S.generator(seed)
    kwargs = {
        "user_dense": S.dense(g, R, USER_DENSE_DIM),
        "user_sparse": S.id_columns(g, R, USER_VOCABS),
        "item_sparse": S.id_columns(g, N, ITEM_VOCABS),
        "item_dense": S.dense(g, N, ITEM_DENSE_DIM),
    }
    return S.make(counts, g, shuffle, kwargs, REQUEST_INPUTS)
