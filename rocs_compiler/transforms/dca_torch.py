"""Deep Cross Attention forms of torch's own transformer modules.

A sequence ``[history; candidate tokens]`` of ``S = L + C`` tokens runs through
``nn.TransformerEncoder`` / ``nn.TransformerEncoderLayer`` / self-attention
``nn.MultiheadAttention``. In the DCA form the first ``L`` positions (the history) attend only to
history positions, and the last ``C`` (the candidate tokens) attend to the history and to the
candidate tokens. Because attention is the only op that mixes positions, and every other op of
an encoder layer (projections, residuals, norms, FFN) acts on each position alone, the history
rows of every layer's output are then a function of the history rows of its input:

    ``h' = layer(h)`` restricted to history keys,  ``c' = layer(c | keys h, c)``.

The forms below compute exactly that, on the two streams kept apart from the first layer to the
last, so the history stack and its key/value projections are request-only where the history is,
and per candidate remain the candidate tokens' projections, their attention over ``L + C`` keys
and their FFN. The modules keep their class's parameters, buffers and submodule names (each is
the original module with its ``forward`` replaced), so the original's ``state_dict`` loads and
training works as before; the attention pattern differs, so the model must be trained or
fine-tuned.

Masks: ``key_padding_mask`` (bool ``[B, S]``, True = ignore) and an attention mask (bool or
additive float ``[S, S]``) are split the same way. A history row left without any key (an empty
history) attends to every history position instead
(:func:`~rocs_compiler.layers.nonempty_key_mask`), so it stays finite; a candidate row the same over its keys.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from .layers import nonempty_key_mask

__all__ = [
    "DCAMultiheadAttention",
    "DCATransformerEncoder",
    "DCATransformerEncoderLayer",
    "check_self_attention",
]

Tensor = torch.Tensor


def check_self_attention(mha: nn.MultiheadAttention, path: str) -> None:
    """Raise ``ValueError`` unless ``mha`` is an attention the DCA forms can split."""
    problems = []
    if not mha._qkv_same_embed_dim:
        problems.append("kdim/vdim differ from embed_dim")
    if mha.bias_k is not None:
        problems.append("add_bias_kv=True")
    if mha.add_zero_attn:
        problems.append("add_zero_attn=True")
    if problems:
        raise ValueError(
            f"apply_dca: the nn.MultiheadAttention at {path or 'the model'} has "
            f"{', '.join(problems)}; DCA needs one packed in_proj over the token states"
        )


# ---------------------------------------------------------------------------------------------
# The two streams through one attention and one encoder layer (batch first: [B, L, D], [B, C, D])


class _Masks:
    """Boolean keep masks (True = attend) for the history rows and the candidate rows, or
    additive float masks when the attention mask is a float."""

    def __init__(self, length: int, total: int, key_padding: Tensor | None,
                 attn_mask: Tensor | None, dtype: torch.dtype):  # fmt: skip
        keep_h = keep_c = None
        if key_padding is not None:
            if key_padding.dtype != torch.bool:
                raise ValueError("apply_dca: key padding masks must be boolean (True = ignore)")
            keep_h = ~key_padding[:, None, :length]  # [B, 1, L]
            keep_c = ~key_padding[:, None, :]  # [B, 1, S]
        if attn_mask is not None:
            if attn_mask.dim() != 2 or tuple(attn_mask.shape) != (total, total):
                raise ValueError(
                    f"apply_dca: attention masks must be [S, S] = [{total}, {total}] "
                    f"(got {tuple(attn_mask.shape)})"
                )
            if attn_mask.dtype == torch.bool:
                keep_h = _and(keep_h, ~attn_mask[None, :length, :length])
                keep_c = _and(keep_c, ~attn_mask[None, length:, :])
            else:  # an additive mask: combine into float biases
                bias_h = attn_mask[None, :length, :length].to(dtype)
                bias_c = attn_mask[None, length:, :].to(dtype)
                if keep_h is not None:
                    bias_h = bias_h.masked_fill(~keep_h, float("-inf"))
                    bias_c = bias_c.masked_fill(~keep_c, float("-inf"))
                self.history, self.candidate = bias_h, bias_c
                return
        self.history = None if keep_h is None else nonempty_key_mask(keep_h)
        self.candidate = None if keep_c is None else nonempty_key_mask(keep_c)


def _and(a: Tensor | None, b: Tensor) -> Tensor:
    return b if a is None else a & b


def _heads(x: Tensor, heads: int) -> Tensor:
    return x.unflatten(-1, (heads, -1)).transpose(1, 2)  # [B, T, D] -> [B, H, T, Dh]


def _attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout: float) -> Tensor:
    if mask is not None:
        mask = mask.unsqueeze(1)  # [B | 1, 1, Tq | 1, Tk]: the same for every head
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
    return out.transpose(1, 2).flatten(2)


def dca_attention(
    mha: nn.MultiheadAttention, history: Tensor, candidate: Tensor, masks: _Masks
) -> tuple[Tensor, Tensor]:
    """``mha``'s self-attention over ``[history; candidate]`` in DCA form (batch first)."""
    heads = mha.num_heads
    dropout = mha.dropout if mha.training else 0.0
    q_h, k_h, v_h = (
        _heads(t, heads)
        for t in F.linear(history, mha.in_proj_weight, mha.in_proj_bias).chunk(3, -1)
    )
    q_c, k_c, v_c = (
        _heads(t, heads)
        for t in F.linear(candidate, mha.in_proj_weight, mha.in_proj_bias).chunk(3, -1)
    )
    a_h = _attend(q_h, k_h, v_h, masks.history, dropout)
    keys, values = torch.cat([k_h, k_c], dim=2), torch.cat([v_h, v_c], dim=2)
    a_c = _attend(q_c, keys, values, masks.candidate, dropout)
    return mha.out_proj(a_h), mha.out_proj(a_c)


