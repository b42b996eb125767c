"""Target attention over an encoded user history (a TransAct-style ranker).

The user's recent items pass through a small transformer encoder (self-attention over the
history only); the candidate item then attends over the encoded history with scaled dot-product
attention. Written for replicated inputs, as a practitioner would.

Inputs, replicated layout (N rows, L = 64 by default; any L from 1 to HIST_LEN, the rows of the
positional table, with the length marked dynamic in the example):
    user_profile   int64   [N, 2]  request    user id bucket, country
    hist_item_ids  int64   [N, L]  request    recent items, 0 = padding
    item_id        int64   [N]     candidate
    item_cat       int64   [N]     candidate
Output: [N] logit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from . import _sampling as S
from ._layers import MLP, embedding, seeded

DESCRIPTION = "Target attention: transformer-encoded history, candidate attends over it (SDPA)"
REQUEST_INPUTS = ("user_profile", "hist_item_ids")

PROFILE_VOCABS = (10_000, 200)
NUM_ITEMS = 50_000
NUM_CATS = 1_000
HIST_LEN = 64


class EncoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.norm1 = nn.LayerNorm(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn), nn.GELU(), nn.Linear(ffn, dim))

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, dim // self.heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask[:, None, None, :])
        x = self.norm1(x + self.out(attn.transpose(1, 2).reshape(batch, length, dim)))
        return self.norm2(x + self.ffn(x))


class TargetAttention(nn.Module):
    def __init__(self, dim: int = 64, heads: int = 2, layers: int = 2, top: Sequence[int] = (256, 64)):
        super().__init__()
        self.heads = heads
        self.profile = nn.ModuleList(embedding(v, 16) for v in PROFILE_VOCABS)
        self.item_table = embedding(NUM_ITEMS, dim)
        self.cat_table = embedding(NUM_CATS, dim)
        self.position = nn.Parameter(torch.randn(HIST_LEN, dim) * 0.02)
        self.encoder = nn.ModuleList(EncoderLayer(dim, heads, 2 * dim) for _ in range(layers))
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)
        self.top = MLP(2 * 16 + 2 * dim, (*top, 1))

    def forward(self, user_profile, hist_item_ids, item_id, item_cat) -> torch.Tensor:
        batch = hist_item_ids.size(0)
        key_mask = hist_item_ids != 0
        # The first L rows of the positional table: any length up to its HIST_LEN rows.
        h = self.item_table(hist_item_ids) + self.position[: hist_item_ids.size(1)]
        for layer in self.encoder:
            h = layer(h, key_mask)
        target = self.item_table(item_id) + self.cat_table(item_cat)
        dim_head = target.shape[-1] // self.heads
        q = self.query(target).view(batch, self.heads, 1, dim_head)
        k = self.key(h).view(batch, -1, self.heads, dim_head).transpose(1, 2)
        v = self.value(h).view(batch, -1, self.heads, dim_head).transpose(1, 2)
        pooled = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask[:, None, None, :])
        profile = [table(user_profile[:, i]) for i, table in enumerate(self.profile)]
        features = torch.cat([*profile, pooled.reshape(batch, -1), target], dim=-1)
        return self.top(features).squeeze(-1)


def build(seed: int = 0) -> TargetAttention:
    return seeded(TargetAttention, seed)


def make_batch(counts: Sequence[int], *, seed: int = 0, shuffle: bool = False):
    R, N = S.sizes(counts)
    g = S.generator(seed)
    kwargs = {
        "user_profile": S.id_columns(g, R, PROFILE_VOCABS),
        "hist_item_ids": S.history(g, R, HIST_LEN, NUM_ITEMS),
        "item_id": S.ids(g, N, NUM_ITEMS),
        "item_cat": S.ids(g, N, NUM_CATS),
    }
    return S.make(counts, g, shuffle, kwargs, REQUEST_INPUTS)
