"""MMoE (Ma et al., 2018) multi-task ranking: shared experts, one softmax gate per task.

The forward takes one dict of features, so request inputs are named "features.<key>".

Inputs, replicated layout (N rows), all under `features`:
    user_id     int64   [N]     request
    user_age    int64   [N]     request    age bucket
    user_dense  float32 [N, 8]  request
    item_id     int64   [N]     candidate
    item_cat    int64   [N]     candidate
Output: {"ctr": [N], "cvr": [N]} probabilities.

Weights are drawn at He scale: with torch's default init, four ReLU layers deep and averaged
over the experts, every probability would sit within 0.005 of 0.5.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from . import _sampling as S
from ._layers import MLP, embedding, fan_in_weights, seeded

DESCRIPTION = "MMoE: dict input, 4 expert MLPs, softmax gates for ctr/cvr, task towers"
REQUEST_INPUTS = ("features.user_id", "features.user_age", "features.user_dense")

SPARSE_VOCABS = {"user_id": 20_000, "user_age": 10, "item_id": 50_000, "item_cat": 1_000}
USER_DENSE_DIM = 8
TASKS = ("ctr", "cvr")


class MMoE(nn.Module):
    def __init__(
        self,
        emb_dim: int = 16,
        num_experts: int = 4,
        expert: Sequence[int] = (256, 128),
        tower: Sequence[int] = (64,),
    ):
        super().__init__()
        self.tables = nn.ModuleDict({k: embedding(v, emb_dim) for k, v in SPARSE_VOCABS.items()})
        in_dim = emb_dim * len(SPARSE_VOCABS) + USER_DENSE_DIM
        self.experts = nn.ModuleList(
            MLP(in_dim, expert, last_activation=True) for _ in range(num_experts)
        )
        self.gates = nn.ModuleDict({t: nn.Linear(in_dim, num_experts) for t in TASKS})
        self.towers = nn.ModuleDict({t: MLP(expert[-1], [*tower, 1]) for t in TASKS})

    def forward(self, features: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        embs = [table(features[name]) for name, table in self.tables.items()]
        x = torch.cat([*embs, features["user_dense"]], dim=-1)
        experts = torch.stack([e(x) for e in self.experts], dim=1)  # [N, K, E]
        out = {}
        for task in TASKS:
            gate = torch.softmax(self.gates[task](x), dim=-1)  # [N, K]
            mixed = torch.bmm(gate.unsqueeze(1), experts).squeeze(1)  # [N, E]
            out[task] = torch.sigmoid(self.towers[task](mixed)).squeeze(-1)
        return out


def build(seed: int = 0) -> MMoE:
    return fan_in_weights(seeded(MMoE, seed), seed, gain=2.0)


def make_batch(counts: Sequence[int], *, seed: int = 0, shuffle: bool = False):
    R, N = S.sizes(counts)
    g = S.generator(seed)
    features = {
        "user_id": S.ids(g, R, SPARSE_VOCABS["user_id"]),
        "user_age": S.ids(g, R, SPARSE_VOCABS["user_age"]),
        "user_dense": S.dense(g, R, USER_DENSE_DIM),
        "item_id": S.ids(g, N, SPARSE_VOCABS["item_id"]),
        "item_cat": S.ids(g, N, SPARSE_VOCABS["item_cat"]),
    }
    return S.make(counts, g, shuffle, {"features": features}, REQUEST_INPUTS)
