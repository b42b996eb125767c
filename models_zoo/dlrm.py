"""DLRM (Naumov et al., 2019): bottom MLP, embedding tables, pairwise dot interaction, top MLP.

Inputs, replicated layout (N rows, one per (request, candidate) pair):
    user_dense   float32 [N, 13]  request    continuous user/context features
    user_sparse  int64   [N, 4]   request    one id per user table
    item_sparse  int64   [N, 3]   candidate  item id, category, brand
Output: logit [N].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from . import _sampling as S
from ._layers import MLP, embedding, seeded

DESCRIPTION = "DLRM: bottom MLP + 7 tables, pairwise dot interaction (bmm, triu select), top MLP"
REQUEST_INPUTS = ("user_dense", "user_sparse")

DENSE_DIM = 13
USER_VOCABS = (20_000, 500, 100, 2_000)
ITEM_VOCABS = (50_000, 1_000, 5_000)


class DLRM(nn.Module):
    def __init__(
        self,
        dense_dim: int = DENSE_DIM,
        user_vocabs: Sequence[int] = USER_VOCABS,
        item_vocabs: Sequence[int] = ITEM_VOCABS,
        emb_dim: int = 32,
        bottom: Sequence[int] = (128, 64),
        top: Sequence[int] = (256, 128),
    ):
        super().__init__()
        self.bottom = MLP(dense_dim, [*bottom, emb_dim], last_activation=True)
        self.user_tables = nn.ModuleList(embedding(v, emb_dim) for v in user_vocabs)
        self.item_tables = nn.ModuleList(embedding(v, emb_dim) for v in item_vocabs)
        num_features = 1 + len(user_vocabs) + len(item_vocabs)
        # Strictly lower triangle of the F x F dot-product matrix: each pair once, no self-dots.
        li, lj = torch.tril_indices(num_features, num_features, offset=-1)
        self.register_buffer("li", li, persistent=False)
        self.register_buffer("lj", lj, persistent=False)
        self.top = MLP(emb_dim + li.numel(), [*top, 1])

    def forward(
        self, user_dense: torch.Tensor, user_sparse: torch.Tensor, item_sparse: torch.Tensor
    ) -> torch.Tensor:
        dense_out = self.bottom(user_dense)
        user_embs = [table(user_sparse[:, i]) for i, table in enumerate(self.user_tables)]
        item_embs = [table(item_sparse[:, i]) for i, table in enumerate(self.item_tables)]
        T = torch.stack([dense_out, *user_embs, *item_embs], dim=1)  # [N, F, D]
        Z = torch.bmm(T, T.transpose(1, 2))  # [N, F, F]
        pairs = Z[:, self.li, self.lj]  # [N, F * (F - 1) / 2]
        return self.top(torch.cat([dense_out, pairs], dim=1)).squeeze(-1)


def build(seed: int = 0) -> DLRM:
    return seeded(DLRM, seed)


def make_batch(counts: Sequence[int], *, seed: int = 0, shuffle: bool = False):
    R, N = S.sizes(counts)
    g = S.generator(seed)
    kwargs = {
        "user_dense": S.dense(g, R, DENSE_DIM),
        "user_sparse": S.id_columns(g, R, USER_VOCABS),
        "item_sparse": S.id_columns(g, N, ITEM_VOCABS),
    }
    return S.make(counts, g, shuffle, kwargs, REQUEST_INPUTS)
