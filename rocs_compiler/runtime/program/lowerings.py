"""Faster equivalents of ATen ops, chosen per node for the inference programs of ``direct.py``.

A direct program calls each ATen op through its binding (``bindings.py``). For a few ops torch
has a faster kernel for the same values when the node's shapes allow it; the node's fake value
(``node.meta["val"]``, fixed when the graph was traced) says whether they do, and a condition on
the call's own arguments where it depends on the batch. Each rule here returns a
:class:`Lowering` for one node, or None for the op's own binding.

- ``aten.embedding`` of a table with one column (the "linear" or "wide" part of a ranking model:
  one weight per id). ``index_select`` of a 2-D table copies each row by itself: from about a
  thousand ids on, that is slower on a CPU than the vectorized gather of a 1-D tensor (three
  times slower at 6,000 ids).

  Identity: ``embedding(w, i) == index_select(w.reshape(-1), 0, i.reshape(-1)).view(*i.shape, 1)``
  for ``w`` of shape ``[V, 1]`` (a copy of the same values, the same out-of-range error), whatever
  ``padding_idx``, ``scale_grad_by_freq`` and ``sparse``, which only shape the backward.

Inference programs only: a training program keeps each op's own backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import fx

aten = torch.ops.aten


@dataclass(frozen=True)
class Lowering:
    """Call ``fn`` with the op's arguments where ``when`` holds, else the op: ``when`` is a
    Python condition over the call's positional arguments (``{0}``, ``{1}``, ...), written into
    the program's line so that a call it does not take pays only the condition."""

    fn: Callable
    when: str


def lowering(node: fx.Node) -> Optional[Lowering]:
    """The faster equivalent of ``node`` (an ATen ``call_function`` node), or None."""
    rule = _RULES.get(node.target)
    return None if rule is None else rule(node)


def _one_column_table(node: fx.Node) -> Optional[Lowering]:
    if len(node.args) < 2:  # the condition reads the ids by position
        return None
    weight = node.args[0]
    value = weight.meta.get("val") if isinstance(weight, fx.Node) else None
    if not isinstance(value, torch.Tensor) or value.dim() != 2 or value.shape[1] != 1:
        return None
    # Below about a thousand ids the op's row copies cost less than the gather's reshapes (one
    # torch thread, a CPU: 4.3 against 4.3 us at 1,024 ids, 7.2 against 4.7 at 2,048, 43
    # against 12 at 16,384).
    return Lowering(embedding_one_column, "{1}.numel() >= 1024")


def embedding_one_column(
    weight: torch.Tensor,
    indices: torch.Tensor,
    padding_idx: int = -1,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> torch.Tensor:
    """``aten.embedding`` of the ``[V, 1]`` table ``weight``, by a 1-D gather."""
    return torch.index_select(weight.reshape(-1), 0, indices.reshape(-1)).view(*indices.shape, 1)


_RULES: dict[object, Callable[[fx.Node], Optional[Lowering]]] = {
    aten.embedding.default: _one_column_table,
}
