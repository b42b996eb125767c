"""``apply_dca`` conversions of the zoo's sequence models and the ``SequenceNet`` backbone.

BST, HSTU and ``SequenceNet`` (:mod:`.backbones`) name this module in ``__rocs_conversions__``:
``apply_dca`` imports it the first time it meets one of them, so the zoo stays importable
without ``rocs_compiler``.

- ``BST`` and ``SequenceNet``: every encoder layer becomes a
  :class:`~rocs_compiler.layers.DCABlock` whose streams start from that layer's weights
  (:class:`DCABST`, :class:`DCASequenceNet`). The attention pattern changes, so the model must be
  trained or fine-tuned.
- ``HSTU``: causal attention with the candidate last is already request-only on the history
  positions, so the DCA form (:class:`DCAHSTU`) computes the history stack on the history alone
  and the candidate's row separately; the result equals the original model (up to float
  re-association).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from rocs_compiler.transforms.layers import CrossAttention, DCABlock
from rocs_compiler.transforms import register_dca_model
from rocs_compiler.transforms.glm import expect_type, refuse

from . import backbones, bst, hstu
from .bst import MHAEncoderLayer, SDPAEncoderLayer
from .hstu import HSTULayer

__all__ = ["DCABST", "DCAHSTU", "DCASequenceNet", "HSTUCrossLayer", "dca_block_from_encoder"]

# ---------------------------------------------------------------------------------------------
# Encoder layers -> DCA blocks


def _attention_from_encoder(layer: nn.Module, path: str) -> CrossAttention:
    """A :class:`CrossAttention` holding a copy of a post-LN encoder layer's weights."""
    if type(layer) is SDPAEncoderLayer:
        dim, heads = layer.qkv.in_features, layer.heads
        in_weight, in_bias, out = layer.qkv.weight, layer.qkv.bias, layer.out
    elif (
        type(layer) is MHAEncoderLayer and layer.attn.batch_first and layer.attn._qkv_same_embed_dim
    ):
        dim, heads = layer.attn.embed_dim, layer.attn.num_heads
        in_weight, in_bias, out = (
            layer.attn.in_proj_weight,
            layer.attn.in_proj_bias,
            layer.attn.out_proj,
        )
    else:
        raise refuse(layer, path, "apply_dca")
    new = CrossAttention(dim, heads, layer.ffn[0].out_features, dropout=layer.dropout.p)
    with torch.no_grad():
        for i, proj in enumerate((new.query, new.key, new.value)):
            proj.weight.copy_(in_weight[i * dim : (i + 1) * dim])
            proj.bias.copy_(in_bias[i * dim : (i + 1) * dim])
        new.out.load_state_dict(out.state_dict())
    new.norm1 = copy.deepcopy(layer.norm1)
    new.norm2 = copy.deepcopy(layer.norm2)
    new.ffn = copy.deepcopy(layer.ffn)  # keeps the layer's activation
    return new


def dca_block_from_encoder(layer: nn.Module, path: str, request_stream: bool) -> DCABlock:
    """A :class:`DCABlock` in place of an encoder layer; every stream starts as a copy of it."""
    first = _attention_from_encoder(layer, path)
    dim = first.query.in_features
    block = DCABlock(dim, first.heads, first.ffn[0].out_features, request_stream=request_stream)
    block.history = first
    block.candidate = _attention_from_encoder(layer, path)
    block.request = _attention_from_encoder(layer, path) if request_stream else None
    return block


class DCABST(nn.Module):
    """BST with DCA: the history stack runs on history tokens only; the target token
    cross-attends at every depth. Same inputs, head and feature layout as ``BST``."""

    def __init__(self, bst: nn.Module):
        super().__init__()
        self.profile_tables = copy.deepcopy(bst.profile_tables)
        self.item_table = copy.deepcopy(bst.item_table)
        self.position = copy.deepcopy(bst.position)
        self.blocks = nn.ModuleList(
            dca_block_from_encoder(layer, f"layers.{i}", request_stream=False)
            for i, layer in enumerate(bst.layers)
        )
        self.head = copy.deepcopy(bst.head)

    def forward(self, user_profile, user_dense, hist_item_ids, item_id) -> torch.Tensor:
        length = hist_item_ids.shape[1]
        history = self.item_table(hist_item_ids) + self.position[:length]
        target = (self.item_table(item_id) + self.position[length]).unsqueeze(1)
        key_mask = hist_item_ids != 0
        for block in self.blocks:
            history, target, _ = block(history, key_mask, target)
        profile = [t(user_profile[:, i]) for i, t in enumerate(self.profile_tables)]
        feats = torch.cat([*profile, user_dense, history.flatten(1), target.flatten(1)], dim=-1)
        return self.head(feats).squeeze(-1)


