"""Behaviour-history encoders built from torch's own modules, with hand-written rewrites.

Each model scores candidates ``c`` against a request's history ``hist`` ``[B, L, D]`` encoded
by a module from ``torch.nn``: multi-head attention (self and target attention), transformer
encoder and decoder layers, RNN/GRU/LSTM (in either layout: batch first, or sequence first
``[L, B, D]``), hand-written attention with the heads merged into the batch, and a history
updated in place. Inside them the batch leaves dim 0 or merges with other dims.

``shared_forward(hist, c, candidate_to_request)`` is the rewrite a serving engineer would write
by hand for the shared layout (R history rows, N candidate rows): the history is encoded once
per request and gathered to the candidates (target attention gathers its per-request keys and
values). ``forward`` is the model as written, for replicated inputs.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


class HistoryModel(nn.Module):
    """``score(encode(hist), item(c))``; ``sequence_first`` feeds the encoder ``[L, B, D]``."""

    def __init__(self, dim: int, length: int, heads: int, sequence_first: bool = False):
        super().__init__()
        self.dim, self.length, self.heads = dim, length, heads
        self.sequence_first = sequence_first
        self.item = nn.Linear(8, dim)

    def to_layout(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(0, 1) if self.sequence_first else x

    def forward(self, hist, c):
        return (self.encode(hist) * self.item(c)).sum(-1)

    def shared_forward(self, hist, c, candidate_to_request):
        user = self.encode(hist).index_select(0, candidate_to_request)
        return (user * self.item(c)).sum(-1)


class SelfAndTargetAttention(HistoryModel):
    """``nn.MultiheadAttention`` self-attention over the history, then target attention with
    the candidate as the query; optional key padding (request-side) and causal masks."""

    def __init__(self, dim=16, length=5, heads=4, sequence_first=False, need_weights=True,
                 padding=False, causal=False):  # fmt: skip
        super().__init__(dim, length, heads, sequence_first)
        kw = dict(batch_first=not sequence_first)
        self.self_attn = nn.MultiheadAttention(dim, heads, **kw)
        self.target = nn.MultiheadAttention(dim, heads, **kw)
        self.need_weights, self.padding, self.causal = need_weights, padding, causal

    def key_padding(self, hist):
        if not self.padding:
            return None
        mask = hist[..., 0] > 1.0
        mask[:, 0] = False  # every history keeps one key
        return mask

    def encode_history(self, hist, mask):
        causal = None
        if self.causal:
            causal = torch.triu(torch.ones(self.length, self.length, dtype=torch.bool), 1)
        x = self.to_layout(hist)
        h, _ = self.self_attn(
            x, x, x, key_padding_mask=mask, attn_mask=causal, need_weights=self.need_weights
        )
        return h

    def forward(self, hist, c):
        mask = self.key_padding(hist)
        h = self.encode_history(hist, mask)
        q = self.to_layout(self.item(c).unsqueeze(1))
        out, _ = self.target(q, h, h, key_padding_mask=mask, need_weights=self.need_weights)
        return self.to_layout(out).squeeze(1).sum(-1)

    def shared_forward(self, hist, c, candidate_to_request):
        mask = self.key_padding(hist)
        h = self.to_layout(self.encode_history(hist, mask))  # [R, L, D]
        w_q, w_k, w_v = self.target.in_proj_weight.chunk(3)
        b_q, b_k, b_v = self.target.in_proj_bias.chunk(3)
        heads, d = self.heads, self.dim // self.heads

        def split(x):  # [rows, L, D] -> [rows, H, L, d]
            return x.view(x.shape[0], -1, heads, d).transpose(1, 2)

        k = split(F.linear(h, w_k, b_k)).index_select(0, candidate_to_request)
        v = split(F.linear(h, w_v, b_v)).index_select(0, candidate_to_request)
        q = split(F.linear(self.item(c).unsqueeze(1), w_q, b_q))
        attend = None
        if mask is not None:
            attend = ~mask.index_select(0, candidate_to_request)[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attend)
        out = self.target.out_proj(out.transpose(1, 2).reshape(-1, self.dim))
        return out.sum(-1)


class Encoder(HistoryModel):
    """``nn.TransformerEncoder`` over the history, mean-pooled."""

    def __init__(self, dim=16, length=5, heads=4, sequence_first=False, norm_first=False,
                 layers=2, nested=False):  # fmt: skip
        super().__init__(dim, length, heads, sequence_first)
        layer = nn.TransformerEncoderLayer(
            dim, heads, 2 * dim, dropout=0.0, batch_first=not sequence_first,
            norm_first=norm_first,
        )  # fmt: skip
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=nested)

    def encode(self, hist):
        h = self.encoder(self.to_layout(hist))
        return h.mean(0 if self.sequence_first else 1)


class Decoder(HistoryModel):
    """``nn.TransformerDecoderLayer``: the request's last item attends over its history."""

    def __init__(self, dim=16, length=5, heads=4, sequence_first=False, norm_first=False):
        super().__init__(dim, length, heads, sequence_first)
        self.decoder = nn.TransformerDecoderLayer(
            dim, heads, 2 * dim, dropout=0.0, batch_first=not sequence_first,
            norm_first=norm_first,
        )  # fmt: skip

    def encode(self, hist):
        memory = self.to_layout(hist)
        target = self.to_layout(hist[:, -1:])
        return self.to_layout(self.decoder(target, memory)).squeeze(1)


