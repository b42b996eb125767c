"""PyTorch's fused transformer fast paths in a dynamo graph, as the plain ops they compute.

In eval mode without autograd, ``nn.TransformerEncoderLayer`` (``batch_first=True``) and
``nn.MultiheadAttention`` (self-attention, ``batch_first=True``) skip their Python code and call
one fused op each: ``torch._transformer_encoder_layer_fwd`` and
``torch._native_multi_head_attention``. Dynamo records that op as one node over the whole
``[B, L, E]`` batch; it has no role rule, so everything it touches would run per candidate.
``torch.export``, which ``rocs.compile`` uses, never sees these ops (the modules take their slow
path while ``make_fx`` traces), so only the backend meets them.

Identity: each fused op is, for one batch row at a time, the module's slow-path computation::

    _native_multi_head_attention(x, x, x, E, H, W_qkv, b_qkv, W_o, b_o, mask, need_weights)
        = linear(sdpa(q, k, v, additive(mask)), W_o, b_o)
          with q, k, v = split(linear(x, W_qkv, b_qkv))
    _transformer_encoder_layer_fwd(src, ...)
        = norm_first:  x = src + mha(norm1(src));  x + ffn(norm2(x))
          else:        x = norm1(src + mha(src));  norm2(x + ffn(x))

with ``ffn(x) = linear(act(linear(x, W1, b1)), W2, b2)``, ``act`` gelu or relu; a query that sees
no key (every key masked out) is NaN, as in the fused op. No row of the batch reads another, so
after the replacement the ordinary role rules share the encoder of a request input once per
request.

:func:`decompose_fast_paths` replaces the ops' nodes in a copy of the graph by calls of the
functions below; the graph's other nodes, and their metadata, are kept.
"""

from __future__ import annotations

import copy
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import fx

__all__ = ["FAST_PATH_OPS", "decompose_fast_paths", "fast_path_ops"]


def _additive_mask(
    mask: Optional[torch.Tensor], mask_type: Optional[int], batch: int, length: int
) -> Optional[torch.Tensor]:
    """The fused op's mask as an additive mask broadcastable to ``[B, H, L, L]``: type 0 is an
    attention mask ``[L, L]``, type 1 a key padding mask ``[B, L]``, type 2 both merged
    ``[B, H, L, L]``; boolean masks mark masked-out keys with True."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill(
            mask, float("-inf")
        )
    if mask_type == 1:
        return mask.view(batch, 1, 1, length)
    return mask


def _attention(
    x: torch.Tensor,
    embed_dim: int,
    num_heads: int,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor,
    proj_weight: torch.Tensor,
    proj_bias: torch.Tensor,
    mask: Optional[torch.Tensor],
    mask_type: Optional[int],
    need_weights: bool = False,
    average_attn_weights: bool = True,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Self-attention of ``x [B, L, E]`` as ``_native_multi_head_attention`` computes it."""
    batch, length = x.shape[0], x.shape[1]
    head_dim = embed_dim // num_heads
    qkv = F.linear(x, qkv_weight, qkv_bias).view(batch, length, 3, num_heads, head_dim)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, H, L, d]
    additive = _additive_mask(mask, mask_type, batch, length)
    if need_weights:
        scores = q @ k.transpose(-2, -1) / math.sqrt(head_dim)
        if additive is not None:
            scores = scores + additive.to(scores.dtype)
        weights = torch.softmax(scores, -1)
        out = weights @ v
        weights = weights.mean(1) if average_attn_weights else weights
    else:
        if additive is not None:
            additive = additive.to(q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=additive)
        if additive is not None:
            # A query that sees no key is NaN in the fused op (softmax over -inf only) and 0 in
            # scaled_dot_product_attention.
            closed = (additive == float("-inf")).all(-1, keepdim=True)
            out = out.masked_fill(closed, float("nan"))
        weights = None
    out = out.transpose(1, 2).reshape(batch, length, embed_dim)
    return F.linear(out, proj_weight, proj_bias), weights


def native_multi_head_attention(
    query,
    key,
    value,
    embed_dim,
    num_head,
    qkv_weight,
    qkv_bias,
    proj_weight,
    proj_bias,
    mask=None,
    need_weights=True,
    average_attn_weights=True,
    mask_type=None,
):
    """``torch._native_multi_head_attention`` for self-attention (what the module's fast path
    calls: ``query is key is value``)."""
    if query is not key or key is not value:
        return torch._native_multi_head_attention(
            query, key, value, embed_dim, num_head, qkv_weight, qkv_bias, proj_weight, proj_bias,
            mask, need_weights, average_attn_weights, mask_type,
        )  # fmt: skip
    out, weights = _attention(
        query, embed_dim, num_head, qkv_weight, qkv_bias, proj_weight, proj_bias, mask,
        mask_type, need_weights, average_attn_weights,
    )  # fmt: skip
    return out, weights if weights is not None else out.new_empty(0)


def transformer_encoder_layer_fwd(
    src,
    embed_dim,
    num_heads,
    qkv_weight,
    qkv_bias,
    proj_weight,
    proj_bias,
    use_gelu,
    norm_first,
    eps,
    norm_weight_1,
    norm_bias_1,
    norm_weight_2,
    norm_bias_2,
    ffn_weight_1,
    ffn_bias_1,
    ffn_weight_2,
    ffn_bias_2,
    mask=None,
    mask_type=None,
):
    """``torch._transformer_encoder_layer_fwd`` as ``nn.TransformerEncoderLayer``'s slow path."""
    shape = (embed_dim,)

    def attend(x):
        return _attention(
            x, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, mask,
            mask_type,
        )[0]  # fmt: skip

    def ffn(x):
        hidden = F.linear(x, ffn_weight_1, ffn_bias_1)
        hidden = F.gelu(hidden) if use_gelu else F.relu(hidden)
        return F.linear(hidden, ffn_weight_2, ffn_bias_2)

    if norm_first:
        x = src + attend(F.layer_norm(src, shape, norm_weight_1, norm_bias_1, eps))
        return x + ffn(F.layer_norm(x, shape, norm_weight_2, norm_bias_2, eps))
    x = F.layer_norm(src + attend(src), shape, norm_weight_1, norm_bias_1, eps)
    return F.layer_norm(x + ffn(x), shape, norm_weight_2, norm_bias_2, eps)


FAST_PATH_OPS = {
    torch._transformer_encoder_layer_fwd: transformer_encoder_layer_fwd,
    torch._native_multi_head_attention: native_multi_head_attention,
}


def fast_path_ops(gm: fx.GraphModule) -> list[str]:
    """The names of the fast-path ops ``gm`` calls (``torch._transformer_encoder_layer_fwd``)."""
    found = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    return [f"torch.{t.__name__}" for t in FAST_PATH_OPS if t in found]


def decompose_fast_paths(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` itself when it calls no fast-path op, else a copy calling the plain functions."""
    if not fast_path_ops(gm):
        return gm
    graph = copy.deepcopy(gm.graph)
    for node in graph.nodes:
        if node.op == "call_function" and node.target in FAST_PATH_OPS:
            node.target = FAST_PATH_OPS[node.target]
    return fx.GraphModule(gm, graph)
