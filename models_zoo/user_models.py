"""Ranking models as users write them, not zoo classes: the inputs of ``apply_glm`` on any model.

``Ranker`` is a user tower and an item tower concatenated into an MLP; ``DINLike`` attends from
the candidate over the user's behaviour history, then an MLP over the user, the pooled history
and the candidate.
"""

from __future__ import annotations

import torch
from torch import nn


class Ranker(nn.Module):
    """A user tower and an item tower concatenated into an MLP."""

    def __init__(self):
        super().__init__()
        self.user = nn.Sequential(nn.Linear(128, 256), nn.ReLU())
        self.item = nn.Sequential(nn.Linear(32, 64), nn.ReLU())
        self.mlp = nn.Sequential(
            nn.Linear(320, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 1)
        )

    def forward(self, user_feats, item_feats):
        return self.mlp(torch.cat([self.user(user_feats), self.item(item_feats)], dim=1))


class DINLike(nn.Module):
    """DIN-style: an attention MLP scores each history item against the candidate, the weighted
    history sum joins the user and candidate embeddings in a top MLP."""

    def __init__(self, users: int = 1000, items: int = 5000, dim: int = 32):
        super().__init__()
        self.user_emb = nn.Embedding(users, dim)
        self.item_emb = nn.Embedding(items, dim)
        self.att = nn.Sequential(nn.Linear(4 * dim, 64), nn.ReLU(), nn.Linear(64, 1))
        self.mlp = nn.Sequential(
            nn.Linear(3 * dim, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 1)
        )

    def forward(self, user_id, history, item_id):
        h = self.item_emb(history)  # [B, L, D]
        c = self.item_emb(item_id)[:, None, :].expand_as(h)
        w = self.att(torch.cat([h, c, h - c, h * c], dim=-1))  # [B, L, 1]
        interest = (w * h).sum(1)
        return self.mlp(torch.cat([self.user_emb(user_id), interest, c[:, 0]], dim=-1))
