"""The example call of a compile, with the dims it marks dynamic kept for the compiles after it.

Capture consumes ``torch._dynamo.mark_dynamic``'s marks: tracing clears them from the example's
tensors. A compiled model compiles its model again on the same example for a deep copy, a move to
another dtype, its eval mode, a call under autocast, or a call at new sizes
(``runtime/modes/new_sizes.py``); each must trace the example marked as the user marked it, or
a history length marked dynamic comes back fixed. :class:`MarkedExample` reads the marks once,
before capture, and hands out copies of the example marked the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree


class MarkedExample:
    """``args`` and ``kwargs`` of an example call, and the dims each of its tensors marks."""

    def __init__(self, args: Sequence[Any], kwargs: Mapping[str, Any]):
        self.args, self.kwargs = tuple(args), dict(kwargs)
        leaves, _ = pytree.tree_flatten((self.args, self.kwargs))
        self._marks = [
            frozenset(getattr(leaf, "_dynamo_dynamic_indices", ()))
            if isinstance(leaf, torch.Tensor)
            else frozenset()
            for leaf in leaves
        ]

    def copy(
        self, fn: Callable[[torch.Tensor], torch.Tensor] = torch.Tensor.detach
    ) -> tuple[tuple, dict]:
        """``(args, kwargs)`` with ``fn`` applied to every tensor, each result marking the dims
        its tensor marked."""
        leaves, spec = pytree.tree_flatten((self.args, self.kwargs))
        copied = []
        for leaf, marks in zip(leaves, self._marks):
            if isinstance(leaf, torch.Tensor):
                leaf = fn(leaf)
                for dim in marks:
                    torch._dynamo.mark_dynamic(leaf, dim)
            copied.append(leaf)
        return pytree.tree_unflatten(copied, spec)
