"""DIN (Zhou et al., 2018): target attention over the user's behaviour history.

An activation unit scores every history position against the target item from
cat(h, t, h - t, h * t); padded positions get weight 0 and the weighted sum (no softmax,
as in the paper) is the user-interest vector for this target.

Inputs, replicated layout (N rows, L = 50):
    user_profile   int64 [N, 3]  request    user id, gender, age bucket
    hist_item_ids  int64 [N, L]  request    clicked items, most recent first, 0 = padding
    hist_cat_ids   int64 [N, L]  request    their categories, 0 = padding
    item_id        int64 [N]     candidate
    item_cat       int64 [N]     candidate
Output: logit [N].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from . import _sampling as S
from ._layers import MLP, embedding, seeded

DESCRIPTION = "DIN: activation-unit attention (PReLU MLP) over 50 behaviours, Dice MLP head"
REQUEST_INPUTS = ("user_profile", "hist_item_ids", "hist_cat_ids")

PROFILE_VOCABS = (20_000, 3, 10)
NUM_ITEMS = 50_000
NUM_CATS = 1_000
HIST_LEN = 50


class Dice(nn.Module):
    """Data-adaptive activation: p * x + (1 - p) * alpha * x with p = sigmoid(BN(x))."""

    def __init__(self, dim: int):
        super().__init__()
        self.bn = nn.BatchNorm1d(dim, affine=False, eps=1e-8)
        self.alpha = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = torch.sigmoid(self.bn(x))
        return p * x + (1 - p) * self.alpha * x


class ActivationUnit(nn.Module):
    def __init__(self, dim: int, hidden: Sequence[int] = (80, 40)):
        super().__init__()
        self.mlp = MLP(4 * dim, [*hidden, 1], activation=nn.PReLU)

    def forward(self, hist: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """hist [N, L, D], target [N, D] -> scores [N, L]."""
        t = target.unsqueeze(1).expand(-1, hist.size(1), -1)
        return self.mlp(torch.cat([hist, t, hist - t, hist * t], dim=-1)).squeeze(-1)


class DIN(nn.Module):
    def __init__(self, emb_dim: int = 16, head: Sequence[int] = (200, 80)):
        super().__init__()
        self.profile_tables = nn.ModuleList(embedding(v, emb_dim) for v in PROFILE_VOCABS)
        self.item_table = embedding(NUM_ITEMS, emb_dim, padding_idx=0)
        self.cat_table = embedding(NUM_CATS, emb_dim, padding_idx=0)
        item_dim = 2 * emb_dim
        self.attention = ActivationUnit(item_dim)
        in_dim = emb_dim * len(PROFILE_VOCABS) + 2 * item_dim
        layers: list[nn.Module] = []
        for width in head:
            layers += [nn.Linear(in_dim, width), Dice(width)]
            in_dim = width
        layers.append(nn.Linear(in_dim, 1))
        self.head = nn.Sequential(*layers)

    def item_embedding(self, item_ids: torch.Tensor, cat_ids: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.item_table(item_ids), self.cat_table(cat_ids)], dim=-1)

    def forward(
        self,
        user_profile: torch.Tensor,
        hist_item_ids: torch.Tensor,
        hist_cat_ids: torch.Tensor,
        item_id: torch.Tensor,
        item_cat: torch.Tensor,
    ) -> torch.Tensor:
        profile = [t(user_profile[:, i]) for i, t in enumerate(self.profile_tables)]
        hist = self.item_embedding(hist_item_ids, hist_cat_ids)  # [N, L, D]
        target = self.item_embedding(item_id, item_cat)  # [N, D]
        weights = self.attention(hist, target).masked_fill(hist_item_ids == 0, 0.0)
        interest = torch.matmul(weights.unsqueeze(1), hist).squeeze(1)  # [N, D]
        return self.head(torch.cat([*profile, interest, target], dim=-1)).squeeze(-1)


def build(seed: int = 0) -> DIN:
    return seeded(DIN, seed)


def make_batch(counts: Sequence[int], *, seed: int = 0, shuffle: bool = False):
    R, N = S.sizes(counts)
    g = S.generator(seed)
    lens = S.lengths(g, R, HIST_LEN)
    kwargs = {
        "user_profile": S.id_columns(g, R, PROFILE_VOCABS),
        "hist_item_ids": S.history(g, R, HIST_LEN, NUM_ITEMS, lens),
        "hist_cat_ids": S.history(g, R, HIST_LEN, NUM_CATS, lens),
        "item_id": S.ids(g, N, NUM_ITEMS),
        "item_cat": S.ids(g, N, NUM_CATS),
    }
    return S.make(counts, g, shuffle, kwargs, REQUEST_INPUTS)
