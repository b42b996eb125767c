"""The GLM layers: :class:`GLMLinear`, :class:`GroupLayerNorm`, :class:`GLMLinearCompression`,
:func:`glm_mlp` and :class:`GLMFactorizationMachine`.

Each layer computes its request outputs from its request inputs alone and returns
``cat([request, candidate])`` of per-group results, which equals the plain layer with the GLM
mask applied (``W = [[W_RR, 0], [W_CR, W_CC]]``): the masked block is skipped by the forward,
never multiplied by zero (``layers.py`` says why). Masks and lane ranges: ``glm_masking.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .glm_masking import (
    BlockLowerTriangular,
    as_ranges,
    complement,
    init_rows,
    interleave,
    take,
)


class GLMLinear(BlockLowerTriangular):
    """A linear layer whose request outputs read request inputs only.

    ``x`` is ``cat([x_r, x_c], -1)`` with ``in_request`` request lanes first. The weight is block
    lower-triangular, ``W = [[W_RR, 0], [W_CR, W_CC]]`` (rows: request outputs first), so

        ``linear(x, W, b) == cat([linear(x_r, W_RR, b_R), linear(x, [W_CR, W_CC], b_C)], -1)``

    and the first ``out_request`` outputs are a request lane. The forward computes the right side,
    so the zero block ``W_RC`` is never read (an inf in a candidate input stays out of the
    request outputs, in eager as in the compiled model).

    With ``request_in`` / ``request_out`` ranges the request lanes sit anywhere: ``x_r`` is the
    concatenation of the request column ranges of ``x``, the two products are computed as above
    from the matching rows and columns of ``W``, and the output puts each row back at its place,
    so ``W`` keeps the row and column order of the plain layer it replaces.
    """

    def __init__(
        self,
        in_request: int,
        in_candidate: int,
        out_request: int,
        out_candidate: int,
        bias: bool = True,
        *,
        request_in: Sequence[tuple[int, int]] | None = None,
        request_out: Sequence[tuple[int, int]] | None = None,
    ):
        super().__init__(
            "GLMLinear",
            in_request,
            in_candidate,
            out_request,
            out_candidate,
            request_in,
            request_out,
        )
        self.in_features = in_request + in_candidate
        self.out_features = out_request + out_candidate
        self.weight = nn.Parameter(torch.empty(self.out_features, self.in_features))
        self.bias = nn.Parameter(torch.empty(self.out_features)) if bias else None
        init_rows(
            self.weight, self.bias, [(out_request, in_request), (out_candidate, self.in_features)]
        )
        self._mask_weight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias, fr, mr = self.weight, self.bias, self.in_request, self.out_request
        if mr == 0:
            return F.linear(x, weight, bias)
        if not self.prefix:
            return self._forward_ranges(x, weight, bias)
        request = F.linear(x[..., :fr], weight[:mr, :fr], None if bias is None else bias[:mr])
        if self.out_candidate == 0:
            return request
        candidate = F.linear(x, weight[mr:], None if bias is None else bias[mr:])
        return torch.cat([request, candidate], dim=-1)

    def _forward_ranges(self, x, weight, bias) -> torch.Tensor:
        rows, cols = self.request_out, self.request_in
        w_rr = take(take(weight, rows, 0), cols, 1)
        request = F.linear(take(x, cols), w_rr, take(bias, rows, 0))
        if self.out_candidate == 0:
            return request
        other = complement(rows, self.out_features)
        candidate = F.linear(x, take(weight, other, 0), take(bias, other, 0))
        return torch.cat(interleave(request, candidate, rows, self.out_features), dim=-1)

    def extra_repr(self) -> str:
        lanes = (
            "" if self.prefix else f", request_in={self.request_in}, request_out={self.request_out}"
        )
        return (
            f"in=({self.in_request} request, {self.in_candidate} candidate), "
            f"out=({self.out_request} request, {self.out_candidate} candidate), "
            f"bias={self.bias is not None}{lanes}"
        )


class GroupLayerNorm(nn.Module):
    """LayerNorm with separate statistics per group:
    ``cat([ln_r(x[..., :dr]), ln_c(x[..., dr:])], -1)``.

    A plain LayerNorm over the full width would mix candidate statistics into request lanes.
    With ``request_lanes`` ranges the request group is those columns (the two groups are
    normalized apart and put back at their columns).
    """

    def __init__(
        self,
        request_dim: int,
        candidate_dim: int,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        *,
        request_lanes: Sequence[tuple[int, int]] | None = None,
    ):
        super().__init__()
        if request_dim <= 0 or candidate_dim <= 0:
            raise ValueError(
                f"GroupLayerNorm: both groups must be non-empty: {request_dim}, {candidate_dim}"
            )
        self.request_dim, self.candidate_dim = request_dim, candidate_dim
        self.request_lanes = as_ranges(request_lanes, request_dim)
        if sum(b - a for a, b in self.request_lanes) != request_dim:
            raise ValueError(
                f"GroupLayerNorm: {self.request_lanes} do not hold {request_dim} lanes"
            )
        self.request = nn.LayerNorm(request_dim, eps=eps, elementwise_affine=elementwise_affine)
        self.candidate = nn.LayerNorm(candidate_dim, eps=eps, elementwise_affine=elementwise_affine)
        self.register_load_state_dict_pre_hook(_load_plain_norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d, lanes = self.request_dim, self.request_lanes
        if lanes == ((0, d),):
            return torch.cat([self.request(x[..., :d]), self.candidate(x[..., d:])], dim=-1)
        other = complement(lanes, d + self.candidate_dim)
        request, candidate = self.request(take(x, lanes)), self.candidate(take(x, other))
        return torch.cat(interleave(request, candidate, lanes, d + self.candidate_dim), dim=-1)


def _load_plain_norm(module, state_dict, prefix, *_) -> None:
    """Read a plain LayerNorm's ``weight`` / ``bias`` as the two groups' parameters."""
    lanes = module.request_lanes
    other = complement(lanes, module.request_dim + module.candidate_dim)
    for name in ("weight", "bias"):
        plain = state_dict.pop(prefix + name, None)
        if plain is not None:
            state_dict.setdefault(f"{prefix}request.{name}", take(plain, lanes))
            state_dict.setdefault(f"{prefix}candidate.{name}", take(plain, other))


class GLMLinearCompression(BlockLowerTriangular):
    """Linear compression over the feature axis (Wukong/DHEN LCB) with request fields first.

    ``X`` [B, F, D] holds ``in_request`` request fields first. ``W`` [M, F] is block
    lower-triangular like :class:`GLMLinear`'s weight, so

        ``W @ X == cat([W_RR @ X[:, :Fr], W[Mr:] @ X], dim=1)``

    and the first ``out_request`` output fields are request-only. The forward computes the right
    side: the two products and their concatenation along the field axis.
    """

    def __init__(self, in_request: int, in_candidate: int, out_request: int, out_candidate: int):
        super().__init__(
            "GLMLinearCompression", in_request, in_candidate, out_request, out_candidate
        )
        num_in, num_out = in_request + in_candidate, out_request + out_candidate
        weight = torch.randn(num_out, num_in)
        weight[:out_request] /= math.sqrt(in_request) if in_request else 1.0
        weight[out_request:] /= math.sqrt(num_in)
        self.weight = nn.Parameter(weight)
        self._mask_weight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, F, D] -> [B, M, D]."""
        weight, fr, mr = self.weight, self.in_request, self.out_request
        if mr == 0:
            return torch.matmul(weight, x)
        request = torch.matmul(weight[:mr, :fr], x[:, :fr])
        if self.out_candidate == 0:
            return request
        return torch.cat([request, torch.matmul(weight[mr:], x)], dim=1)

    def extra_repr(self) -> str:
        return (
            f"fields in=({self.in_request} request, {self.in_candidate} candidate), "
            f"out=({self.out_request} request, {self.out_candidate} candidate)"
        )