class DCASequenceNet(nn.Module):
    """``SequenceNet`` with DCA: history stack on history tokens, the candidate token and the
    user field tokens (request queries) cross-attend at every depth. The head reads the user
    tokens' final states where ``SequenceNet`` reads the user field embeddings."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.embed = copy.deepcopy(net.embed)
        self.position = copy.deepcopy(net.position)
        self.blocks = nn.ModuleList(
            dca_block_from_encoder(layer, f"layers.{i}", request_stream=True)
            for i, layer in enumerate(net.layers)
        )
        self.head = copy.deepcopy(net.head)

    def forward(self, user_sparse, history, item_sparse, item_multihot) -> torch.Tensor:
        length = history.shape[1]
        hist = self.embed.item_table(history) + self.position[:length]
        cand = (
            self.embed.candidate_fields(item_sparse, item_multihot).sum(dim=1)
            + self.position[length]
        )
        cand = cand.unsqueeze(1)
        user = self.embed.profile(user_sparse)
        key_mask = history != 0
        for block in self.blocks:
            hist, cand, user = block(hist, key_mask, cand, user)
        valid = key_mask.unsqueeze(-1).to(torch.float32)
        pooled = (hist * valid).sum(dim=1) / valid.sum(dim=1).clamp_min(1.0)
        return self.head(torch.cat([user.flatten(1), pooled, cand[:, 0]], dim=-1)).squeeze(-1)


# ---------------------------------------------------------------------------------------------
# HSTU


class HSTUCrossLayer(nn.Module):
    """An HSTU layer split into its history rows and the candidate's row.

    With the candidate at the last position of a causal sequence of length ``s = L + 1``, history
    row ``i`` reads positions ``j <= i < L`` only, so ``rows[:L]`` is the same layer on the history
    alone (causal ``[L, L]`` mask, same ``1 / s`` scale). The candidate row reads every valid
    history position plus itself:

        ``a_c = sum_j silu(q_c . k_j) / s * v_j + silu(q_c . k_c) / s * v_c``

    the first term an attention of the candidate's query over the request's keys and values.
    """

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = copy.deepcopy(layer)

    def _uvqk(self, x: torch.Tensor):
        return F.silu(self.layer.uvqk(self.layer.norm_in(x))).split(self.layer.dim, dim=-1)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        return t.unflatten(-1, (self.layer.heads, -1)).transpose(-3, -2)

    def forward(self, history, candidate, valid_history, valid_candidate):
        """history [B, L, D], candidate [B, 1, D], valid_* bool [B, L] / [B, 1]."""
        layer = self.layer
        length = history.shape[1]
        scale = length + 1
        u, v, q, k = self._uvqk(history)
        q, k, v = self._heads(q), self._heads(k), self._heads(v)  # [B, H, L, Dh]
        attn = F.silu(torch.matmul(q, k.transpose(-2, -1))) / scale
        mask = layer.causal[:length, :length] & valid_history[:, None, None, :]
        attn = attn.masked_fill(~mask, 0.0)
        a = torch.matmul(attn, v).transpose(1, 2).flatten(2)
        new_history = history + layer.out(u * layer.norm_attn(a))

        uc, vc, qc, kc = self._uvqk(candidate)
        qc, kc, vc = self._heads(qc), self._heads(kc), self._heads(vc)  # [B, H, 1, Dh]
        cross = F.silu(torch.matmul(qc, k.transpose(-2, -1))) / scale  # [B, H, 1, L]
        cross = cross.masked_fill(~valid_history[:, None, None, :], 0.0)
        own = F.silu((qc * kc).sum(dim=-1, keepdim=True)) / scale  # [B, H, 1, 1]
        own = own.masked_fill(~valid_candidate[:, None, :, None], 0.0)
        ac = (torch.matmul(cross, v) + own * vc).transpose(1, 2).flatten(2)
        new_candidate = candidate + layer.out(uc * layer.norm_attn(ac))
        return new_history, new_candidate


class DCAHSTU(nn.Module):
    """``HSTU`` computed as DCA: equal outputs, with the history stack request-only."""

    def __init__(self, hstu: nn.Module):
        super().__init__()
        for i, layer in enumerate(hstu.layers):
            expect_type(layer, HSTULayer, f"layers.{i}", "apply_dca")
        self.item_table = copy.deepcopy(hstu.item_table)
        self.action_table = copy.deepcopy(hstu.action_table)
        self.position = copy.deepcopy(hstu.position)
        self.layers = nn.ModuleList(HSTUCrossLayer(layer) for layer in hstu.layers)
        self.norm_out = copy.deepcopy(hstu.norm_out)
        self.head = copy.deepcopy(hstu.head)

    def forward(self, hist_item_ids, hist_actions, item_id) -> torch.Tensor:
        length = hist_item_ids.shape[1]
        positions = self.position.weight[: length + 1]  # a slice caps the length at the table
        history = self.item_table(hist_item_ids) + self.action_table(hist_actions)
        history = history + positions[:length]
        candidate = self.item_table(item_id).unsqueeze(1) + positions[length]
        valid_history = hist_item_ids != 0
        valid_candidate = (item_id != 0).unsqueeze(1)
        for layer in self.layers:
            history, candidate = layer(history, candidate, valid_history, valid_candidate)
        return self.head(self.norm_out(candidate[:, 0])).squeeze(-1)


for cls, request_inputs, convert in (
    (bst.BST, bst.REQUEST_INPUTS, DCABST),
    (hstu.HSTU, hstu.REQUEST_INPUTS, DCAHSTU),
    (backbones.SequenceNet, backbones.REQUEST_INPUTS, DCASequenceNet),
):
    register_dca_model(cls, request_inputs=request_inputs, convert=convert)
