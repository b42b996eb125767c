"""Capture follows ``nn.TransformerEncoder``'s nested fast path, which ``torch.export`` skips.

In eager, ``nn.TransformerEncoder.forward`` in inference runs its layers on a nested tensor of
the valid positions and pads the result back with zeros before its final norm, when all of
these hold: the fast path is enabled (``torch.backends.mha.get_fastpath_enabled()``), the
encoder may nest (``use_nested_tensor``), its first layer is in eval mode, ``src`` is
``[B, L, D]`` batch first and not nested, a ``src_key_padding_mask`` is given and no ``mask``,
every row of the mask is left aligned, autocast is off, the device is one torch nests on, and
not (grad is enabled and ``src`` or a parameter of the first layer requires grad). Under
``torch.export`` (``torch.compiler.is_compiling()``) it takes the padded path, so the captured
graph holds the layers' values at padded positions where eager has zeros.

Within :func:`following_nested_path` (capture's export only), ``nn.TransformerEncoder.forward``
is :func:`_forward`: when the conditions fixed at capture hold (all of the above but the
fast-path setting, the alignment and the grad check, which belong to the call), it runs the
layers exactly as the original's padded path does and ends them with
``rocs::nested_padding(output, padding_mask)`` (``kernels/nested_padding.py``), which decides
the rest each time the graph runs; otherwise it calls the original forward.

Identity: where eager nests, its output is the padded path's output with padded positions set
to zero (at valid positions both compute the same values: attention reads valid keys only and
every other op is per position), then ``norm``; elsewhere it is the padded path's output. So
``_forward == eager's forward`` for every call the op decides as eager does.

``mask_check=False`` makes eager nest without checking the alignment; a batch that is not left
aligned is then packed from each row's first ``count(valid)`` positions, a different
computation. rocs treats ``mask_check=False`` as ``True``: such a batch keeps the padded path's
values.

What the op cannot see: whether ``src`` or the first layer's parameters require grad.
:func:`blocking_parameters` names, by model name, the parameters whose ``requires_grad`` decides
it (the first layer's and those the encoder's input is computed from); the runtime passes them
to ``kernels.nested_padding.fast_path_state`` around each call.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.nn.modules.transformer import _detect_is_causal_mask, _get_seq_len

_PRIVATE_DEVICE = torch.utils.backend_registration._privateuse1_backend_name
_NESTING_DEVICES = ("cpu", "cuda", "xpu", _PRIVATE_DEVICE)  # eager's list
_LOCK = threading.Lock()
_depth = 0  # captures in progress; the class attribute is patched while one is
_original_forward = nn.TransformerEncoder.forward


@contextlib.contextmanager
def following_nested_path() -> Iterator[None]:
    """Within the block, every ``nn.TransformerEncoder`` (and subclass that keeps its forward)
    follows the nested path as :func:`_forward` does."""
    global _depth, _original_forward
    with _LOCK:
        if _depth == 0:
            _original_forward = nn.TransformerEncoder.forward
            nn.TransformerEncoder.forward = _forward
        _depth += 1
    try:
        yield
    finally:
        with _LOCK:
            _depth -= 1
            if _depth == 0:
                nn.TransformerEncoder.forward = _original_forward


def _nests_at_capture(encoder: nn.TransformerEncoder, src, mask, src_key_padding_mask) -> bool:
    """The conditions of eager's nested path that are fixed when the graph is captured (and a
    trace is running: an eager call on another thread meanwhile runs the original)."""
    first = encoder.layers[0]
    return (
        torch.compiler.is_compiling()
        and getattr(encoder, "use_nested_tensor", False)
        and not first.training
        and first.self_attn.batch_first
        and src.dim() == 3
        and not src.is_nested
        and src_key_padding_mask is not None
        and mask is None
        and not torch.is_autocast_enabled()
        and src.device.type in _NESTING_DEVICES
    )


def _forward(
    self: nn.TransformerEncoder,
    src: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    src_key_padding_mask: Optional[torch.Tensor] = None,
    is_causal: Optional[bool] = None,
) -> torch.Tensor:
    """``nn.TransformerEncoder.forward`` with the nested path's zeros (module docstring)."""
    if not _nests_at_capture(self, src, mask, src_key_padding_mask):
        return _original_forward(self, src, mask, src_key_padding_mask, is_causal)
    given = src_key_padding_mask
    src_key_padding_mask = F._canonical_mask(
        mask=src_key_padding_mask,
        mask_name="src_key_padding_mask",
        other_type=F._none_or_dtype(mask),
        other_name="mask",
        target_type=src.dtype,
    )
    is_causal = _detect_is_causal_mask(None, is_causal, _get_seq_len(src, True))
    output = src
    for layer in self.layers:
        output = layer(
            output, src_mask=None, is_causal=is_causal, src_key_padding_mask=src_key_padding_mask
        )
    # Eager's valid positions are ``mask.logical_not()``: a float mask pads where it is nonzero.
    padding = given if given.dtype == torch.bool else src_key_padding_mask != 0
    output = torch.ops.rocs.nested_padding(output, padding)
    if self.norm is not None:
        output = self.norm(output)
    return output


def blocking_parameters(
    gm: fx.GraphModule, model_names: dict[str, str], model: nn.Module
) -> list[str]:
    """Model names of the parameters whose ``requires_grad`` (under grad) makes eager refuse the
    nested path of an encoder ``gm`` follows: the first layer's, and those the encoder's input
    is computed from (``src.requires_grad``), found as the ``get_attr`` ancestors of its
    ``rocs::nested_padding`` node outside the encoder's layers (``detach``, a ``no_grad`` block
    of a training capture, cuts the walk). ``model_names``: ``get_attr`` target -> model name
    (``CapturedGraph.param_names``)."""
    parameters = dict(model.named_parameters())
    found: set[str] = set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or not _is_nested_padding(node.target):
            continue
        encoder = _encoder_name(node)
        layers = f"{encoder}.layers." if encoder else "layers."
        first = model.get_submodule(encoder).layers[0]
        found |= {f"{layers}0.{name}" for name, _ in first.named_parameters()}
        for attr in _attr_ancestors(node):
            name = model_names.get(attr.target, attr.target)
            if name in parameters and not name.startswith(layers):
                found.add(name)
    return sorted(found)


def _attr_ancestors(node: fx.Node) -> list[fx.Node]:
    seen: set[fx.Node] = set()
    todo, found = [node], []
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        if current.op == "get_attr":
            found.append(current)
        elif current.target not in _CUTS:
            todo.extend(current.all_input_nodes)
    return found


_CUTS = {torch.ops.aten.detach.default}


def _encoder_name(node: fx.Node) -> str:
    """The model name of the encoder whose forward called ``node`` (the last module of its
    ``nn_module_stack``, under capture's wrapper ``model``)."""
    path = list(node.meta["nn_module_stack"].values())[-1][0].removeprefix("L['self'].")
    return "" if path == "model" else path.removeprefix("model.")


def _is_nested_padding(target: Any) -> bool:
    return getattr(getattr(target, "_schema", None), "name", None) == "rocs::nested_padding"
