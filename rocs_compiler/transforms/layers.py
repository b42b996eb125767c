"""ROCS-native layers: Generalized Layer Masking (GLM) and Deep Cross Attention (DCA).

GLM splits every hidden state into an ordered *request group* (first) and *candidate group*
(last). Information may flow from request lanes into candidate lanes, never back, so the request
lanes of every layer are functions of request-side inputs only and the compiler runs them once
per request. Each layer here produces its output as ``torch.cat([request, candidate], -1)`` (or
along the feature axis for ``[B, F, D]`` stacks) of per-group computations: the request outputs
are computed from the request inputs alone, so the masked block is *structural*, skipped by the
forward rather than multiplied by zero. Eager, training and compiled models therefore agree on
every input, an inf or NaN in a candidate lane included (``x @ (W * mask).T`` would put
``inf * 0 = NaN`` into the request lanes), and the compiler needs no weight values to find the
lanes: the concatenation rewrites read them from the graph. Zeros in ordinary weights are never
exploited: they change when weights are refreshed, and skipping them changes NaN propagation.

Masked weights are ``torch.nn.utils.parametrize`` parametrizations ``W = W_raw * mask`` with a
constant mask buffer, so ``layer.weight`` shows the zero block and is exactly zero there after
any optimizer step (weight decay included). The forward never reads the block, so it receives
exactly zero gradient; the raw block starts at zero and stays zero under SGD and Adam as well.

DCA keeps a history stack request-only: history tokens attend only to history tokens, and at
every depth request-side and candidate-side query tokens cross-attend into that depth's history
states through their own K/V projections. Only the candidate queries and their attention run per
candidate; the compiler computes the history stack and every K/V projection once per request.

Shapes use ``B`` rows (requests or candidates), ``D`` features, ``F`` feature fields, ``L``
history positions and ``H`` heads.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

__all__ = [
    "BlockMask",
    "CrossAttention",
    "DCABlock",
    "GLMFactorizationMachine",
    "GLMLinear",
    "GLMLinearCompression",
    "GroupLayerNorm",
    "glm_mask",
    "glm_mlp",
    "nonempty_key_mask",
]


def glm_mask(
    in_request: int, in_candidate: int, out_request: int, out_candidate: int
) -> torch.Tensor:
    """The GLM mask ``[[1, 0], [1, 1]]`` of shape [out, in]: request rows see request columns only."""
    mask = torch.ones(out_request + out_candidate, in_request + in_candidate)
    mask[:out_request, in_request:] = 0
    return mask


class BlockMask(nn.Module):
    """Parametrization ``W = W_raw * mask`` with a constant (non-trainable) mask buffer."""

    def __init__(self, mask: torch.Tensor):
        super().__init__()
        self.register_buffer("mask", mask)

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * self.mask

    def right_inverse(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * self.mask


def _check_groups(
    kind: str, in_request: int, in_candidate: int, out_request: int, out_candidate: int
):
    sizes = (in_request, in_candidate, out_request, out_candidate)
    if (
        any(s < 0 for s in sizes)
        or in_request + in_candidate == 0
        or out_request + out_candidate == 0
    ):
        raise ValueError(
            f"{kind}: group sizes must be >= 0 with non-empty input and output: {sizes}"
        )
    if out_request > 0 and in_request == 0:
        raise ValueError(
            f"{kind}: {out_request} request outputs but no request inputs (they could only be constants)"
        )


def _init_rows(weight: torch.Tensor, bias: torch.Tensor | None, fans: Sequence[tuple[int, int]]):
    """nn.Linear's default init, with each row block drawn for its own fan-in."""
    with torch.no_grad():
        start = 0
        for rows, fan_in in fans:
            bound = 1.0 / math.sqrt(max(fan_in, 1))
            weight[start : start + rows].uniform_(-bound, bound)
            if bias is not None:
                bias[start : start + rows].uniform_(-bound, bound)
            start += rows


Ranges = tuple[tuple[int, int], ...]


def _ranges(ranges: Sequence[tuple[int, int]] | None, prefix: int) -> Ranges:
    return ((0, prefix),) if ranges is None else tuple((int(a), int(b)) for a, b in ranges)


def _complement(ranges: Ranges, width: int) -> Ranges:
    out, start = [], 0
    for a, b in ranges:
        if a > start:
            out.append((start, a))
        start = b
    return tuple(out + ([(start, width)] if start < width else []))


def _take(t: torch.Tensor | None, ranges: Ranges, dim: int = -1) -> torch.Tensor | None:
    """The ``ranges`` of ``t`` along ``dim``, concatenated (one range: a slice)."""
    if t is None:
        return None
    pieces = [t.narrow(dim, a, b - a) for a, b in ranges]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def _lanes_mask(out: int, inp: int, request_out: Ranges, request_in: Ranges) -> torch.Tensor:
    """The GLM mask [out, in]: zero where a request output row meets a candidate input column."""
    rows = torch.zeros(out, dtype=torch.bool)
    cols = torch.zeros(inp, dtype=torch.bool)
    for a, b in request_out:
        rows[a:b] = True
    for a, b in request_in:
        cols[a:b] = True
    return (~(rows[:, None] & ~cols[None, :])).float()


