"""``apply_glm``: put Generalized Layer Masking into an existing ranking model.

The transform knows a few model families by their class (the zoo's DCNv2, FinalMLP and Wukong
models and the schema-parametrized backbones of :mod:`.backbones`). For each it knows where the
interaction layers read the request and candidate features, and it rebuilds every hidden layer
as a GLM layer whose first lanes form a request group: ``request_fraction`` of the layer's width
in the base variant, widened ``request_scale`` times in the scaled variant (the candidate lanes
keep their base width). Output layers, which read both groups and produce the score, stay dense.

A layer whose shape is unchanged keeps its weights (the masked block set to zero); a layer whose
shape changes is freshly initialized from the global RNG. The result is meant to be trained or
fine-tuned, then compiled. Module types the transform cannot mask raise ``ValueError``.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..layers import GLMLinear, GroupLayerNorm
from .glm_blocks import GLMWukongLayer, RequestFixedGate

__all__ = ["Lanes", "apply_glm"]

# Modules that act elementwise (or not at all) and therefore keep every lane in its group.
_ELEMENTWISE = (
    nn.ReLU,
    nn.LeakyReLU,
    nn.GELU,
    nn.SiLU,
    nn.Sigmoid,
    nn.Tanh,
    nn.ELU,
    nn.Mish,
    nn.Softplus,
    nn.PReLU,
    nn.Hardtanh,
    nn.Dropout,
    nn.Identity,
)


@dataclass(frozen=True)
class Lanes:
    """How a hidden width splits into (request, candidate) lanes."""

    fraction: float = 0.5
    scale: float = 1.0

    def split(self, width: int, multiple: int = 1) -> tuple[int, int]:
        """(request, candidate) widths for a layer that is ``width`` wide in the vanilla model.

        The base split is ``round(width * fraction)`` request lanes (at least one of each group);
        the request lanes are then scaled. With ``multiple`` > 1 the request lanes are rounded up
        so that the total is a multiple of it (for layers that split into heads).
        """
        if width < 2:
            raise ValueError(
                f"a layer of width {width} cannot hold a request and a candidate group"
            )
        base = min(max(round(width * self.fraction), 1), width - 1)
        candidate = width - base
        request = max(1, round(base * self.scale))
        if multiple > 1:
            request = math.ceil((request + candidate) / multiple) * multiple - candidate
        return request, candidate


def apply_glm(
    model: nn.Module,
    request_inputs: Sequence[str] | str,
    request_fraction: float = 0.5,
    request_scale: float = 1.0,
) -> nn.Module:
    """A GLM copy of ``model``: every hidden layer holds a request-only lane group.

    Args:
        model: a model of a family the transform knows (zoo ``DCNv2``, ``FinalMLP``, ``Wukong``;
            ``DCNv2Net``, ``FinalMLPNet``, ``WukongNet`` from ``rocs_compiler.transforms.backbones``).
        request_inputs: the model's request-side inputs; must be those the family's layout puts
            first in the interaction input.
        request_fraction: share of each hidden layer's width given to request lanes (base variant).
        request_scale: widening factor of the request lanes (scaled variant; 1.0 = base).

    Returns a new module (the original is not modified) in the original's train/eval mode; its
    GLM weights are parametrized so the masked blocks stay exactly zero during training.
    """
    if isinstance(request_inputs, str):
        request_inputs = [request_inputs]
    if not 0.0 < request_fraction < 1.0:
        raise ValueError(f"request_fraction must be in (0, 1), got {request_fraction}")
    if not request_scale > 0:
        raise ValueError(f"request_scale must be positive, got {request_scale}")
    family = _families().get(type(model))
    if family is None:
        known = ", ".join(sorted(cls.__name__ for cls in _families()))
        raise ValueError(
            f"apply_glm: no GLM rule for model type {type(model).__name__}; known types: {known}"
        )
    if set(request_inputs) != set(family.request_inputs):
        raise ValueError(
            f"apply_glm: {type(model).__name__} puts {sorted(family.request_inputs)} in its request "
            f"group; got request_inputs={sorted(request_inputs)}"
        )
    new = copy.deepcopy(model)
    family.convert(new, family.groups(new), Lanes(request_fraction, request_scale))
    return new.train(model.training)


# ---------------------------------------------------------------------------------------------
# Layer conversions


def refuse(module: nn.Module, path: str, what: str = "apply_glm") -> ValueError:
    return ValueError(
        f"{what}: does not know how to mask {type(module).__name__} (at {path or 'the model'})"
    )


def _expect(module: nn.Module, cls, path: str, what: str = "apply_glm") -> None:
    if type(module) is not cls:
        raise refuse(module, path, what)


def _glm_linear(
    linear: nn.Linear, groups_in: tuple[int, int], groups_out: tuple[int, int]
) -> GLMLinear:
    new = GLMLinear(*groups_in, *groups_out, bias=linear.bias is not None)
    if new.weight.shape == linear.weight.shape:
        with torch.no_grad():
            new.parametrizations.weight.original.copy_(linear.weight * new.mask)
            if linear.bias is not None:
                new.bias.copy_(linear.bias)
    return new


def _output_linear(linear: nn.Module, groups_in: tuple[int, int], path: str) -> nn.Linear:
    """An output layer reads both groups and stays dense; rebuilt if its input width changed."""
    _expect(linear, nn.Linear, path)
    width = sum(groups_in)
    if linear.in_features == width:
        return linear
    return nn.Linear(width, linear.out_features, bias=linear.bias is not None)


def glm_sequential(
    seq: nn.Module,
    groups: tuple[int, int],
    lanes: Lanes,
    path: str,
    *,
    output: bool = False,
    last_multiple: int = 1,
) -> tuple[nn.Sequential, tuple[int, int]]:
    """GLM version of an MLP (``nn.Sequential`` of Linear and elementwise modules).

    With ``output`` the last Linear is the model's output layer and stays dense.
    Returns the new MLP and the (request, candidate) widths of its output.
    """
    if not isinstance(seq, nn.Sequential):
        raise refuse(seq, path)
    linears = [i for i, m in enumerate(seq) if type(m) is nn.Linear]
    layers: list[nn.Module] = []
    for i, module in enumerate(seq):
        where = f"{path}.{i}"
        if type(module) is nn.Linear:
            if output and i == linears[-1]:
                layers.append(_output_linear(module, groups, where))
                groups = (0, module.out_features)
                continue
            multiple = last_multiple if i == linears[-1] else 1
            out = lanes.split(module.out_features, multiple)
            layers.append(_glm_linear(module, groups, out))
            groups = out
        elif isinstance(module, _ELEMENTWISE):
            layers.append(module)
        elif type(module) is nn.LayerNorm and tuple(module.normalized_shape) == (sum(groups),):
            layers.append(GroupLayerNorm(*groups, eps=module.eps))
        else:
            raise refuse(module, where)
    return nn.Sequential(*layers), groups


# ---------------------------------------------------------------------------------------------
# Families


@dataclass(frozen=True)
class _Family:
    request_inputs: tuple[str, ...]
    groups: Callable[
        [nn.Module], tuple[int, int]
    ]  # (request, candidate) width of the interaction input
    convert: Callable[[nn.Module, tuple[int, int], Lanes], None]  # in place, on the copy


def _convert_dcn(model: nn.Module, groups: tuple[int, int], lanes: Lanes) -> None:
    from models_zoo.dcnv2 import CrossLayer

    for i, layer in enumerate(model.cross):
        _expect(layer, CrossLayer, f"cross.{i}")
        layer.w = _glm_cross_weight(layer.w, groups, lanes, f"cross.{i}.w")
    model.deep, out = glm_sequential(model.deep, groups, lanes, "deep")
    model.head = _output_linear(model.head, out, "head")


def _glm_cross_weight(w: nn.Module, groups: tuple[int, int], lanes: Lanes, path: str) -> nn.Module:
    """A cross layer's ``W x`` keeps the x0 layout: request features first, in and out."""
    if type(w) is nn.Linear:
        return _glm_linear(w, groups, groups)
    if type(w) is nn.Sequential and len(w) == 2 and all(type(m) is nn.Linear for m in w):
        rank = lanes.split(w[0].out_features)
        return nn.Sequential(_glm_linear(w[0], groups, rank), _glm_linear(w[1], rank, groups))
    raise refuse(w, path)


