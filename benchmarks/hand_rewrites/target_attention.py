"""The zoo's target_attention by hand for the shared layout.

The history's transformer encoder, its keys and values and the user profile run at R rows; the
candidate's target embedding and query at N rows; the target attention reads each request's
keys and values in place (:func:`attend_per_request`); the top MLP's first linear is split
(:class:`SplitLinear`): the profile columns at R rows, the pooled attention and target columns
at N rows.
"""

from __future__ import annotations

import torch
from torch import nn

from models_zoo.target_attention import TargetAttention

from .pieces import SplitLinear, attend_per_request


class HandTargetAttention(nn.Module):
    def __init__(self, model: TargetAttention):
        super().__init__()
        self.model = model
        profile_width = sum(t.embedding_dim for t in model.profile)
        self.top0 = SplitLinear.of(model.top[0], profile_width)
        self.top_rest = nn.Sequential(*list(model.top)[1:])

    def forward(self, user_profile, hist_item_ids, item_id, item_cat, candidate_to_request):
        m = self.model
        num_requests, length = hist_item_ids.shape
        key_mask = hist_item_ids != 0
        h = m.item_table(hist_item_ids) + m.position[:length]
        for layer in m.encoder:
            h = layer(h, key_mask)
        target = m.item_table(item_id) + m.cat_table(item_cat)  # [N, D]
        dim_head = target.shape[-1] // m.heads
        q = m.query(target).view(-1, m.heads, dim_head)
        k = m.key(h).view(num_requests, length, m.heads, dim_head).transpose(1, 2)
        v = m.value(h).view(num_requests, length, m.heads, dim_head).transpose(1, 2)
        pooled = attend_per_request(q, k, v, key_mask, candidate_to_request).flatten(1)
        profile = torch.cat([t(user_profile[:, i]) for i, t in enumerate(m.profile)], dim=-1)
        x = self.top0(profile, torch.cat([pooled, target], dim=-1), candidate_to_request)
        return self.top_rest(x).squeeze(-1)