def glm_mlp(
    in_groups: tuple[int, int],
    lanes: Sequence[tuple[int, int]],
    *,
    activation: Callable[[], nn.Module] = nn.ReLU,
    dropout: float = 0.0,
    last_activation: bool = False,
) -> nn.Sequential:
    """An MLP of :class:`GLMLinear` layers; ``lanes[i]`` = (request, candidate) width of layer i.

    Activations and dropout act elementwise, so they keep each lane in its group.
    """
    layers: list[nn.Module] = []
    prev = in_groups
    for i, out in enumerate(lanes):
        layers.append(GLMLinear(prev[0], prev[1], out[0], out[1]))
        if i < len(lanes) - 1 or last_activation:
            layers.append(activation())
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
        prev = out
    return nn.Sequential(*layers)


class GLMFactorizationMachine(nn.Module):
    """Wukong's factorization-machine block with request fields kept request-only.

    ``X`` [B, F, D] holds ``num_request`` request fields first. The pairwise products are
    gathered as two groups,

        ``request = flatten(X_r X_r^T)`` [B, Fr * Fr] and ``candidate = flatten(X_c X^T)`` [B, Fc * F],

    which together hold every product of the full ``X X^T`` (the request-candidate block once,
    via symmetry). A :class:`GroupLayerNorm` and a GLM MLP map them to ``out_request`` request
    output fields, computed from request-request products only, and ``out_candidate`` fields
    that see every product. Output: ``cat([request fields, candidate fields], dim=1)``
    [B, out_request + out_candidate, D].
    """

    def __init__(
        self,
        num_request: int,
        num_candidate: int,
        dim: int,
        out_request: int,
        out_candidate: int,
        hidden: Sequence[tuple[int, int]] = ((128, 128),),
    ):
        super().__init__()
        if num_request <= 0 or num_candidate <= 0 or out_request <= 0 or out_candidate < 0:
            raise ValueError(
                "GLMFactorizationMachine: needs request and candidate fields and request outputs, got "
                f"{(num_request, num_candidate, out_request, out_candidate)}"
            )
        self.num_request, self.num_candidate, self.dim = num_request, num_candidate, dim
        self.out_request, self.out_candidate = out_request, out_candidate
        groups = (num_request * num_request, num_candidate * (num_request + num_candidate))
        self.norm = GroupLayerNorm(*groups)
        self.mlp = glm_mlp(groups, [*hidden, (out_request * dim, out_candidate * dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, F, D] -> [B, out_request + out_candidate, D]."""
        fr = self.num_request
        x_r = x[:, :fr]
        products = torch.cat(
            [
                torch.bmm(x_r, x_r.transpose(1, 2)).flatten(1),
                torch.bmm(x[:, fr:], x.transpose(1, 2)).flatten(1),
            ],
            dim=-1,
        )
        z = self.mlp(self.norm(products))
        split = self.out_request * self.dim
        request = z[:, :split].unflatten(-1, (self.out_request, self.dim))
        if self.out_candidate == 0:
            return request
        candidate = z[:, split:].unflatten(-1, (self.out_candidate, self.dim))
        return torch.cat([request, candidate], dim=1)
