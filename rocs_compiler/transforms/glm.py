"""``apply_glm``: put Generalized Layer Masking into an existing ranking model.

The transform converts the model conversions registered with
:func:`~rocs_compiler.transforms.registry.register_glm_model` (the zoo registers its DCNv2,
FinalMLP and Wukong models and backbones). A conversion knows where the interaction layers read the
request and candidate features, and rebuilds every hidden layer as a GLM layer whose first lanes
form a request group: ``request_fraction`` of the layer's width in the base variant, widened
``request_scale`` times in the scaled variant (the candidate lanes keep their base width). Output
layers, which read both groups and produce the score, stay dense. The helpers below do the usual
layers, for the conversions' conversions.

A layer whose shape is unchanged keeps its weights (the masked block set to zero); a layer whose
shape changes is freshly initialized from the global RNG. The result is meant to be trained or
fine-tuned, then compiled. Module types the transform cannot mask raise ``ValueError``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .layers import GLMLinear, GroupLayerNorm
from .glm_blocks import RequestFixedGate
from .glm_lanes import Lanes
from .registry import GLM_CONVERSIONS

__all__ = [
    "Lanes",
    "apply_glm",
    "expect_type",
    "glm_linear",
    "glm_sequential",
    "output_linear",
    "refuse",
    "request_fixed_gate",
]

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


def apply_glm(
    model: nn.Module,
    request_inputs: Sequence[str] | str,
    request_fraction: float = 0.5,
    request_scale: float = 1.0,
    *,
    example_inputs: tuple = (),
    example_kwargs: Mapping[str, Any] | None = None,
) -> nn.Module:
    """A GLM copy of ``model``: every hidden layer holds a request-only lane group.

    Args:
        model: any model. A model of a registered conversion (:func:`register_glm_model`; the zoo
            registers ``DCNv2``, ``FinalMLP``, ``Wukong`` and the ``DCNv2Net``,
            ``FinalMLPNet``, ``WukongNet`` backbones of ``models_zoo.backbones``) converts by its
            conversion's rule; any other model is captured and every ``nn.Linear`` /
            ``nn.LayerNorm`` whose input mixes request and candidate lanes is masked
            (:mod:`.glm_generic`).
        request_inputs: the model's request-side inputs (argument names, or ``"arg.key"``).
        request_fraction: share of each hidden layer's width given to request lanes (base variant).
        request_scale: widening factor of the request lanes (scaled variant; 1.0 = base).
        example_inputs, example_kwargs: one replicated example batch, for the capture of a model
            without a conversion. Without them, the inputs are inferred from the layers that read
            them first (an ``nn.Linear`` or an embedding), else ``ValueError`` asks for them.

    Returns a new module (the original is not modified) in the original's train/eval mode; its
    GLM weights are parametrized so the masked blocks stay exactly zero during training. A model
    converted by the generic path carries a :class:`~.glm_generic.GLMReport` as
    ``rocs_glm_report`` (masked, kept and refused layers with reasons); refused layers are also
    listed in a warning.
    """
    if isinstance(request_inputs, str):
        request_inputs = [request_inputs]
    if not 0.0 < request_fraction < 1.0:
        raise ValueError(f"request_fraction must be in (0, 1), got {request_fraction}")
    if not request_scale > 0:
        raise ValueError(f"request_scale must be positive, got {request_scale}")
    lanes = Lanes(request_fraction, request_scale)
    conversion = GLM_CONVERSIONS.get(model)
    if conversion is None:
        from .glm_generic import apply_glm_generic

        return apply_glm_generic(
            model, list(request_inputs), lanes, example_inputs, example_kwargs
        )
    if set(request_inputs) != set(conversion.request_inputs):
        raise ValueError(
            f"apply_glm: {type(model).__name__} puts {sorted(conversion.request_inputs)} in its request "
            f"group; got request_inputs={sorted(request_inputs)}"
        )
    new = copy.deepcopy(model)
    conversion.convert(new, conversion.groups(new), lanes)
    return new.train(model.training)


# ---------------------------------------------------------------------------------------------
# Layer conversions


def refuse(module: nn.Module, path: str, what: str = "apply_glm") -> ValueError:
    """The error a conversion raises for a module it cannot convert (``path`` from the model)."""
    return ValueError(
        f"{what}: does not know how to mask {type(module).__name__} (at {path or 'the model'})"
    )


def expect_type(module: nn.Module, cls: type, path: str, what: str = "apply_glm") -> None:
    """Refuse ``module`` unless its type is exactly ``cls`` (a subclass may compute otherwise)."""
    if type(module) is not cls:
        raise refuse(module, path, what)


def glm_linear(
    linear: nn.Linear, groups_in: tuple[int, int], groups_out: tuple[int, int]
) -> GLMLinear:
    """A :class:`GLMLinear` in place of ``linear``, between (request, candidate) lane groups.

    It keeps ``linear``'s weights (the masked block zeroed) when the shape is unchanged; else it
    is freshly initialized.
    """
    new = GLMLinear(*groups_in, *groups_out, bias=linear.bias is not None)
    if new.weight.shape == linear.weight.shape:
        with torch.no_grad():
            new.parametrizations.weight.original.copy_(linear.weight * new.mask)
            if linear.bias is not None:
                new.bias.copy_(linear.bias)
    return new


def output_linear(linear: nn.Module, groups_in: tuple[int, int], path: str) -> nn.Linear:
    """An output layer reads both groups and stays dense; rebuilt if its input width changed."""
    expect_type(linear, nn.Linear, path)
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
                layers.append(output_linear(module, groups, where))
                groups = (0, module.out_features)
                continue
            multiple = last_multiple if i == linears[-1] else 1
            out = lanes.split(module.out_features, multiple)
            layers.append(glm_linear(module, groups, out))
            groups = out
        elif isinstance(module, _ELEMENTWISE):
            layers.append(module)
        elif type(module) is nn.LayerNorm and tuple(module.normalized_shape) == (sum(groups),):
            layers.append(GroupLayerNorm(*groups, eps=module.eps))
        else:
            raise refuse(module, where)
    return nn.Sequential(*layers), groups


def request_fixed_gate(mlp: nn.Module, request_dim: int, path: str) -> RequestFixedGate:
    """A :class:`RequestFixedGate` for a feature gate ``flat * 2 sigmoid(mlp(ctx))``.

    ``ctx`` is candidate-only and the first ``request_dim`` lanes of ``flat`` are the request
    group. ``mlp`` (an ``nn.Sequential`` of Linear and elementwise modules) keeps its weights,
    its last layer only the rows that gate candidate lanes.
    """
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
    return RequestFixedGate(request_dim, nn.Sequential(*layers))
