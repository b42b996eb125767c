"""Small models over a padded history (``tests/analysis/test_truncation.py``,
``tests/runtime/test_jagged_calls.py``): pooled by a mask in ways that do or do not read the
padding, or masked by a lengths input."""

from __future__ import annotations

import torch
from torch import nn

VOCAB, DIM = 100, 8


class Pooled(nn.Module):
    """History embeddings pooled by ``pool`` with the padding mask, scored against an item."""

    def __init__(self, pool: str):
        super().__init__()
        torch.manual_seed(0)
        self.pool = pool
        self.table = nn.Embedding(VOCAB, DIM)
        self.item = nn.Embedding(VOCAB, DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.head = nn.Linear(2 * DIM, 1)
        with torch.no_grad():
            self.head.weight.mul_(20)

    def forward(self, hist: torch.Tensor, item: torch.Tensor) -> torch.Tensor:
        h = self.proj(self.table(hist))  # [B, L, D]
        t = self.item(item)  # [B, D]
        valid = hist != 0
        if self.pool == "masked_sum":
            u = (h * valid.unsqueeze(-1).to(h.dtype)).sum(1)
        elif self.pool == "softmax":
            scores = (h * t.unsqueeze(1)).sum(-1).masked_fill(~valid, float("-inf"))
            u = torch.matmul(torch.softmax(scores, -1).unsqueeze(1), h).squeeze(1)
        elif self.pool == "large_negative":
            scores = (h * t.unsqueeze(1)).sum(-1) + (~valid).to(h.dtype) * -1e9
            u = torch.matmul(torch.softmax(scores, -1).unsqueeze(1), h).squeeze(1)
        elif self.pool == "max":
            u = h.masked_fill(~valid.unsqueeze(-1), float("-inf")).amax(1)
        elif self.pool == "mean":  # divides by the padded width
            u = (h * valid.unsqueeze(-1).to(h.dtype)).mean(1)
        elif self.pool == "unmasked_sum":  # adds the padding's embeddings
            u = h.sum(1)
        elif self.pool == "last":  # reads the last padded position
            u = h[:, -1]
        elif self.pool == "cumsum":  # each position reads the ones before it
            u = (torch.cumsum(h, 1) * valid.unsqueeze(-1).to(h.dtype)).sum(1)
        elif self.pool == "causal":
            q = h.unsqueeze(1)
            a = nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).squeeze(1)
            u = (a * valid.unsqueeze(-1).to(h.dtype)).sum(1)
        elif self.pool == "attention":  # a key-padding mask, True where a key is seen
            q = t.view(t.shape[0], 1, 1, DIM)
            k = h.unsqueeze(1)
            mask = valid[:, None, None, :]
            a = nn.functional.scaled_dot_product_attention(q, k, k, attn_mask=mask)
            u = a.reshape(t.shape[0], DIM)
        elif self.pool == "padded_prefix":  # TorchRec's to_padded_dense(4) of a masked history
            masked = h.masked_fill(~valid.unsqueeze(-1), 0.0)
            u = nn.functional.pad(masked, (0, 0, 0, 4))[:, :4].sum(1)
        elif self.pool == "pad_other_value":  # pads with ones past a tail of zeros
            masked = h.masked_fill(~valid.unsqueeze(-1), 0.0)
            u = nn.functional.pad(masked, (0, 0, 0, 4), value=1.0)[:, :4].sum(1)
        elif self.pool == "listwise":  # normalizes across the candidates
            u = torch.softmax((h * valid.unsqueeze(-1)).sum(1), dim=0)
        return self.head(torch.cat([u, t], -1)).squeeze(-1)


class WithLengths(nn.Module):
    """A history beside its lengths: the mask is ``arange(L) < lengths``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.table = nn.Embedding(VOCAB, DIM)
        self.head = nn.Linear(2 * DIM, 1)
        with torch.no_grad():
            self.head.weight.mul_(20)

    def forward(self, hist, hist_len, item):
        h = self.table(hist)
        valid = torch.arange(hist.shape[1], device=hist.device).unsqueeze(0) < hist_len.unsqueeze(1)
        u = (h * valid.unsqueeze(-1).to(h.dtype)).sum(1)
        return self.head(torch.cat([u, self.table(item)], -1)).squeeze(-1)