def _convert_finalmlp(model: nn.Module, groups: tuple[int, int], lanes: Lanes) -> None:
    from models_zoo.finalmlp import FeatureGate, InteractionAggregation

    # gate1 reads the request fields only: its output is request-only already.
    _expect(model.gate1, FeatureGate, "gate1")
    _expect(model.gate2, FeatureGate, "gate2")
    model.gate2 = RequestFixedGate(
        groups[0], _candidate_rows(model.gate2.mlp, groups[0], "gate2.mlp")
    )
    _expect(model.fusion, InteractionAggregation, "fusion")
    heads = model.fusion.num_heads
    model.mlp1, out1 = glm_sequential(model.mlp1, groups, lanes, "mlp1", last_multiple=heads)
    model.mlp2, out2 = glm_sequential(model.mlp2, groups, lanes, "mlp2", last_multiple=heads)
    widths = (sum(out1), sum(out2))
    if widths != (model.fusion.w_x.in_features, model.fusion.w_y.in_features):
        model.fusion = InteractionAggregation(*widths, heads)


def _candidate_rows(mlp: nn.Module, request_dim: int, path: str) -> nn.Sequential:
    """The gate MLP with its last layer keeping only the outputs that gate candidate lanes."""
    if not isinstance(mlp, nn.Sequential):
        raise refuse(mlp, path)
    layers = list(mlp)
    for i, module in enumerate(layers):
        if type(module) is not nn.Linear and not isinstance(module, _ELEMENTWISE):
            raise refuse(module, f"{path}.{i}")
    last = max(i for i, m in enumerate(layers) if type(m) is nn.Linear)
    old = layers[last]
    new = nn.Linear(old.in_features, old.out_features - request_dim, bias=old.bias is not None)
    with torch.no_grad():
        new.weight.copy_(old.weight[request_dim:])
        if old.bias is not None:
            new.bias.copy_(old.bias[request_dim:])
    layers[last] = new
    return nn.Sequential(*layers)


