"""Outputs that refuse ``backward()`` with the reason, instead of coming back detached.

A compiled model computes without autograd. Its weights are the original model's parameters,
which require grad by default, so in grad mode the eager model's outputs carry a ``grad_fn``
and a user may backpropagate through them. Detached outputs would make ``loss.backward()``
fail far from the cause ("element 0 of tensors does not require grad"), or, summed with a
term that does require grad, silently give that term's gradient only.

So in grad mode an output that eager would attach to a parameter requiring grad (a floating
output whose graph reads such a weight) is returned with a ``grad_fn`` of its own whose
backward raises :data:`MESSAGE`. Under ``torch.no_grad()`` or ``torch.inference_mode()``, or
with no weight requiring grad, outputs are returned as computed; the check and the wrapping
cost a few microseconds per call in grad mode only.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import fx

MESSAGE = (
    "rocs: a compiled model computes without autograd, so its outputs have no gradient; "
    "backpropagate through the original model (the compiled model follows its weights), or "
    "compile it for training with rocs.compile(..., training=True); call the compiled model "
    "under torch.no_grad() or torch.inference_mode() for inference"
)


class _NoBackward(torch.autograd.Function):
    """Identity on ``outputs`` (a tuple autograd does not see); its backward raises."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, outputs: tuple) -> tuple:  # noqa: ARG004
        # Fresh aliases: autograd attaches the history to them, never to a tensor the caller
        # passed in (an output may be an input returned as is).
        return tuple(t.detach() for t in outputs)

    @staticmethod
    def backward(ctx, *grads):  # noqa: ARG004
        raise RuntimeError(MESSAGE)


def differentiable(t: object) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def attach(outputs: list, wants: list[bool], anchor: torch.Tensor) -> list:
    """``outputs`` with those flagged in ``wants`` given a ``grad_fn`` that refuses backward."""
    picked = [i for i, w in enumerate(wants) if w and differentiable(outputs[i])]
    if not picked:
        return outputs
    wrapped = _NoBackward.apply(anchor, tuple(outputs[i] for i in picked))
    outputs = list(outputs)
    for i, t in zip(picked, wrapped):
        outputs[i] = t
    return outputs


def weights_read_by_outputs(gm: fx.GraphModule) -> Optional[list[frozenset[str]]]:
    """Per graph output, the graph module attributes (weights) its value depends on, folded
    constants expanded to the weights of their recipes; None when ``gm`` is no FX graph."""
    if not isinstance(gm, fx.GraphModule):
        return None
    from ...ir.graph_meta import FOLD

    reads: dict[fx.Node, frozenset[str]] = {}
    for node in gm.graph.nodes:
        own: set[str] = set()
        if node.op == "get_attr":
            fold = node.meta.get(FOLD)
            own = set(fold.sources) if fold is not None else {node.target}
        for arg in node.all_input_nodes:
            own |= reads[arg]
        reads[node] = frozenset(own)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    return [reads[r] if isinstance(r, fx.Node) else frozenset() for r in output.args[0]]


def first_requiring_grad(tensors: Iterable[torch.Tensor]) -> Optional[torch.Tensor]:
    return next((t for t in tensors if t.requires_grad), None)
