"""The two pieces every hand rewrite here is built from.

- :class:`SplitLinear`: a linear layer whose input is ``cat([request columns, candidate
  columns])``, computed as the request columns' product at R rows, gathered to the N candidates,
  plus the candidate columns' product at N rows. Identity: ``W [x_r[idx]; x_c] + b ==
  (W_r x_r)[idx] + W_c x_c + b``, where ``W_r``, ``W_c`` are ``W``'s request and candidate
  columns (any order of columns in ``W``; the split is made once from the trained weight).
- :func:`attend_per_request`: every candidate's query against its own request's keys and
  values, read in place at R rows: one attention over all requests' keys, the other requests'
  keys masked out. Exact for any ``candidate_to_request`` (ragged, shuffled), no data-dependent
  shape, so it exports; it computes R times the scores of a per-request attention (at R = 1,
  exactly the per-request attention).

Shapes use ``R`` requests, ``N`` candidates, ``H`` heads, ``L`` history, ``D`` head width.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


class SplitLinear(nn.Module):
    """``linear(x, weight, bias)`` for ``x`` given as request rows and candidate rows apart."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        request_columns: Sequence[int],
        candidate_columns: Sequence[int],
    ):
        super().__init__()
        weight = weight.detach()
        self.register_buffer("w_request", weight[:, list(request_columns)].contiguous())
        self.register_buffer("w_candidate", weight[:, list(candidate_columns)].contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @classmethod
    def of(cls, linear: nn.Linear, num_request: int) -> SplitLinear:
        """Split ``linear`` whose first ``num_request`` input columns are the request's."""
        columns = range(linear.in_features)
        return cls(linear.weight, linear.bias, columns[:num_request], columns[num_request:])

    def forward(self, x_request, x_candidate, candidate_to_request):
        """x_request [R, Fr], x_candidate [N, Fc], candidate_to_request [N] -> [N, out]."""
        shared = F.linear(x_request, self.w_request).index_select(0, candidate_to_request)
        return F.linear(x_candidate, self.w_candidate, self.bias) + shared


def attend_per_request(q, k, v, key_valid, candidate_to_request):
    """q [N, H, D]; k, v [R, H, L, D]; key_valid bool [R, L] -> [N, H, D].

    ``softmax(q k_r^T / sqrt(D)) v_r`` over the valid keys of each candidate's request ``r``.
    """
    num_requests, heads, length, dim = k.shape
    keys = k.transpose(0, 1).reshape(1, heads, num_requests * length, dim)
    values = v.transpose(0, 1).reshape(1, heads, num_requests * length, dim)
    key_request = torch.arange(num_requests, device=k.device).repeat_interleave(length)
    own = candidate_to_request[:, None] == key_request[None, :]  # [N, R * L]
    mask = own & key_valid.reshape(1, num_requests * length)
    queries = q.transpose(0, 1).unsqueeze(0)  # [1, H, N, D]
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask[None, None])
    return out.squeeze(0).transpose(0, 1)
