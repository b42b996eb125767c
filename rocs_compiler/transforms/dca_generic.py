"""``apply_dca`` on any model whose sequence part is one of torch's transformer modules.

The sequence modules are found by type: every ``nn.TransformerEncoder``, every
``nn.TransformerEncoderLayer`` outside one, and every ``nn.MultiheadAttention`` outside both (and
outside torch's decoder modules). Each is replaced by its DCA form (:mod:`.dca_torch`): the same
module, same parameters and names, whose history positions attend only to history positions.

Where the history ends is read from the model's lineage: the model is captured with the
compiler's own capture and role analysis on an example batch, and the lane analysis
(:mod:`rocs_compiler.analysis.segments`) marks, per element of the sequence the module reads, whether it
depends on a candidate input. The request-only positions along the sequence axis must be the
first ``L`` (the history) with at least one candidate position after them; then ``L`` is the
history length. A module whose every position is request-only (a history encoder) is already
request-only and is kept; an ``nn.MultiheadAttention`` whose query is not its key and value
(target attention) is kept. ``history_length=`` states ``L`` instead, for every module found,
and needs no example batch.

Identity the DCA form relies on: attention is the only op of these modules that mixes
positions, so with history queries restricted to history keys, the history rows of every
output are a function of the history rows of the input (request-only where those are).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from ..analysis.driver import analyze
from ..capture.trace import capture, describe_example
from ..analysis.segments import run_taints
from .dca_torch import (
    DCAMultiheadAttention,
    DCATransformerEncoder,
    DCATransformerEncoderLayer,
    check_self_attention,
)

__all__ = ["DCAReport", "apply_dca_generic", "sequence_modules"]

_FORMS: dict[type, type] = {
    nn.TransformerEncoder: DCATransformerEncoder,
    nn.TransformerEncoderLayer: DCATransformerEncoderLayer,
    nn.MultiheadAttention: DCAMultiheadAttention,
}
# Attention inside these is not a self-attention over [history; candidate] that DCA can split.
_OPAQUE = (nn.TransformerDecoder, nn.TransformerDecoderLayer, nn.Transformer)
_NAMES = "nn.TransformerEncoder, nn.TransformerEncoderLayer or self-attention nn.MultiheadAttention"


@dataclass
class DCAReport:
    """What :func:`apply_dca` did, by module path."""

    converted: dict[str, str] = field(default_factory=dict)  # path -> history / sequence length
    kept: dict[str, str] = field(default_factory=dict)  # path -> why it stays as it was

    def __str__(self) -> str:
        lines = [f"DCA: {len(self.converted)} module(s) converted"]
        lines += [f"  {p}: {what}" for p, what in self.converted.items()]
        lines += [f"  kept {p}: {why}" for p, why in self.kept.items()]
        return "\n".join(lines)


def sequence_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The outermost encoder / encoder layer / attention modules of ``model``, by path."""
    found: dict[str, nn.Module] = {}
    opaque: list[str] = []
    for path, module in model.named_modules():
        inside = [p for p in (*found, *opaque) if path.startswith(p + ".") or p == ""]
        if inside:
            continue
        if isinstance(module, _OPAQUE):
            opaque.append(path)
        elif type(module) in _FORMS:
            found[path] = module
    return found


def _batch_first(module: nn.Module) -> bool:
    if isinstance(module, nn.TransformerEncoder):
        module = module.layers[0]
    if isinstance(module, nn.TransformerEncoderLayer):
        module = module.self_attn
    return module.batch_first


def _attentions(module: nn.Module, path: str) -> list[tuple[str, nn.MultiheadAttention]]:
    """The self-attentions the DCA form of ``module`` splits, by path."""
    if isinstance(module, nn.MultiheadAttention):
        return [(path, module)]
    if isinstance(module, nn.TransformerEncoderLayer):
        return [(f"{path}.self_attn", module.self_attn)]
    out = []
    for i, layer in enumerate(module.layers):
        if type(layer) is not nn.TransformerEncoderLayer:
            raise ValueError(
                f"apply_dca: the nn.TransformerEncoder at {path!r} has a {type(layer).__name__} "
                f"as layer {i}; its DCA form runs nn.TransformerEncoderLayer layers only"
            )
        out.append((f"{path}.layers.{i}.self_attn", layer.self_attn))
    return out