class Recurrent(HistoryModel):
    """An RNN, GRU or LSTM over the history: its mean output plus its last layer's state; the
    initial state is created inside the module or computed from the history's first item."""

    def __init__(self, kind: Callable[..., nn.Module] = nn.GRU, dim=16, length=5, heads=4,
                 sequence_first=False, layers=1, bidirectional=False, h0=False):  # fmt: skip
        super().__init__(dim, length, heads, sequence_first)
        directions = 2 if bidirectional else 1
        hidden = dim // directions
        self.rnn = kind(
            dim, hidden, num_layers=layers, batch_first=not sequence_first,
            bidirectional=bidirectional,
        )  # fmt: skip
        self.lstm = kind is nn.LSTM
        self.state_shape = (layers * directions, hidden)
        self.h0 = nn.Linear(dim, layers * directions * hidden) if h0 else None

    def encode(self, hist):
        state = None
        if self.h0 is not None:
            h = self.h0(hist[:, 0]).view(hist.shape[0], *self.state_shape).transpose(0, 1)
            state = (h.contiguous(), torch.zeros_like(h)) if self.lstm else h.contiguous()
        out, last = self.rnn(self.to_layout(hist), state)
        last = last[0] if self.lstm else last
        mean = out.mean(0 if self.sequence_first else 1)
        return mean + last[-1].repeat(1, mean.shape[-1] // last.shape[-1])


class MergedHeads(HistoryModel):
    """Hand-written multi-head self-attention with the heads merged into the batch."""

    def __init__(self, dim=16, length=5, heads=4):
        super().__init__(dim, length, heads)
        self.qkv = nn.Linear(dim, 3 * dim)

    def encode(self, hist):
        b, heads, d = hist.shape[0], self.heads, self.dim // self.heads
        q, k, v = self.qkv(hist).chunk(3, -1)
        q, k, v = (t.reshape(b, self.length, heads, d).transpose(1, 2).reshape(b * heads, -1, d)
                   for t in (q, k, v))  # fmt: skip
        att = torch.softmax(torch.bmm(q, k.transpose(1, 2)) / d**0.5, -1)
        out = torch.bmm(att, v).reshape(b, heads, -1, d).transpose(1, 2)
        return out.reshape(b, -1, self.dim).mean(1)


class InPlaceHistory(HistoryModel):
    """A history embedding updated in place: ``h += pos``, ``masked_fill_``, a scaled row."""

    def __init__(self, dim=16, length=5, heads=4):
        super().__init__(dim, length, heads)
        self.pos = nn.Parameter(torch.randn(length, dim))
        self.proj = nn.Linear(dim, dim)
        self.mix = nn.Linear(dim, dim)

    def encode(self, hist):
        h = self.proj(hist)
        h += self.pos
        h.masked_fill_(hist < -1.0, 0.0)
        h[:, 0].mul_(2.0)
        return self.mix(h.relu()).mean(1)
