"""BST-style transformer (Chen et al., 2019): history plus target item as one sequence.

The target item is appended as the last token; two post-LN encoder layers (one written
with `scaled_dot_product_attention`, one with `nn.MultiheadAttention`) mix all tokens
under a key padding mask, and the flattened token states join the user profile in an MLP.

Inputs, replicated layout (N rows, L = 20):
    user_profile   int64   [N, 3]  request    user id, gender, age bucket
    user_dense     float32 [N, 6]  request    activity statistics
    hist_item_ids  int64   [N, L]  request    watched items, 0 = padding
    item_id        int64   [N]     candidate
Output: logit [N].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from . import _sampling as S
from ._layers import MLP, embedding, seeded

DESCRIPTION = "BST: 20 history + target tokens, SDPA layer + nn.MultiheadAttention layer, MLP"
REQUEST_INPUTS = ("user_profile", "user_dense", "hist_item_ids")

PROFILE_VOCABS = (20_000, 3, 10)
USER_DENSE_DIM = 6
NUM_ITEMS = 50_000
HIST_LEN = 20


class SDPAEncoderLayer(nn.Module):
    """Post-LN transformer encoder layer with fused QKV and a boolean padding mask."""

    def __init__(self, dim: int, heads: int, ffn: int, dropout: float = 0.1):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.norm1 = nn.LayerNorm(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn), nn.LeakyReLU(), nn.Linear(ffn, dim))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        """x [N, L, D], padding bool [N, L] (True = ignore this key)."""
        B, L, D = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        keep = ~padding[:, None, None, :]  # [N, 1, 1, L]
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        a = a.transpose(1, 2).reshape(B, L, D)
        x = self.norm1(x + self.dropout(self.out(a)))
        return self.norm2(x + self.dropout(self.ffn(x)))


class MHAEncoderLayer(nn.Module):
    """The same layer built on nn.MultiheadAttention."""

    def __init__(self, dim: int, heads: int, ffn: int, dropout: float = 0.1):
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.norm1 = nn.LayerNorm(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn), nn.LeakyReLU(), nn.Linear(ffn, dim))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        a, _ = self.attn(x, x, x, key_padding_mask=padding, need_weights=False)
        x = self.norm1(x + self.dropout(a))
        return self.norm2(x + self.dropout(self.ffn(x)))


class BST(nn.Module):
    # apply_dca's conversion; a module of its own so the zoo imports without rocs_compiler
    __rocs_conversions__ = "models_zoo.dca_conversions"

    def __init__(
        self,
        emb_dim: int = 32,
        heads: int = 4,
        ffn: int = 128,
        head: Sequence[int] = (512, 128),
    ):
        super().__init__()
        self.profile_tables = nn.ModuleList(embedding(v, 16) for v in PROFILE_VOCABS)
        self.item_table = embedding(NUM_ITEMS, emb_dim, padding_idx=0)
        self.position = nn.Parameter(torch.randn(HIST_LEN + 1, emb_dim) * 0.02)
        self.layers = nn.ModuleList(
            [SDPAEncoderLayer(emb_dim, heads, ffn), MHAEncoderLayer(emb_dim, heads, ffn)]
        )
        in_dim = 16 * len(PROFILE_VOCABS) + USER_DENSE_DIM + (HIST_LEN + 1) * emb_dim
        self.head = MLP(in_dim, [*head, 1], activation=nn.LeakyReLU, dropout=0.1)

    def forward(
        self,
        user_profile: torch.Tensor,
        user_dense: torch.Tensor,
        hist_item_ids: torch.Tensor,
        item_id: torch.Tensor,
    ) -> torch.Tensor:
        seq = torch.cat([hist_item_ids, item_id.unsqueeze(1)], dim=1)  # [N, L + 1]
        padding = seq == 0
        x = self.item_table(seq) + self.position
        for layer in self.layers:
            x = layer(x, padding)
        profile = [t(user_profile[:, i]) for i, t in enumerate(self.profile_tables)]
        feats = torch.cat([*profile, user_dense, x.flatten(1)], dim=-1)
        return self.head(feats).squeeze(-1)


def build(seed: int = 0) -> BST:
    return seeded(BST, seed)


def make_batch(counts: Sequence[int], *, seed: int = 0, shuffle: bool = False):
    R, N = S.sizes(counts)
    g = S.generator(seed)
    kwargs = {
        "user_profile": S.id_columns(g, R, PROFILE_VOCABS),
        "user_dense": S.dense(g, R, USER_DENSE_DIM),
        "hist_item_ids": S.history(g, R, HIST_LEN, NUM_ITEMS),
        "item_id": S.ids(g, N, NUM_ITEMS),
    }
    return S.make(counts, g, shuffle, kwargs, REQUEST_INPUTS)