def _convert_wukong(model: nn.Module, fields: tuple[int, int], lanes: Lanes) -> None:
    from models_zoo.wukong import WukongLayer

    blocks = []
    for i, layer in enumerate(model.layers):
        path = f"layers.{i}"
        _expect(layer, WukongLayer, path)
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


@functools.cache
def _families() -> dict[type, _Family]:
    from models_zoo import dcnv2, finalmlp, wukong

    from . import backbones as bb

    def schema_groups(model: nn.Module) -> tuple[int, int]:
        d, schema = model.embed.dim, model.embed.schema
        return d * schema.num_request_fields, d * schema.num_candidate_fields

    def schema_fields(model: nn.Module) -> tuple[int, int]:
        schema = model.embed.schema
        return schema.num_request_fields, schema.num_candidate_fields

    def emb_dim(model: nn.Module) -> int:
        return model.user_tables[0].embedding_dim

    return {
        dcnv2.DCNv2: _Family(
            dcnv2.REQUEST_INPUTS,
            lambda m: (
                dcnv2.USER_DENSE_DIM + emb_dim(m) * len(dcnv2.USER_VOCABS),
                emb_dim(m) * len(dcnv2.ITEM_VOCABS) + dcnv2.ITEM_DENSE_DIM,
            ),
            _convert_dcn,
        ),
        finalmlp.FinalMLP: _Family(
            finalmlp.REQUEST_INPUTS,
            lambda m: (
                emb_dim(m) * len(finalmlp.USER_VOCABS),
                emb_dim(m) * len(finalmlp.ITEM_VOCABS),
            ),
            _convert_finalmlp,
        ),
        wukong.Wukong: _Family(
            wukong.REQUEST_INPUTS,
            lambda m: (len(wukong.USER_VOCABS) + wukong.NUM_DENSE_EMBS, len(wukong.ITEM_VOCABS)),
            _convert_wukong,
        ),
        bb.DCNv2Net: _Family(bb.REQUEST_INPUTS, schema_groups, _convert_dcn),
        bb.FinalMLPNet: _Family(bb.REQUEST_INPUTS, schema_groups, _convert_finalmlp),
        bb.WukongNet: _Family(bb.REQUEST_INPUTS, schema_fields, _convert_wukong),
    }
