"""DCNv2 with GLM masks (``rocs.apply_glm``, half of every layer request-only) by hand.

The model's lanes are kept apart: request lanes at R rows, candidate lanes at N rows. A GLM
layer ``W = [[W_RR, 0], [W_CR, W_CC]]`` gives the request lanes ``W_RR x_r`` at R rows and the
candidate lanes ``W_CR x_r`` (at R rows, gathered) ``+ W_CC x_c`` at N rows; the cross layers'
``x0 * w(x) + x`` and the ReLUs act lane by lane; the head reads both sides
(:class:`SplitLinear`). The masked blocks are taken from the trained weights once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .pieces import SplitLinear


class LaneLinear(nn.Module):
    """A GLM linear layer (request lanes first) on request rows and candidate rows apart."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        weight = layer.weight.detach()  # the masked weight
        bias = layer.bias.detach() if layer.bias is not None else None
        fr, mr = layer.in_request, layer.out_request
        self.register_buffer("w_request", weight[:mr, :fr].contiguous())
        self.register_buffer("b_request", None if bias is None else bias[:mr].clone())
        columns = range(layer.in_features)
        self.candidate = SplitLinear(
            weight[mr:], None if bias is None else bias[mr:], columns[:fr], columns[fr:]
        )

    def forward(self, x_request, x_candidate, candidate_to_request):
        request = F.linear(x_request, self.w_request, self.b_request)
        return request, self.candidate(x_request, x_candidate, candidate_to_request)


class HandGLMDCN(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.cross = nn.ModuleList(
            nn.ModuleList(LaneLinear(w) for w in layer.w) for layer in model.cross
        )
        glm_layers = [layer for layer in model.deep if hasattr(layer, "out_request")]
        others = {type(layer) for layer in model.deep} - {type(g) for g in glm_layers}
        assert others <= {nn.ReLU, nn.Dropout}, others  # Linear, ReLU, Dropout (eval) blocks
        self.deep = nn.ModuleList(LaneLinear(layer) for layer in glm_layers)
        self.head = SplitLinear.of(model.head, glm_layers[-1].out_request)

    def forward(self, user_dense, user_sparse, item_sparse, item_dense, candidate_to_request):
        m, idx = self.model, candidate_to_request
        user = [t(user_sparse[:, i]) for i, t in enumerate(m.user_tables)]
        items = [t(item_sparse[:, i]) for i, t in enumerate(m.item_tables)]
        x0_r = torch.cat([user_dense, *user], dim=-1)  # [R, 56]
        x0_c = torch.cat([*items, item_dense], dim=-1)  # [N, 52]
        x_r, x_c = x0_r, x0_c
        for low_rank, full in self.cross:
            h_r, h_c = full(*low_rank(x_r, x_c, idx), idx)
            x_r, x_c = x0_r * h_r + x_r, x0_c * h_c + x_c
        for layer in self.deep:
            x_r, x_c = (torch.relu(t) for t in layer(x_r, x_c, idx))
        return self.head(x_r, x_c, idx).squeeze(-1)
