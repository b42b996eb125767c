"""What a program takes and hands back: its inputs in the graph's order, its constant outputs
cloned, and, in grad mode, outputs whose backward is refused with the reason
(``runtime/training/no_backward.py``).

Identity: a compiled model's outputs are the original's values, never aliases of its own buffers.
"""

from __future__ import annotations

from torch.utils import _pytree as pytree

from ..training import no_backward


def graph_inputs(cm, leaves: dict, requests: dict) -> list:
    """The program's inputs in the graph's order, request inputs at R rows from ``requests``."""
    names = cm.contract.input_names
    if requests is leaves:
        return [leaves[n] for n in names]
    return [requests[n] if n in requests else leaves[n] for n in names]


def clone_constants(cm, outputs) -> list:
    """Never hand out the compiled model's own buffers."""
    outputs = list(outputs)
    for i in cm._constant_outputs:
        outputs[i] = outputs[i].clone()
    return outputs


def refuse_backward(cm, outputs: list) -> list:
    """In grad mode, outputs eager would attach to a weight requiring grad get a ``grad_fn``
    that raises on backward (``runtime/training/no_backward.py``)."""
    weights, reads = cm._weights, cm._weights_read
    anchor = weights.requiring_grad()
    if anchor is None:
        return outputs
    if reads is None or len(reads) != len(outputs):
        wants = [True] * len(outputs)
    else:
        wants = [weights.requiring_grad(r) is not None for r in reads]
    return no_backward.attach(outputs, wants, anchor)


def refuse_backward_eager(cm, result):
    """:func:`refuse_backward` for the original model's outputs (an eager fallback)."""
    anchor = no_backward.first_requiring_grad(cm._original.parameters())
    if anchor is None:
        return result
    leaves, spec = pytree.tree_flatten(result)
    leaves = no_backward.attach(leaves, [True] * len(leaves), anchor)
    return pytree.tree_unflatten(leaves, spec)
