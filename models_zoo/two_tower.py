"""Two-tower retrieval model: a deep user tower and an item tower scored by cosine similarity.

Inputs, replicated layout (N rows, L = 50):
    user_id        int64   [N]     request
    user_dense     float32 [N, 8]  request    activity statistics
    hist_item_ids  int64   [N, L]  request    recent items, 0 = padding (mean-pooled)
    item_id        int64   [N]     candidate
    item_cat       int64   [N]     candidate
    item_dense     float32 [N, 4]  candidate
Output: {"score": [N] cosine / temperature, "user_emb": [N, 64]}.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from . import _sampling as S
from ._layers import MLP, embedding, seeded

DESCRIPTION = "Two-tower: user tower (id, dense, EmbeddingBag mean history), item tower, cosine"
REQUEST_INPUTS = ("user_id", "user_dense", "hist_item_ids")

NUM_USERS = 20_000
NUM_ITEMS = 50_000
NUM_CATS = 1_000
USER_DENSE_DIM = 8
ITEM_DENSE_DIM = 4
HIST_LEN = 50


class TwoTower(nn.Module):
    def __init__(
        self,
        emb_dim: int = 32,
        user_tower: Sequence[int] = (256, 128, 64),
        item_tower: Sequence[int] = (128, 64),
        temperature: float = 0.05,
    ):
        super().__init__()
        self.temperature = temperature
        self.user_table = embedding(NUM_USERS, emb_dim)
        self.history_bag = nn.EmbeddingBag(NUM_ITEMS, emb_dim, mode="mean", padding_idx=0)
        nn.init.normal_(self.history_bag.weight, std=emb_dim**-0.5)
        with torch.no_grad():
            self.history_bag.weight[0].zero_()
        self.user_mlp = MLP(2 * emb_dim + USER_DENSE_DIM, user_tower)
        self.item_table = embedding(NUM_ITEMS, emb_dim)
        self.cat_table = embedding(NUM_CATS, emb_dim)
        self.item_mlp = MLP(2 * emb_dim + ITEM_DENSE_DIM, item_tower)

    def user_embedding(self, user_id, user_dense, hist_item_ids) -> torch.Tensor:
        feats = [self.user_table(user_id), self.history_bag(hist_item_ids), user_dense]
        return F.normalize(self.user_mlp(torch.cat(feats, dim=-1)), dim=-1)

    def item_embedding(self, item_id, item_cat, item_dense) -> torch.Tensor:
        feats = [self.item_table(item_id), self.cat_table(item_cat), item_dense]
        return F.normalize(self.item_mlp(torch.cat(feats, dim=-1)), dim=-1)

    def forward(
        self,
        user_id: torch.Tensor,
        user_dense: torch.Tensor,
        hist_item_ids: torch.Tensor,
        item_id: torch.Tensor,
        item_cat: torch.Tensor,
        item_dense: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        user = self.user_embedding(user_id, user_dense, hist_item_ids)
        item = self.item_embedding(item_id, item_cat, item_dense)
        score = (user * item).sum(dim=-1) / self.temperature
        return {"score": score, "user_emb": user}


def build(seed: int = 0) -> TwoTower:
    return seeded(TwoTower, seed)


def make_batch(counts: Sequence[int], *, seed: int = 0, shuffle: bool = False):
    R, N = S.sizes(counts)
    g = S.generator(seed)
    kwargs = {
        "user_id": S.ids(g, R, NUM_USERS),
        "user_dense": S.dense(g, R, USER_DENSE_DIM),
        "hist_item_ids": S.history(g, R, HIST_LEN, NUM_ITEMS),
        "item_id": S.ids(g, N, NUM_ITEMS),
        "item_cat": S.ids(g, N, NUM_CATS),
        "item_dense": S.dense(g, N, ITEM_DENSE_DIM),
    }
    return S.make(counts, g, shuffle, kwargs, REQUEST_INPUTS)