class _BlockLowerTriangular(nn.Module):
    """A module whose ``weight`` [out, in] keeps the GLM mask: request rows read request inputs only.

    ``request_in`` / ``request_out`` are the (start, stop) ranges of the request columns of the
    input and of the request rows of the output (default: the first ``in_request`` /
    ``out_request``). Subclasses set ``self.weight`` and then call ``_mask_weight()``. A state
    dict of the unmasked layer (a plain ``weight``) loads with the masked entries zeroed.
    """

    def __init__(
        self,
        layer: str,
        in_request: int,
        in_candidate: int,
        out_request: int,
        out_candidate: int,
        request_in: Sequence[tuple[int, int]] | None = None,
        request_out: Sequence[tuple[int, int]] | None = None,
    ):
        super().__init__()
        _check_groups(layer, in_request, in_candidate, out_request, out_candidate)
        self.in_request, self.in_candidate = in_request, in_candidate
        self.out_request, self.out_candidate = out_request, out_candidate
        self.request_in = _ranges(request_in, in_request)
        self.request_out = _ranges(request_out, out_request)
        width_in, width_out = in_request + in_candidate, out_request + out_candidate
        if sum(b - a for a, b in self.request_in) != in_request or any(
            b > width_in for _, b in self.request_in
        ) or sum(b - a for a, b in self.request_out) != out_request or any(
            b > width_out for _, b in self.request_out
        ):
            raise ValueError(
                f"{layer}: lane ranges {self.request_in} -> {self.request_out} do not hold "
                f"{in_request} -> {out_request} request lanes"
            )
        self.prefix = self.request_in == ((0, in_request),) and self.request_out == (
            (0, out_request),
        )

    def _mask_weight(self) -> None:
        mask = _lanes_mask(
            self.out_request + self.out_candidate,
            self.in_request + self.in_candidate,
            self.request_out,
            self.request_in,
        )
        parametrize.register_parametrization(self, "weight", BlockMask(mask))
        self.register_load_state_dict_pre_hook(_load_plain_weight)

    @property
    def mask(self) -> torch.Tensor:
        return self.parametrizations.weight[0].mask


def _load_plain_weight(module, state_dict, prefix, *_) -> None:
    """Read a plain layer's ``weight`` as the raw weight with the masked block zeroed."""
    plain, raw = prefix + "weight", prefix + "parametrizations.weight.original"
    if plain in state_dict and raw not in state_dict:
        state_dict[raw] = state_dict.pop(plain) * module.mask
        state_dict.setdefault(prefix + "parametrizations.weight.0.mask", module.mask)


class GLMLinear(_BlockLowerTriangular):
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
            "GLMLinear", in_request, in_candidate, out_request, out_candidate,
            request_in, request_out,
        )
        self.in_features = in_request + in_candidate
        self.out_features = out_request + out_candidate
        self.weight = nn.Parameter(torch.empty(self.out_features, self.in_features))
        self.bias = nn.Parameter(torch.empty(self.out_features)) if bias else None
        _init_rows(
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
        w_rr = _take(_take(weight, rows, 0), cols, 1)
        request = F.linear(_take(x, cols), w_rr, _take(bias, rows, 0))
        if self.out_candidate == 0:
            return request
        other = _complement(rows, self.out_features)
        candidate = F.linear(x, _take(weight, other, 0), _take(bias, other, 0))
        return torch.cat(_interleave(request, candidate, rows, self.out_features), dim=-1)

    def extra_repr(self) -> str:
        lanes = (
            "" if self.prefix else f", request_in={self.request_in}, request_out={self.request_out}"
        )
        return (
            f"in=({self.in_request} request, {self.in_candidate} candidate), "
            f"out=({self.out_request} request, {self.out_candidate} candidate), "
            f"bias={self.bias is not None}{lanes}"
        )


def _interleave(
    request: torch.Tensor, candidate: torch.Tensor, rows: Ranges, width: int
) -> list[torch.Tensor]:
    """Slices of ``request`` and ``candidate`` (their columns in output order) put back in the
    order of the output's ``width`` columns, request columns at ``rows``."""
    pieces, taken = [], {"r": 0, "c": 0}
    other = _complement(rows, width)
    segments = sorted([(a, b, "r") for a, b in rows] + [(a, b, "c") for a, b in other])
    for a, b, group in segments:
        source = request if group == "r" else candidate
        pieces.append(source[..., taken[group] : taken[group] + b - a])
        taken[group] += b - a
    return pieces


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
        self.request_lanes = _ranges(request_lanes, request_dim)
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
        other = _complement(lanes, d + self.candidate_dim)
        request, candidate = self.request(_take(x, lanes)), self.candidate(_take(x, other))
        return torch.cat(_interleave(request, candidate, lanes, d + self.candidate_dim), dim=-1)


def _load_plain_norm(module, state_dict, prefix, *_) -> None:
    """Read a plain LayerNorm's ``weight`` / ``bias`` as the two groups' parameters."""
    lanes = module.request_lanes
    other = _complement(lanes, module.request_dim + module.candidate_dim)
    for name in ("weight", "bias"):
        plain = state_dict.pop(prefix + name, None)
        if plain is not None:
            state_dict.setdefault(f"{prefix}request.{name}", _take(plain, lanes))
            state_dict.setdefault(f"{prefix}candidate.{name}", _take(plain, other))


class GLMLinearCompression(_BlockLowerTriangular):
    """Linear compression over the feature axis (Wukong/DHEN LCB) with request fields first.

    ``X`` [B, F, D] holds ``in_request`` request fields first. ``W`` [M, F] is block
    lower-triangular like :class:`GLMLinear`'s weight, so

        ``W @ X == cat([W_RR @ X[:, :Fr], W[Mr:] @ X], dim=1)``

    and the first ``out_request`` output fields are request-only. The forward computes the right
    side: the two products and their concatenation along the field axis.
    """

    def __init__(self, in_request: int, in_candidate: int, out_request: int, out_candidate: int):
        super().__init__("GLMLinearCompression", in_request, in_candidate, out_request, out_candidate)
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


# ---------------------------------------------------------------------------------------------
# Deep Cross Attention


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
