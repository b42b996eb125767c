"""A history transformer ranker (``nn.TransformerEncoder`` over the history, the candidate's
``nn.MultiheadAttention`` over its states, an MLP) and its hand rewrite for the shared layout.

The model is ``models_zoo.user_models.HistoryTransformerRanker`` at the size
``benchmarks/backend_door.py`` times (width 64, 4 heads, 2 layers, a 50-item history padded at
the end); this module adds the zoo's batch maker for it.

By hand: the encoder, the masked mean and the target attention's keys and values (its input
projection's K and V rows) run at R rows; the candidate's query at N rows; the attention reads
each request's keys and values in place (:func:`attend_per_request`), then the output
projection; the MLP's first linear is split (:class:`SplitLinear`): the masked mean at R rows,
the attention output and the candidate at N rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from models_zoo import Batch, request_index
from models_zoo.user_models import HistoryTransformerRanker

from .pieces import SplitLinear, attend_per_request

REQUEST_INPUTS = ("history",)
ITEMS, HISTORY = 10_000, 50


def build(seed: int = 0) -> HistoryTransformerRanker:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = HistoryTransformerRanker(
            num_items=ITEMS, dim=64, heads=4, ffn=128, layers=2, history_length=HISTORY
        )
    return model.eval()


def make_batch(counts: Sequence[int], *, seed: int = 0, shuffle: bool = False) -> Batch:
    """R = len(counts) histories of 25 to 50 items (padding at the end), N candidates."""
    g = torch.Generator().manual_seed(seed)
    requests, candidates = len(counts), sum(counts)
    history = torch.randint(1, ITEMS, (requests, HISTORY), generator=g)
    lengths = torch.randint(HISTORY // 2, HISTORY + 1, (requests,), generator=g)
    history[torch.arange(HISTORY)[None] >= lengths[:, None]] = 0
    item = torch.randint(1, ITEMS, (candidates,), generator=g)
    index = request_index(counts, shuffle=shuffle, generator=g)
    return Batch({"history": history, "item": item}, index, REQUEST_INPUTS)


class HandHistoryTransformer(nn.Module):
    def __init__(self, model: HistoryTransformerRanker):
        super().__init__()
        assert model.batch_first and model.mix is None
        self.model = model
        dim = model.items.embedding_dim
        w_q, w_k, w_v = model.target.in_proj_weight.detach().chunk(3)
        b_q, b_k, b_v = model.target.in_proj_bias.detach().chunk(3)
        self.register_buffer("w_q", w_q.contiguous())
        self.register_buffer("b_q", b_q.contiguous())
        self.register_buffer("w_kv", torch.cat([w_k, w_v]))
        self.register_buffer("b_kv", torch.cat([b_k, b_v]))
        self.mlp0 = SplitLinear.of(model.mlp[0], dim)
        self.mlp_rest = nn.Sequential(*list(model.mlp)[1:])

    def forward(self, history, item, candidate_to_request):
        m = self.model
        heads = m.target.num_heads
        padding = history == 0  # [R, L]
        tokens = m.items(history) + m.position[: history.shape[1]]
        states = m.encoder(tokens, src_key_padding_mask=padding)  # [R, L, D]
        valid = (~padding).unsqueeze(-1).float()
        pooled = (states * valid).sum(1) / valid.sum(1).clamp_min(1.0)  # [R, D]
        num_requests, length, dim = states.shape
        kv = F.linear(states, self.w_kv, self.b_kv).view(num_requests, length, 2, heads, -1)
        k, v = kv.permute(2, 0, 3, 1, 4).unbind(0)  # [R, H, L, D / H] each
        target = m.items(item)  # [N, D]
        q = F.linear(target, self.w_q, self.b_q).view(-1, heads, dim // heads)
        attended = attend_per_request(q, k, v, ~padding, candidate_to_request).flatten(1)
        attended = m.target.out_proj(attended)
        x = self.mlp0(pooled, torch.cat([attended, target], dim=-1), candidate_to_request)
        return self.mlp_rest(x).squeeze(-1)
