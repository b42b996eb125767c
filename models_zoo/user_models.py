"""Ranking models as users write them, not zoo classes: the inputs of ``apply_glm`` and
``apply_dca`` on any model.

``Ranker`` is a user tower and an item tower concatenated into an MLP; ``DINLike`` attends from
the candidate over the user's behaviour history, then an MLP over the user, the pooled history
and the candidate; ``BSTLike`` runs an ``nn.TransformerEncoder`` over the history tokens followed
by the candidate's tokens; ``HistoryTransformerRanker`` encodes the history alone with an
``nn.TransformerEncoder`` and lets the candidate attend over it (``nn.MultiheadAttention``).
``FieldRanker`` is the ``Ranker`` behind field embeddings, for the
MovieLens inputs of ``benchmarks/quality.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class Ranker(nn.Module):
    """A user tower and an item tower concatenated into an MLP (default sizes: the GLM issue's)."""

    def __init__(
        self,
        user_dim: int = 128,
        item_dim: int = 32,
        user_hidden: int = 256,
        item_hidden: int = 64,
        hidden: Sequence[int] = (512, 256),
    ):
        super().__init__()
        self.user = nn.Sequential(nn.Linear(user_dim, user_hidden), nn.ReLU())
        self.item = nn.Sequential(nn.Linear(item_dim, item_hidden), nn.ReLU())
        layers: list[nn.Module] = []
        width = user_hidden + item_hidden
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        self.mlp = nn.Sequential(*layers, nn.Linear(width, 1))

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


def _field_embeddings(vocabs: Sequence[int], dim: int) -> nn.ModuleList:
    return nn.ModuleList(nn.Embedding(v, dim) for v in vocabs)


class FieldRanker(nn.Module):
    """``Ranker`` over embedded fields: user fields and the mean history item form the user
    features, the item id, item fields and mean genre embedding the item features.

    Inputs as in ``models_zoo.backbones``: ``user_sparse`` [B, Fu], ``history`` [B, L] (0 =
    padding), ``item_sparse`` [B, 1 + Fi] (item id first), ``item_multihot`` [B, M]; logit [B].
    """

    def __init__(
        self,
        user_vocabs: Sequence[int],
        num_items: int,
        item_vocabs: Sequence[int],
        multihot: int,
        dim: int = 16,
        user_hidden: int = 128,
        item_hidden: int = 32,
        hidden: Sequence[int] = (128, 64),
    ):
        super().__init__()
        self.user_emb = _field_embeddings(user_vocabs, dim)
        self.item_emb = nn.Embedding(num_items, dim, padding_idx=0)
        self.item_field_emb = _field_embeddings(item_vocabs, dim)
        self.genres = nn.Linear(multihot, dim, bias=False)
        user_dim = dim * (len(user_vocabs) + 1)
        item_dim = dim * (len(item_vocabs) + 2)
        self.ranker = Ranker(user_dim, item_dim, user_hidden, item_hidden, hidden)

    def forward(self, user_sparse, history, item_sparse, item_multihot):
        valid = (history != 0).unsqueeze(-1).float()
        pooled = (self.item_emb(history) * valid).sum(1) / valid.sum(1).clamp_min(1.0)
        user = [t(user_sparse[:, i]) for i, t in enumerate(self.user_emb)] + [pooled]
        item = [self.item_emb(item_sparse[:, 0])]
        item += [t(item_sparse[:, i + 1]) for i, t in enumerate(self.item_field_emb)]
        item.append(self.genres(item_multihot) / item_multihot.sum(-1, keepdim=True).clamp_min(1))
        return self.ranker(torch.cat(user, dim=-1), torch.cat(item, dim=-1)).squeeze(-1)


class BSTLike(nn.Module):
    """BST-style: ``nn.TransformerEncoder`` over ``[history items; candidate tokens]``.

    The candidate contributes one token per field (item id, each item field, mean genre
    embedding), after the ``history_length`` history tokens; learned positions are added to every
    token. A key padding mask hides padded history items. The head MLP reads the user field
    embeddings, the mean of the valid history tokens' final states and the candidate tokens'
    final states. ``batch_first=False`` runs the encoder on ``[S, B, D]``. Inputs as
    :class:`FieldRanker`.
    """

    def __init__(
        self,
        user_vocabs: Sequence[int],
        num_items: int,
        item_vocabs: Sequence[int],
        multihot: int,
        history_length: int,
        dim: int = 16,
        heads: int = 2,
        ffn: int = 32,
        layers: int = 2,
        head: Sequence[int] = (64,),
        batch_first: bool = True,
        norm_first: bool = False,
    ):
        super().__init__()
        self.batch_first = batch_first
        self.candidate_tokens = len(item_vocabs) + 2
        self.user_emb = _field_embeddings(user_vocabs, dim)
        self.item_emb = nn.Embedding(num_items, dim, padding_idx=0)
        self.item_field_emb = _field_embeddings(item_vocabs, dim)
        self.genres = nn.Linear(multihot, dim, bias=False)
        self.position = nn.Parameter(
            torch.randn(history_length + self.candidate_tokens, dim) * 0.02
        )
        layer = nn.TransformerEncoderLayer(
            dim, heads, ffn, dropout=0.0, batch_first=batch_first, norm_first=norm_first
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        width = dim * (len(user_vocabs) + 1 + self.candidate_tokens)
        mlp: list[nn.Module] = []
        for h in head:
            mlp += [nn.Linear(width, h), nn.ReLU()]
            width = h
        self.mlp = nn.Sequential(*mlp, nn.Linear(width, 1))

    def forward(self, user_sparse, history, item_sparse, item_multihot):
        length = history.shape[1]
        candidate = [self.item_emb(item_sparse[:, 0])]
        candidate += [t(item_sparse[:, i + 1]) for i, t in enumerate(self.item_field_emb)]
        count = item_multihot.sum(-1, keepdim=True).clamp_min(1)
        candidate.append(self.genres(item_multihot) / count)
        tokens = torch.cat([self.item_emb(history), torch.stack(candidate, 1)], 1) + self.position
        ids = torch.cat([history, item_sparse[:, :1].expand(-1, self.candidate_tokens)], 1)
        if self.batch_first:
            states = self.encoder(tokens, src_key_padding_mask=ids == 0)
        else:
            states = self.encoder(tokens.transpose(0, 1), src_key_padding_mask=ids == 0)
            states = states.transpose(0, 1)
        valid = (history != 0).unsqueeze(-1).float()
        pooled = (states[:, :length] * valid).sum(1) / valid.sum(1).clamp_min(1.0)
        user = [t(user_sparse[:, i]) for i, t in enumerate(self.user_emb)]
        feats = torch.cat([*user, pooled, states[:, length:].flatten(1)], dim=-1)
        return self.mlp(feats).squeeze(-1)


class HistoryTransformerRanker(nn.Module):
    """A history encoder and target attention, as rankers write them with torch's modules.

    ``history`` ``[B, L]`` item ids (0 = padding), ``item`` ``[B]`` the candidate's item id. An
    ``nn.TransformerEncoder`` with a key padding mask encodes the history (request-only); the
    candidate's embedding attends over the encoded history (``nn.MultiheadAttention``, padded
    positions masked); an MLP reads the masked mean of the history states, the attention output
    and the candidate. ``self_attention=True`` adds an ``nn.MultiheadAttention`` self-attention
    over the encoded history (returning its weights, as by default). In eval mode without
    autograd, torch runs the encoder layers and the self-attention through its fused fast paths,
    and eager runs the encoder on a nested tensor of the valid positions (``nested_tensor``,
    torch's default) when the padding is at the end: padded positions' states are then zeros,
    which the masked mean and the masked attention never read.
    """

    def __init__(
        self,
        num_items: int = 1000,
        dim: int = 32,
        heads: int = 4,
        ffn: int = 64,
        layers: int = 2,
        batch_first: bool = True,
        norm_first: bool = False,
        activation: str = "relu",
        self_attention: bool = False,
        history_length: int = 20,
        nested_tensor: bool = True,
    ):
        super().__init__()
        self.batch_first = batch_first
        self.items = nn.Embedding(num_items, dim, padding_idx=0)
        self.position = nn.Parameter(torch.randn(history_length, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(
            dim, heads, ffn, dropout=0.0, activation=activation, batch_first=batch_first,
            norm_first=norm_first,
        )  # fmt: skip
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=nested_tensor)
        self.mix = nn.MultiheadAttention(dim, heads, batch_first=True) if self_attention else None
        self.target = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(3 * dim, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, history, item):
        padding = history == 0
        tokens = self.items(history) + self.position[: history.shape[1]]
        if self.batch_first:
            states = self.encoder(tokens, src_key_padding_mask=padding)
        else:
            states = self.encoder(tokens.transpose(0, 1), src_key_padding_mask=padding)
            states = states.transpose(0, 1)
        if self.mix is not None:
            mixed, _ = self.mix(states, states, states, key_padding_mask=padding)
            states = states + mixed
        valid = (~padding).unsqueeze(-1).float()
        pooled = (states * valid).sum(1) / valid.sum(1).clamp_min(1.0)
        target = self.items(item)
        attended, _ = self.target(
            target.unsqueeze(1), states, states, key_padding_mask=padding, need_weights=False
        )
        return self.mlp(torch.cat([pooled, attended.squeeze(1), target], -1)).squeeze(-1)
