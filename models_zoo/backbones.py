"""Ranking backbones parametrized by a feature schema (the quality benchmark's models).

Every backbone reads the same four inputs, replicated layout (B rows):

    user_sparse    int64   [B, Fp]  request    categorical user fields (column j from table j)
    history        int64   [B, L]   request    previously engaged item ids, oldest first, 0 = padding
    item_sparse    int64   [B, 1+K] candidate  item id, then K categorical item fields
    item_multihot  float32 [B, M]   candidate  multi-hot item attributes (genres)

and returns a logit [B]. Request fields are the user fields plus the mean-pooled history; the
candidate fields are the item id, the item fields and the mean of the multi-hot attributes'
embeddings. The interaction parts reuse the zoo's building blocks (``CrossLayer``, ``MLP``,
``FeatureGate``, ``InteractionAggregation``, ``WukongLayer``, ``SDPAEncoderLayer``) and keep
the attribute names of the zoo models, so the zoo's ``apply_glm`` and ``apply_dca`` conversions
(:mod:`.glm_conversions`, :mod:`.dca_conversions`) handle both alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ._layers import MLP, embedding
from .batch import Batch, request_index
from .bst import SDPAEncoderLayer
from .dcnv2 import CrossLayer
from .finalmlp import FeatureGate, InteractionAggregation
from .wukong import WukongLayer

__all__ = [
    "BACKBONES",
    "REQUEST_INPUTS",
    "DCNv2Net",
    "FeatureEmbedding",
    "FeatureSchema",
    "FinalMLPNet",
    "SequenceNet",
    "WukongNet",
    "random_batch",
]

REQUEST_INPUTS = ("user_sparse", "history")


@dataclass(frozen=True)
class FeatureSchema:
    """Vocabulary sizes and widths of the four inputs (id 0 is padding in every table)."""

    request_vocabs: tuple[int, ...]
    num_items: int
    history_length: int
    candidate_vocabs: tuple[int, ...] = ()
    multihot: int = 0

    @property
    def num_request_fields(self) -> int:
        return len(self.request_vocabs) + 1

    @property
    def num_candidate_fields(self) -> int:
        return 1 + len(self.candidate_vocabs) + (1 if self.multihot else 0)


class FeatureEmbedding(nn.Module):
    """Field embeddings: ``request_fields`` [B, Fr, D] and ``candidate_fields`` [B, Fc, D].

    The item table is shared by the history and the candidate item id.
    """

    def __init__(self, schema: FeatureSchema, dim: int):
        super().__init__()
        self.schema, self.dim = schema, dim
        self.user_tables = nn.ModuleList(embedding(v, dim) for v in schema.request_vocabs)
        self.item_table = embedding(schema.num_items, dim, padding_idx=0)
        self.item_tables = nn.ModuleList(embedding(v, dim) for v in schema.candidate_vocabs)
        self.multihot = nn.Linear(schema.multihot, dim, bias=False) if schema.multihot else None

    def profile(self, user_sparse: torch.Tensor) -> torch.Tensor:
        return torch.stack([t(user_sparse[:, i]) for i, t in enumerate(self.user_tables)], dim=1)

    def pooled_history(self, history: torch.Tensor) -> torch.Tensor:
        """Mean of the valid history embeddings [B, D] (zero for an empty history)."""
        valid = (history != 0).unsqueeze(-1).to(torch.float32)
        total = (self.item_table(history) * valid).sum(dim=1)
        return total / valid.sum(dim=1).clamp_min(1.0)

    def request_fields(self, user_sparse: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        pooled = self.pooled_history(history).unsqueeze(1)
        return torch.cat([self.profile(user_sparse), pooled], dim=1)

    def candidate_fields(
        self, item_sparse: torch.Tensor, item_multihot: torch.Tensor
    ) -> torch.Tensor:
        fields = [self.item_table(item_sparse[:, 0])]
        fields += [t(item_sparse[:, i + 1]) for i, t in enumerate(self.item_tables)]
        if self.multihot is not None:
            count = item_multihot.sum(dim=-1, keepdim=True).clamp_min(1.0)
            fields.append(self.multihot(item_multihot) / count)
        return torch.stack(fields, dim=1)


class DCNv2Net(nn.Module):
    """DCNv2 (stacked): x0 = cat(request fields, candidate fields), cross layers, deep MLP."""

    __rocs_conversions__ = "models_zoo.glm_conversions"

    def __init__(
        self,
        schema: FeatureSchema,
        emb_dim: int = 16,
        num_cross: int = 2,
        rank: int | None = 16,
        deep: Sequence[int] = (128, 64),
        dropout: float = 0.0,
    ):
        super().__init__()
        self.embed = FeatureEmbedding(schema, emb_dim)
        dim = emb_dim * (schema.num_request_fields + schema.num_candidate_fields)
        self.cross = nn.ModuleList(CrossLayer(dim, rank) for _ in range(num_cross))
        self.deep = MLP(dim, deep, dropout=dropout, last_activation=True)
        self.head = nn.Linear(deep[-1], 1)

    def forward(self, user_sparse, history, item_sparse, item_multihot) -> torch.Tensor:
        request = self.embed.request_fields(user_sparse, history).flatten(1)
        candidate = self.embed.candidate_fields(item_sparse, item_multihot).flatten(1)
        x0 = torch.cat([request, candidate], dim=-1)
        x = x0
        for layer in self.cross:
            x = layer(x0, x)
        return self.head(self.deep(x)).squeeze(-1)


class FinalMLPNet(nn.Module):
    """FinalMLP: stream 1 gated by the request fields, stream 2 by the candidate fields."""

    __rocs_conversions__ = "models_zoo.glm_conversions"

    def __init__(
        self,
        schema: FeatureSchema,
        emb_dim: int = 16,
        stream1: Sequence[int] = (128, 64),
        stream2: Sequence[int] = (128, 64),
        num_heads: int = 4,
        gate_hidden: int = 64,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.embed = FeatureEmbedding(schema, emb_dim)
        user_dim = emb_dim * schema.num_request_fields
        item_dim = emb_dim * schema.num_candidate_fields
        flat_dim = user_dim + item_dim
        self.gate1 = FeatureGate(user_dim, flat_dim, gate_hidden)
        self.gate2 = FeatureGate(item_dim, flat_dim, gate_hidden)
        self.mlp1 = MLP(flat_dim, stream1, dropout=dropout, last_activation=True)
        self.mlp2 = MLP(flat_dim, stream2, dropout=dropout, last_activation=True)
        self.fusion = InteractionAggregation(stream1[-1], stream2[-1], num_heads)

    def forward(self, user_sparse, history, item_sparse, item_multihot) -> torch.Tensor:
        user = self.embed.request_fields(user_sparse, history).flatten(1)
        item = self.embed.candidate_fields(item_sparse, item_multihot).flatten(1)
        flat = torch.cat([user, item], dim=-1)
        h1 = self.mlp1(self.gate1(flat, user))
        h2 = self.mlp2(self.gate2(flat, item))
        return self.fusion(h1, h2).squeeze(-1)


class WukongNet(nn.Module):
    """Wukong: FMB + LCB layers over the stacked fields [B, F, D], then an MLP head."""

    __rocs_conversions__ = "models_zoo.glm_conversions"

    def __init__(
        self,
        schema: FeatureSchema,
        emb_dim: int = 16,
        layers: Sequence[tuple[int, int]] = ((4, 4), (4, 4)),
        fmb_hidden: int = 64,
        head: Sequence[int] = (128, 64),
    ):
        super().__init__()
        self.embed = FeatureEmbedding(schema, emb_dim)
        num = schema.num_request_fields + schema.num_candidate_fields
        blocks = []
        for n_fmb, n_lcb in layers:
            blocks.append(WukongLayer(num, n_fmb, n_lcb, emb_dim, fmb_hidden))
            num = n_fmb + n_lcb
        self.layers = nn.Sequential(*blocks)
        self.head = MLP(num * emb_dim, [*head, 1])

    def forward(self, user_sparse, history, item_sparse, item_multihot) -> torch.Tensor:
        request = self.embed.request_fields(user_sparse, history)
        candidate = self.embed.candidate_fields(item_sparse, item_multihot)
        x = self.layers(torch.cat([request, candidate], dim=1))
        return self.head(x.flatten(1)).squeeze(-1)


class SequenceNet(nn.Module):
    """Candidate-appended transformer (BST-style): [history tokens, candidate token].

    Every token attends to every valid token, so the history states depend on the candidate.
    The head reads the user fields, the mean of the final history states and the candidate's
    final state.
    """

    __rocs_conversions__ = "models_zoo.dca_conversions"

    def __init__(
        self,
        schema: FeatureSchema,
        emb_dim: int = 16,
        heads: int = 2,
        ffn: int = 32,
        num_layers: int = 2,
        head: Sequence[int] = (64,),
        dropout: float = 0.0,
    ):
        super().__init__()
        self.embed = FeatureEmbedding(schema, emb_dim)
        self.position = nn.Parameter(torch.randn(schema.history_length + 1, emb_dim) * 0.02)
        self.layers = nn.ModuleList(
            SDPAEncoderLayer(emb_dim, heads, ffn, dropout) for _ in range(num_layers)
        )
        num_user = len(schema.request_vocabs)
        self.head = MLP((num_user + 2) * emb_dim, [*head, 1])

    def forward(self, user_sparse, history, item_sparse, item_multihot) -> torch.Tensor:
        length = history.shape[1]
        hist = self.embed.item_table(history) + self.position[:length]
        cand = (
            self.embed.candidate_fields(item_sparse, item_multihot).sum(dim=1)
            + self.position[length]
        )
        x = torch.cat([hist, cand.unsqueeze(1)], dim=1)
        padding = torch.cat([history, item_sparse[:, :1]], dim=1) == 0
        for layer in self.layers:
            x = layer(x, padding)
        valid = (history != 0).unsqueeze(-1).to(torch.float32)
        pooled = (x[:, :length] * valid).sum(dim=1) / valid.sum(dim=1).clamp_min(1.0)
        profile = self.embed.profile(user_sparse).flatten(1)
        return self.head(torch.cat([profile, pooled, x[:, length]], dim=-1)).squeeze(-1)


BACKBONES = {
    "dcnv2": DCNv2Net,
    "finalmlp": FinalMLPNet,
    "wukong": WukongNet,
    "sequence": SequenceNet,
}


def random_batch(
    schema: FeatureSchema, counts: Sequence[int], *, seed: int = 0, shuffle: bool = False
) -> Batch:
    """A shared-layout batch of random features for ``schema`` (R = len(counts) requests)."""
    g = torch.Generator().manual_seed(seed)
    R, N = len(counts), sum(counts)
    L = schema.history_length

    def ids(rows, vocab, shape=()):
        return torch.randint(1, vocab, (rows, *shape), generator=g)

    lengths = torch.randint(0, L + 1, (R,), generator=g)
    lengths[0] = max(int(lengths[0]), 1)
    history = ids(R, schema.num_items, (L,)).masked_fill(torch.arange(L) >= lengths[:, None], 0)
    user = torch.stack([ids(R, v) for v in schema.request_vocabs], dim=1)
    item = torch.stack([ids(N, v) for v in (schema.num_items, *schema.candidate_vocabs)], dim=1)
    multihot = (torch.rand(N, schema.multihot, generator=g) < 0.2).to(torch.float32)
    kwargs = {
        "user_sparse": user,
        "history": history,
        "item_sparse": item,
        "item_multihot": multihot,
    }
    return Batch(kwargs, request_index(counts, shuffle=shuffle, generator=g), REQUEST_INPUTS)
