"""The Deep Cross Attention layers: :class:`CrossAttention`, :class:`DCABlock` and
:func:`nonempty_key_mask`.

DCA keeps a history stack request-only: history tokens attend only to history tokens, and at
every depth request-side and candidate-side query tokens cross-attend into that depth's history
states through their own K/V projections. Attention is row-wise in ``B``, so with a request-only
history every K/V projection is request-only and only the candidate queries and their attention
run per candidate.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def nonempty_key_mask(key_mask: torch.Tensor) -> torch.Tensor:
    """``key_mask`` (True = attend) where a row with no valid key attends to every position.

    Softmax attention over no keys is undefined (SDPA returns NaN); an empty history then reads
    the padding positions, a fixed value the model learns to recognise. Row-wise, so it stays
    request-only.
    """
    return key_mask | ~key_mask.any(dim=-1, keepdim=True)


class CrossAttention(nn.Module):
    """Post-LN attention sublayer and FFN of queries ``x`` over a context (the history):

        ``x = LN1(x + W_o sdpa(W_q x, W_k ctx, W_v ctx, key_mask))``; ``x = LN2(x + FFN(x))``.

    With ``ctx = x`` it is a transformer encoder layer (the history self-attention of DCA).
    Row-wise in ``B``; with a request-only context its K/V projections are request-only.
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        ffn: int,
        *,
        dropout: float = 0.0,
        activation: Callable[[], nn.Module] = nn.GELU,
    ):
        super().__init__()
        if dim % heads:
            raise ValueError(f"CrossAttention: dim {dim} is not divisible by {heads} heads")
        self.heads = heads
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)
        self.norm1 = nn.LayerNorm(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn), activation(), nn.Linear(ffn, dim))
        self.dropout = nn.Dropout(dropout)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        return t.unflatten(-1, (self.heads, -1)).transpose(1, 2)  # [B, H, L, Dh]

    def forward(
        self, x: torch.Tensor, context: torch.Tensor, key_mask: torch.Tensor
    ) -> torch.Tensor:
        """x [B, Lq, D], context [B, L, D], key_mask bool [B, L] (True = attend) -> [B, Lq, D]."""
        q = self._heads(self.query(x))
        k = self._heads(self.key(context))
        v = self._heads(self.value(context))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask[:, None, None, :])
        a = a.transpose(1, 2).flatten(2)
        x = self.norm1(x + self.dropout(self.out(a)))
        return self.norm2(x + self.dropout(self.ffn(x)))


class DCABlock(nn.Module):
    """One depth of Deep Cross Attention.

    Inputs: history states ``h`` [B, L, D] with ``key_mask`` [B, L] (True = valid), candidate
    query tokens ``c`` [B, Lc, D] and optional request query tokens ``u`` [B, Lu, D]. Returns

        ``h' = SelfAttention(h)``, ``c' = CrossAttention_c(c, h)``, ``u' = CrossAttention_u(u, h)``

    with separate Q/K/V projections per stream. ``h'`` and ``u'`` depend on request inputs only
    and so do the candidate stream's K/V projections of ``h``; per candidate there remain the
    query projection, one attention over the request's keys (``sdpa`` with q [B, H, Lc, Dh]
    against K/V [B, H, L, Dh] of the history) and the candidate's FFN.
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        ffn: int,
        *,
        request_stream: bool = True,
        dropout: float = 0.0,
        activation: Callable[[], nn.Module] = nn.GELU,
    ):
        super().__init__()

        def layer() -> CrossAttention:
            return CrossAttention(dim, heads, ffn, dropout=dropout, activation=activation)

        self.history = layer()
        self.candidate = layer()
        self.request = layer() if request_stream else None

    def forward(
        self,
        history: torch.Tensor,
        key_mask: torch.Tensor,
        candidate: torch.Tensor,
        request: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        keep = nonempty_key_mask(key_mask)
        candidate = self.candidate(candidate, history, keep)
        if self.request is not None and request is not None:
            request = self.request(request, history, keep)
        history = self.history(history, history, keep)
        return history, candidate, request
