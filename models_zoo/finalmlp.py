"""FinalMLP (Mao et al., 2023): two gated MLP streams fused by multi-head bilinear aggregation.

Stream 1 is gated by the user features, stream 2 by the item features; a gate is
`2 * sigmoid(MLP(selected embeddings))` applied to the flat embedding of all features.

Inputs, replicated layout (N rows):
    user_sparse  int64 [N, 4]  request    user id, gender, age bucket, hour of day
    item_sparse  int64 [N, 3]  candidate  item id, category, author
Output: logit [N].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from . import _sampling as S
from ._layers import MLP, embedding, seeded

DESCRIPTION = "FinalMLP: user-gated and item-gated MLP streams, 8-head bilinear fusion"
REQUEST_INPUTS = ("user_sparse",)

USER_VOCABS = (20_000, 3, 10, 24)
ITEM_VOCABS = (50_000, 500, 5_000)


class FeatureGate(nn.Module):
    """Context-dependent feature selection: flat_emb * 2 * sigmoid(MLP(context))."""

    def __init__(self, ctx_dim: int, out_dim: int, hidden: int = 128):
        super().__init__()
        self.mlp = MLP(ctx_dim, [hidden, out_dim])

    def forward(self, flat_emb: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        return flat_emb * (2 * torch.sigmoid(self.mlp(ctx)))


class InteractionAggregation(nn.Module):
    """y = w_x x + w_y y + sum_h x_h^T W_h y_h over H heads (output width 1)."""

    def __init__(self, x_dim: int, y_dim: int, num_heads: int = 8):
        super().__init__()
        self.num_heads = num_heads
        self.head_x_dim = x_dim // num_heads
        self.head_y_dim = y_dim // num_heads
        self.w_x = nn.Linear(x_dim, 1)
        self.w_y = nn.Linear(y_dim, 1)
        self.w_xy = nn.Parameter(torch.empty(num_heads, self.head_x_dim, self.head_y_dim))
        nn.init.xavier_normal_(self.w_xy)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.w_x(x) + self.w_y(y)  # [N, 1]
        head_x = x.view(-1, self.num_heads, self.head_x_dim)
        head_y = y.view(-1, self.num_heads, self.head_y_dim)
        xw = torch.matmul(head_x.unsqueeze(2), self.w_xy)  # [N, H, 1, dy]
        xy = torch.matmul(xw, head_y.unsqueeze(-1)).squeeze(-1)  # [N, H, 1]
        return out + xy.sum(dim=1)


class FinalMLP(nn.Module):
    # apply_glm's conversion; a module of its own so the zoo imports without rocs_compiler
    __rocs_conversions__ = "models_zoo.glm_conversions"

    def __init__(
        self,
        emb_dim: int = 16,
        stream1: Sequence[int] = (256, 128, 64),
        stream2: Sequence[int] = (128, 64),
        num_heads: int = 8,
    ):
        super().__init__()
        self.user_tables = nn.ModuleList(embedding(v, emb_dim) for v in USER_VOCABS)
        self.item_tables = nn.ModuleList(embedding(v, emb_dim) for v in ITEM_VOCABS)
        user_dim, item_dim = emb_dim * len(USER_VOCABS), emb_dim * len(ITEM_VOCABS)
        flat_dim = user_dim + item_dim
        self.gate1 = FeatureGate(user_dim, flat_dim)
        self.gate2 = FeatureGate(item_dim, flat_dim)
        self.mlp1 = MLP(flat_dim, stream1, dropout=0.1, last_activation=True)
        self.mlp2 = MLP(flat_dim, stream2, dropout=0.1, last_activation=True)
        self.fusion = InteractionAggregation(stream1[-1], stream2[-1], num_heads)

    def forward(self, user_sparse: torch.Tensor, item_sparse: torch.Tensor) -> torch.Tensor:
        user = torch.cat([t(user_sparse[:, i]) for i, t in enumerate(self.user_tables)], dim=-1)
        item = torch.cat([t(item_sparse[:, i]) for i, t in enumerate(self.item_tables)], dim=-1)
        flat = torch.cat([user, item], dim=-1)
        h1 = self.mlp1(self.gate1(flat, user))
        h2 = self.mlp2(self.gate2(flat, item))
        return self.fusion(h1, h2).squeeze(-1)


def build(seed: int = 0) -> FinalMLP:
    return seeded(FinalMLP, seed)


def make_batch(counts: Sequence[int], *, seed: int = 0, shuffle: bool = False):
    R, N = S.sizes(counts)
    g = S.generator(seed)
    kwargs = {
        "user_sparse": S.id_columns(g, R, USER_VOCABS),
        "item_sparse": S.id_columns(g, N, ITEM_VOCABS),
    }
    return S.make(counts, g, shuffle, kwargs, REQUEST_INPUTS)