def apply_dca_generic(
    model: nn.Module,
    request_inputs: Sequence[str] | None,
    history_length: int | None,
    example_args: tuple = (),
    example_kwargs: Mapping[str, Any] | None = None,
) -> nn.Module:
    """The DCA form of ``model`` (a deep copy), with a :class:`DCAReport` as ``rocs_dca_report``."""
    name = type(model).__name__
    targets = sequence_modules(model)
    if not targets:
        raise ValueError(
            f"apply_dca: {name} has no {_NAMES}; apply_dca converts models whose sequence part "
            "is one of these (or a class registered with register_dca_model)"
        )
    for path, module in targets.items():
        for attn_path, attn in _attentions(module, path):
            check_self_attention(attn, attn_path)
    report = DCAReport()
    if history_length is not None:
        lengths = {path: (history_length, None) for path in targets}
    else:
        if not request_inputs or (example_kwargs is None and not example_args):
            where = ", ".join(repr(p) for p in targets)
            raise ValueError(
                f"apply_dca: to find where the history ends in the sequence read by {where}, "
                f"pass request_inputs= and example_kwargs= (one replicated example batch), or "
                f"state it with history_length="
            )
        lengths = _history_lengths(
            model, targets, list(request_inputs), example_args, example_kwargs or {}, report
        )
        if not lengths:
            kept = "; ".join(f"{p}: {why}" for p, why in report.kept.items())
            raise ValueError(f"apply_dca: nothing in {name} to convert ({kept})")
    new = copy.deepcopy(model)
    for path, (length, total) in lengths.items():
        module = new.get_submodule(path)
        _check_not_root(path, module)
        new.set_submodule(path, _FORMS[type(module)].convert(module, length))
        of = f" of {total}" if total is not None else ""
        report.converted[path] = f"{type(module).__name__}, history positions 0..{length}{of}"
    new.rocs_dca_report = report
    return new.train(model.training)


def _check_not_root(path: str, module: nn.Module) -> None:
    if not path:
        raise ValueError(
            f"apply_dca: the model itself is a {type(module).__name__}; wrap it in a module "
            "that builds the [history; candidate] sequence"
        )


# ---------------------------------------------------------------------------------------------
# History length from lineage


def _scopes(node: fx.Node) -> set[str]:
    """Paths of the modules whose call ``node`` belongs to (outermost to innermost)."""
    out = set()
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        for prefix in ("L['self'].model.", "model.", "L['self']."):
            if path.startswith(prefix):
                path = path[len(prefix) :]
                break
        out.add(path)
    return out


def _sequence_inputs(gm: fx.GraphModule, path: str, width: int) -> list[fx.Node]:
    """The float ``[*, *, width]`` values that nodes of ``path``'s calls read from outside it."""
    inputs: list[fx.Node] = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or path not in _scopes(node):
            continue
        for arg in node.all_input_nodes:
            val = arg.meta.get("val")
            outside = arg.op != "call_function" or path not in _scopes(arg)
            if (
                outside
                and arg.op != "get_attr"
                and isinstance(val, torch.Tensor)
                and val.is_floating_point()
                and val.dim() == 3
                and val.shape[-1] == width
                and arg not in inputs
            ):
                inputs.append(arg)
    return inputs


def _embed_dim(module: nn.Module) -> int:
    return _attentions(module, "")[0][1].embed_dim


def _history_lengths(model, targets, request_inputs, example_args, example_kwargs, report):
    """Per target path: (history length, sequence length), from the lanes of its input."""
    probe = copy.deepcopy(model).eval()
    call = describe_example(probe, example_args, example_kwargs, request_inputs)
    cg = capture(probe, example_args, example_kwargs, request_inputs)
    gm = cg.graph_module
    analyze(gm, {cg.placeholder_of[n] for n in cg.request_inputs}, cg.batch_symbol)
    _, taints = run_taints(gm, [call.leaves[n] for n in cg.input_names])
    lengths: dict[str, tuple[int, int]] = {}
    for path, module in targets.items():
        where = f"{type(module).__name__} at {path!r}"
        inputs = _sequence_inputs(gm, path, _embed_dim(module))
        if not inputs:
            report.kept[path] = "not called by the model's forward"
            continue
        if len(inputs) > 1:
            if isinstance(module, nn.MultiheadAttention):
                report.kept[path] = "its query is not its key and value (not a self-attention)"
                continue
            raise ValueError(f"apply_dca: the {where} reads {len(inputs)} sequences; DCA needs one")
        seq_dim = 1 if _batch_first(module) else 0
        taint = taints[inputs[0]]
        request = ~taint.movedim(seq_dim, 0).flatten(1).any(1)  # per position
        total, length = request.numel(), int(request.sum())
        if length == total:
            report.kept[path] = "every position is request-only already (a history encoder)"
            continue
        if length == 0 or not bool(request[:length].all()):
            positions = request.nonzero().flatten().tolist()
            raise ValueError(
                f"apply_dca: the {where} reads a sequence of {total} positions whose request-only "
                f"positions are {positions or 'none'}; DCA needs the history first "
                f"([history; candidate tokens]) with at least one history position"
            )
        lengths[path] = (length, total)
    return lengths
