"""Model-level GLM blocks assembled from :mod:`rocs_compiler.layers`."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .layers import GLMFactorizationMachine, GLMLinearCompression

__all__ = ["GLMWukongLayer", "RequestFixedGate"]


class GLMWukongLayer(nn.Module):
    """A Wukong layer over [B, F, D] fields with request fields first, kept first.

    ``out = LayerNorm(cat([fmb_r, lcb_r, fmb_c, lcb_c], dim=1) + residual(X))`` where the FMB is a
    :class:`GLMFactorizationMachine`, the LCB a :class:`GLMLinearCompression`, and the residual
    ``X`` itself when the (request, candidate) field counts are kept, else another GLM linear
    compression. The LayerNorm acts per field over ``D``, so it keeps every field in its group.
    """

    def __init__(
        self,
        fields: tuple[int, int],
        fmb: tuple[int, int],
        lcb: tuple[int, int],
        dim: int,
        fmb_hidden: Sequence[tuple[int, int]],
    ):
        super().__init__()
        self.fields, self.dim = fields, dim
        self.fmb_lanes, self.lcb_lanes = fmb, lcb
        self.fmb = GLMFactorizationMachine(fields[0], fields[1], dim, fmb[0], fmb[1], fmb_hidden)
        self.lcb = GLMLinearCompression(fields[0], fields[1], lcb[0], lcb[1])
        self.out_fields = (fmb[0] + lcb[0], fmb[1] + lcb[1])
        self.res = (
            None if self.out_fields == fields else GLMLinearCompression(*fields, *self.out_fields)
        )
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fmb, lcb = self.fmb(x), self.lcb(x)
        nf, nl = self.fmb_lanes[0], self.lcb_lanes[0]
        out = torch.cat([fmb[:, :nf], lcb[:, :nl], fmb[:, nf:], lcb[:, nl:]], dim=1)
        residual = x if self.res is None else self.res(x)
        return self.norm(out + residual)


class RequestFixedGate(nn.Module):
    """A feature gate whose context is candidate-only, GLM-masked.

    FinalMLP's gate ``flat * 2 sigmoid(MLP(ctx))`` with ``ctx`` the candidate fields would make
    every gated lane candidate-dependent. Masking the gate MLP so its request outputs see no
    candidate input leaves them a function of the bias alone, a learned constant:

        ``cat([flat_r * 2 sigmoid(p), flat_c * 2 sigmoid(MLP(ctx))], -1)``

    so the request lanes of ``flat`` stay request-only.
    """

    def __init__(self, request_dim: int, mlp: nn.Module):
        super().__init__()
        self.request_dim = request_dim
        self.request_logit = nn.Parameter(torch.zeros(request_dim))
        self.mlp = mlp

    def forward(self, flat: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        d = self.request_dim
        request = flat[:, :d] * (2 * torch.sigmoid(self.request_logit))
        candidate = flat[:, d:] * (2 * torch.sigmoid(self.mlp(ctx)))
        return torch.cat([request, candidate], dim=-1)