def dca_layer(
    layer: nn.TransformerEncoderLayer, history: Tensor, candidate: Tensor, masks: _Masks
) -> tuple[Tensor, Tensor]:
    """``layer`` (post- or pre-LN, as configured) in DCA form on the two streams."""

    def ff(x: Tensor) -> Tensor:
        return layer.dropout2(layer.linear2(layer.dropout(layer.activation(layer.linear1(x)))))

    if layer.norm_first:
        a_h, a_c = dca_attention(
            layer.self_attn, layer.norm1(history), layer.norm1(candidate), masks
        )
        history, candidate = history + layer.dropout1(a_h), candidate + layer.dropout1(a_c)
        return history + ff(layer.norm2(history)), candidate + ff(layer.norm2(candidate))
    a_h, a_c = dca_attention(layer.self_attn, history, candidate, masks)
    history = layer.norm1(history + layer.dropout1(a_h))
    candidate = layer.norm1(candidate + layer.dropout1(a_c))
    return layer.norm2(history + ff(history)), layer.norm2(candidate + ff(candidate))


# ---------------------------------------------------------------------------------------------
# Modules


class _DCAForm:
    """Mixin: the original module (deep copy) with ``forward`` replaced by its DCA form."""

    history_length: int
    base: type  # the torch class whose forward this form replaces

    @classmethod
    def convert(cls, module: nn.Module, history_length: int):
        """A copy of ``module`` as ``cls``: same parameters, buffers and submodule names."""
        if type(module) is not cls.base:
            raise TypeError(f"{cls.__name__}.convert: got {type(module).__name__}")
        if history_length < 1:
            raise ValueError(f"apply_dca: history_length must be >= 1, got {history_length}")
        new = copy.deepcopy(module)
        new.__class__ = cls
        new.history_length = history_length
        return new

    def extra_repr(self) -> str:
        base = super().extra_repr()  # type: ignore[misc]
        return f"{base}, history_length={self.history_length}" if base else (
            f"history_length={self.history_length}"
        )

    def _split(self, x: Tensor, batch_first: bool) -> tuple[Tensor, Tensor]:
        """(history [B, L, D], candidate [B, C, D]) of the sequence ``x``."""
        if not batch_first:
            x = x.transpose(0, 1)
        total = x.shape[1]
        if total <= self.history_length:
            raise ValueError(
                f"{type(self).__name__}: a sequence of {total} tokens has no candidate token "
                f"after the {self.history_length} history tokens"
            )
        return x[:, : self.history_length], x[:, self.history_length :]

    @staticmethod
    def _join(history: Tensor, candidate: Tensor, batch_first: bool) -> Tensor:
        out = torch.cat([history, candidate], dim=1)
        return out if batch_first else out.transpose(0, 1)


def _masks(module: _DCAForm, x: Tensor, batch_first: bool, key_padding, attn_mask, causal):
    total = x.shape[1] if batch_first else x.shape[0]
    if causal and attn_mask is None:
        attn_mask = torch.ones(total, total, dtype=torch.bool, device=x.device).triu(1)
    return _Masks(module.history_length, total, key_padding, attn_mask, x.dtype)


class DCATransformerEncoder(_DCAForm, nn.TransformerEncoder):
    """``nn.TransformerEncoder`` in DCA form (every layer a DCA layer, then the final norm)."""

    base = nn.TransformerEncoder

    def forward(self, src, mask=None, src_key_padding_mask=None, is_causal=None):
        batch_first = self.layers[0].self_attn.batch_first
        masks = _masks(self, src, batch_first, src_key_padding_mask, mask, is_causal)
        history, candidate = self._split(src, batch_first)
        for layer in self.layers:
            history, candidate = dca_layer(layer, history, candidate, masks)
        if self.norm is not None:
            history, candidate = self.norm(history), self.norm(candidate)
        return self._join(history, candidate, batch_first)


class DCATransformerEncoderLayer(_DCAForm, nn.TransformerEncoderLayer):
    """``nn.TransformerEncoderLayer`` in DCA form."""

    base = nn.TransformerEncoderLayer

    def forward(self, src, src_mask=None, src_key_padding_mask=None, is_causal=False):
        batch_first = self.self_attn.batch_first
        masks = _masks(self, src, batch_first, src_key_padding_mask, src_mask, is_causal)
        history, candidate = self._split(src, batch_first)
        history, candidate = dca_layer(self, history, candidate, masks)
        return self._join(history, candidate, batch_first)


class DCAMultiheadAttention(_DCAForm, nn.MultiheadAttention):
    """Self-attention ``nn.MultiheadAttention`` in DCA form; returns ``(output, None)``."""

    base = nn.MultiheadAttention

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True,
                attn_mask=None, average_attn_weights=True, is_causal=False):  # fmt: skip
        if key is not query or value is not query:
            raise ValueError(
                "DCAMultiheadAttention: DCA splits a self-attention; call it with "
                "query, key and value the same tensor"
            )
        masks = _masks(self, query, self.batch_first, key_padding_mask, attn_mask, is_causal)
        history, candidate = self._split(query, self.batch_first)
        a_h, a_c = dca_attention(self, history, candidate, masks)
        return self._join(a_h, a_c, self.batch_first), None
