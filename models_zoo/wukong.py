"""Wukong-style interaction stack (Zhang et al., 2024): FMB + LCB layers over [N, F, D].

Each layer maps X [N, F, D] to LayerNorm(cat(FMB(X), LCB(X)) + residual(X)):
    FMB(X) = MLP(LayerNorm(flatten(X X^T))) reshaped to [N, n_fmb, D]
    LCB(X) = W X with W [n_lcb, F] acting on the feature axis
The residual is X itself when the feature count is kept, else a linear map of X over
the feature axis.

Inputs, replicated layout (N rows):
    user_sparse  int64   [N, 4]  request    user id, age bucket, region, device
    user_dense   float32 [N, 8]  request    projected to 2 dense-feature embeddings
    item_sparse  int64   [N, 3]  candidate  item id, category, brand
Output: logit [N].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from . import _sampling as S
from ._layers import MLP, embedding, seeded

DESCRIPTION = "Wukong: 9 feature embeddings, 2 layers of FMB (bmm X X^T) + LCB (einsum), MLP"
REQUEST_INPUTS = ("user_sparse", "user_dense")

USER_VOCABS = (20_000, 20, 300, 50)
ITEM_VOCABS = (50_000, 1_000, 5_000)
USER_DENSE_DIM = 8
NUM_DENSE_EMBS = 2


class WukongLayer(nn.Module):
    def __init__(self, num_in: int, n_fmb: int, n_lcb: int, dim: int, fmb_hidden: int = 256):
        super().__init__()
        self.n_fmb, self.dim = n_fmb, dim
        self.fm_norm = nn.LayerNorm(num_in * num_in)
        self.fmb = MLP(num_in * num_in, [fmb_hidden, n_fmb * dim])
        self.lcb = nn.Parameter(torch.randn(n_lcb, num_in) / num_in**0.5)
        num_out = n_fmb + n_lcb
        if num_out != num_in:
            self.res = nn.Parameter(torch.randn(num_out, num_in) / num_in**0.5)
        else:
            self.res = None
        self.norm = nn.LayerNorm(dim)

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        B = X.shape[0]
        fm = torch.bmm(X, X.transpose(1, 2)).flatten(1)  # [N, F * F]
        fmb = self.fmb(self.fm_norm(fm)).view(B, self.n_fmb, self.dim)
        lcb = torch.einsum("mk,bkd->bmd", self.lcb, X)
        residual = X if self.res is None else torch.matmul(self.res, X)
        return self.norm(torch.cat([fmb, lcb], dim=1) + residual)


class Wukong(nn.Module):
    # apply_glm's conversion; a module of its own so the zoo imports without rocs_compiler
    __rocs_conversions__ = "models_zoo.glm_conversions"

    def __init__(
        self,
        emb_dim: int = 32,
        layers: Sequence[tuple[int, int]] = ((8, 8), (8, 8)),
        head: Sequence[int] = (256, 64),
    ):
        super().__init__()
        self.emb_dim = emb_dim
        self.user_tables = nn.ModuleList(embedding(v, emb_dim) for v in USER_VOCABS)
        self.item_tables = nn.ModuleList(embedding(v, emb_dim) for v in ITEM_VOCABS)
        self.dense_proj = nn.Linear(USER_DENSE_DIM, NUM_DENSE_EMBS * emb_dim)
        num = len(USER_VOCABS) + NUM_DENSE_EMBS + len(ITEM_VOCABS)
        blocks = []
        for n_fmb, n_lcb in layers:
            blocks.append(WukongLayer(num, n_fmb, n_lcb, emb_dim))
            num = n_fmb + n_lcb
        self.layers = nn.Sequential(*blocks)
        self.head = MLP(num * emb_dim, [*head, 1])

    def forward(
        self, user_sparse: torch.Tensor, user_dense: torch.Tensor, item_sparse: torch.Tensor
    ) -> torch.Tensor:
        dense = self.dense_proj(user_dense).view(-1, NUM_DENSE_EMBS, self.emb_dim)
        user = torch.stack([t(user_sparse[:, i]) for i, t in enumerate(self.user_tables)], 1)
        item = torch.stack([t(item_sparse[:, i]) for i, t in enumerate(self.item_tables)], 1)
        X = self.layers(torch.cat([user, dense, item], dim=1))  # [N, F, D]
        return self.head(X.reshape(X.size(0), -1)).squeeze(-1)


def build(seed: int = 0) -> Wukong:
    return seeded(Wukong, seed)


def make_batch(counts: Sequence[int], *, seed: int = 0, shuffle: bool = False):
    R, N = S.sizes(counts)
    g = S.generator(seed)
    kwargs = {
        "user_sparse": S.id_columns(g, R, USER_VOCABS),
        "user_dense": S.dense(g, R, USER_DENSE_DIM),
        "item_sparse": S.id_columns(g, N, ITEM_VOCABS),
    }
    return S.make(counts, g, shuffle, kwargs, REQUEST_INPUTS)
