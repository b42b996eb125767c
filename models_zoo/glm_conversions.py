"""``apply_glm`` conversions of the zoo's interaction models and the backbones built like them.

DCNv2, FinalMLP and Wukong (and ``DCNv2Net``, ``FinalMLPNet``, ``WukongNet`` of
:mod:`.backbones`, which keep their attribute names) name this module in ``__rocs_conversions__``:
``apply_glm`` imports it the first time it meets one of them, so the zoo stays importable
without ``rocs_compiler``.
"""

from __future__ import annotations

from torch import nn

from rocs_compiler.transforms import register_glm_model
from rocs_compiler.transforms.glm import (
    Lanes,
    expect_type,
    glm_linear,
    glm_sequential,
    output_linear,
    refuse,
    request_fixed_gate,
)
from rocs_compiler.transforms.glm_blocks import GLMWukongLayer

from . import backbones, dcnv2, finalmlp, wukong
from .dcnv2 import CrossLayer
from .finalmlp import FeatureGate, InteractionAggregation
from .wukong import WukongLayer

__all__ = ["convert_dcn", "convert_finalmlp", "convert_wukong"]


def convert_dcn(model: nn.Module, groups: tuple[int, int], lanes: Lanes) -> None:
    """In place: a model with ``cross`` (CrossLayers on x0), ``deep`` (MLP) and ``head``."""
    for i, layer in enumerate(model.cross):
        expect_type(layer, CrossLayer, f"cross.{i}")
        layer.w = _glm_cross_weight(layer.w, groups, lanes, f"cross.{i}.w")
    model.deep, out = glm_sequential(model.deep, groups, lanes, "deep")
    model.head = output_linear(model.head, out, "head")


def _glm_cross_weight(w: nn.Module, groups: tuple[int, int], lanes: Lanes, path: str) -> nn.Module:
    """A cross layer's ``W x`` keeps the x0 layout: request features first, in and out."""
    if type(w) is nn.Linear:
        return glm_linear(w, groups, groups)
    if type(w) is nn.Sequential and len(w) == 2 and all(type(m) is nn.Linear for m in w):
        rank = lanes.split(w[0].out_features)
        return nn.Sequential(glm_linear(w[0], groups, rank), glm_linear(w[1], rank, groups))
    raise refuse(w, path)


def convert_finalmlp(model: nn.Module, groups: tuple[int, int], lanes: Lanes) -> None:
    """In place: a model with FinalMLP's ``gate1``, ``gate2``, ``mlp1``, ``mlp2`` and ``fusion``."""
    # gate1 reads the request fields only: its output is request-only already.
    expect_type(model.gate1, FeatureGate, "gate1")
    expect_type(model.gate2, FeatureGate, "gate2")
    model.gate2 = request_fixed_gate(model.gate2.mlp, groups[0], "gate2.mlp")
    expect_type(model.fusion, InteractionAggregation, "fusion")
    heads = model.fusion.num_heads
    model.mlp1, out1 = glm_sequential(model.mlp1, groups, lanes, "mlp1", last_multiple=heads)
    model.mlp2, out2 = glm_sequential(model.mlp2, groups, lanes, "mlp2", last_multiple=heads)
    widths = (sum(out1), sum(out2))
    if widths != (model.fusion.w_x.in_features, model.fusion.w_y.in_features):
        model.fusion = InteractionAggregation(*widths, heads)


def convert_wukong(model: nn.Module, fields: tuple[int, int], lanes: Lanes) -> None:
    """In place: a model with ``layers`` (WukongLayers) and an MLP ``head``.

    ``fields`` are the (request, candidate) field counts of the first layer's input.
    """
    blocks = []
    for i, layer in enumerate(model.layers):
        path = f"layers.{i}"
        expect_type(layer, WukongLayer, path)
        fmb = layer.fmb
        if not (len(fmb) == 3 and type(fmb[0]) is nn.Linear and type(fmb[1]) is nn.ReLU):
            raise refuse(fmb, f"{path}.fmb")
        block = GLMWukongLayer(
            fields,
            lanes.split(layer.n_fmb),
            lanes.split(layer.lcb.shape[0]),
            layer.dim,
            [lanes.split(fmb[0].out_features)],
        )
        blocks.append(block)
        fields = block.out_fields
    model.layers = nn.Sequential(*blocks)
    dim = blocks[-1].dim if blocks else model.emb_dim
    model.head, _ = glm_sequential(
        model.head, (fields[0] * dim, fields[1] * dim), lanes, "head", output=True
    )


# ---------------------------------------------------------------------------------------------
# Interaction input widths: (request, candidate) features, or fields for Wukong


def _emb_dim(model: nn.Module) -> int:
    return model.user_tables[0].embedding_dim


def _dcnv2_groups(model: nn.Module) -> tuple[int, int]:
    return (
        dcnv2.USER_DENSE_DIM + _emb_dim(model) * len(dcnv2.USER_VOCABS),
        _emb_dim(model) * len(dcnv2.ITEM_VOCABS) + dcnv2.ITEM_DENSE_DIM,
    )


def _finalmlp_groups(model: nn.Module) -> tuple[int, int]:
    return (
        _emb_dim(model) * len(finalmlp.USER_VOCABS),
        _emb_dim(model) * len(finalmlp.ITEM_VOCABS),
    )


def _wukong_fields(model: nn.Module) -> tuple[int, int]:
    return len(wukong.USER_VOCABS) + wukong.NUM_DENSE_EMBS, len(wukong.ITEM_VOCABS)


def _schema_groups(model: nn.Module) -> tuple[int, int]:
    d, schema = model.embed.dim, model.embed.schema
    return d * schema.num_request_fields, d * schema.num_candidate_fields


def _schema_fields(model: nn.Module) -> tuple[int, int]:
    schema = model.embed.schema
    return schema.num_request_fields, schema.num_candidate_fields


for cls, request_inputs, groups, convert in (
    (dcnv2.DCNv2, dcnv2.REQUEST_INPUTS, _dcnv2_groups, convert_dcn),
    (finalmlp.FinalMLP, finalmlp.REQUEST_INPUTS, _finalmlp_groups, convert_finalmlp),
    (wukong.Wukong, wukong.REQUEST_INPUTS, _wukong_fields, convert_wukong),
    (backbones.DCNv2Net, backbones.REQUEST_INPUTS, _schema_groups, convert_dcn),
    (backbones.FinalMLPNet, backbones.REQUEST_INPUTS, _schema_groups, convert_finalmlp),
    (backbones.WukongNet, backbones.REQUEST_INPUTS, _schema_fields, convert_wukong),
):
    register_glm_model(cls, request_inputs=request_inputs, groups=groups, convert=convert)
