"""HSTU-style sequential ranker (Zhai et al., 2024): history tokens with the candidate last.

Each layer computes, from x [N, L, D]:
    U, V, Q, K = split(silu(W LayerNorm(x)))
    A = silu(Q K^T) / L, masked causally and at padded keys (no softmax)
    x = x + W_o (U * LayerNorm(A V))
The logit comes from the candidate token's final state.

Inputs, replicated layout (N rows, L = 24 by default; any L from 1 to HIST_LEN, the positional
table's rows less the candidate's, with the length marked dynamic in the example):
    hist_item_ids  int64 [N, L]  request    engaged items, oldest first, 0 = padding
    hist_actions   int64 [N, L]  request    action type per engagement, 0 = padding
    item_id        int64 [N]     candidate
Output: logit [N].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from . import _sampling as S
from ._layers import MLP, embedding, seeded

DESCRIPTION = "HSTU: 24 history + candidate tokens, 2 layers of causal silu attention, MLP head"
REQUEST_INPUTS = ("hist_item_ids", "hist_actions")

NUM_ITEMS = 50_000
NUM_ACTIONS = 5
HIST_LEN = 24


class HSTULayer(nn.Module):
    def __init__(self, dim: int, heads: int, max_len: int):
        super().__init__()
        self.heads, self.dim = heads, dim
        self.norm_in = nn.LayerNorm(dim)
        self.uvqk = nn.Linear(dim, 4 * dim)
        self.norm_attn = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, dim)
        causal = torch.tril(torch.ones(max_len, max_len, dtype=torch.bool))
        self.register_buffer("causal", causal, persistent=False)

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """x [N, L, D], valid bool [N, L] (False at padding)."""
        n, s, _ = x.shape
        u, v, q, k = F.silu(self.uvqk(self.norm_in(x))).split(self.dim, dim=-1)
        q, k, v = (t.view(n, s, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attn = F.silu(torch.matmul(q, k.transpose(-2, -1))) / s  # [N, H, L, L]
        # ``causal[:s, :s]`` computed, not sliced from the buffer: an [s, s] slice of a
        # [max_len, max_len] buffer is contiguous only at s = max_len, and tracing that view
        # fixes a dynamic length to max_len (the positional table caps the length instead).
        pos = torch.arange(s, device=x.device)
        mask = (pos[None, :] <= pos[:, None]) & valid[:, None, None, :]
        attn = attn.masked_fill(~mask, 0.0)
        a = torch.matmul(attn, v).transpose(1, 2).reshape(n, s, self.dim)
        return x + self.out(u * self.norm_attn(a))


class HSTU(nn.Module):
    # apply_dca's conversion; a module of its own so the zoo imports without rocs_compiler
    __rocs_conversions__ = "models_zoo.dca_conversions"

    def __init__(
        self, dim: int = 48, heads: int = 2, num_layers: int = 2, head: Sequence[int] = (128,)
    ):
        super().__init__()
        self.item_table = embedding(NUM_ITEMS, dim, padding_idx=0)
        self.action_table = embedding(NUM_ACTIONS, dim, padding_idx=0)
        self.position = nn.Embedding(HIST_LEN + 1, dim)
        nn.init.normal_(self.position.weight, std=0.02)
        self.layers = nn.ModuleList(HSTULayer(dim, heads, HIST_LEN + 1) for _ in range(num_layers))
        self.norm_out = nn.LayerNorm(dim)
        self.head = MLP(dim, [*head, 1], activation=nn.SiLU)

    def forward(
        self, hist_item_ids: torch.Tensor, hist_actions: torch.Tensor, item_id: torch.Tensor
    ) -> torch.Tensor:
        hist = self.item_table(hist_item_ids) + self.action_table(hist_actions)
        cand = self.item_table(item_id).unsqueeze(1)
        x = torch.cat([hist, cand], dim=1)  # [N, L + 1, D]
        # The first L + 1 rows of the positional table, which caps the length at HIST_LEN.
        x = x + self.position.weight[: x.size(1)]
        valid = torch.cat([hist_item_ids, item_id.unsqueeze(1)], dim=1) != 0
        for layer in self.layers:
            x = layer(x, valid)
        return self.head(self.norm_out(x[:, -1])).squeeze(-1)


def build(seed: int = 0) -> HSTU:
    return seeded(HSTU, seed)


def make_batch(counts: Sequence[int], *, seed: int = 0, shuffle: bool = False):
    R, N = S.sizes(counts)
    g = S.generator(seed)
    lens = S.lengths(g, R, HIST_LEN)
    kwargs = {
        "hist_item_ids": S.history(g, R, HIST_LEN, NUM_ITEMS, lens),
        "hist_actions": S.history(g, R, HIST_LEN, NUM_ACTIONS, lens),
        "item_id": S.ids(g, N, NUM_ITEMS),
    }
    return S.make(counts, g, shuffle, kwargs, REQUEST_INPUTS)
