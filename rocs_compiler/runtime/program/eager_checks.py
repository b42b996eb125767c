"""Checks that ``torch.nn.functional`` makes in Python before an ATen op, kept in the program.

Capture records the ATen op a functional wrapper calls, not the wrapper's own checks of its
input's size: ``F.batch_norm`` with batch statistics refuses one value per channel, and
``F.instance_norm`` with input statistics one spatial element, both with a ``ValueError``,
while the ATen op answers (a variance of zero). A program that ran the bare op would answer a
call the original model refuses. For each such node :func:`eager_check` gives the wrapper's check,
which the program calls on the op's input before the op (``direct.py``), so the call raises the
original's error.

A node is checked only when capture says it came from the wrapper (``node.meta["torch_fn"]``): a
model that calls ``torch.batch_norm`` itself gets no check, as in eager.

Identity: for an input that passes the check the program runs the op unchanged; for one that
fails it raises what eager raises. The checks read only sizes that every program keeps: batch
statistics mix rows, so that op runs on the call's candidate rows (``analysis/role_rules.py``),
and the instance-norm check reads no row count.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import fx

aten = torch.ops.aten


def eager_check(node: fx.Node) -> Optional[Callable[[torch.Tensor], None]]:
    """The check ``node``'s functional wrapper makes on the op's input, or None."""
    rule = _RULES.get(node.target)
    if rule is None:
        return None
    wrapper, statistics_argument, check = rule
    if node.meta.get("torch_fn", (None, None))[1] != wrapper:
        return None
    return check if _argument(node, statistics_argument) is True else None


def _argument(node: fx.Node, name: str):
    names = [a.name for a in node.target._schema.arguments]
    position = names.index(name)
    return node.args[position] if position < len(node.args) else node.kwargs.get(name)


def more_than_one_value_per_channel(value: torch.Tensor) -> None:
    """``F.batch_norm``'s check when it uses batch statistics."""
    size = value.shape
    values = size[0]
    for extent in size[2:]:
        values *= extent
    if values == 1:
        raise ValueError(
            f"Expected more than 1 value per channel when training, got input size {size}"
        )


def more_than_one_spatial_element(value: torch.Tensor) -> None:
    """``F.instance_norm``'s check when it uses the input's statistics."""
    size = value.shape
    elements = 1
    for extent in size[2:]:
        elements *= extent
    if elements == 1:
        raise ValueError(
            f"Expected more than 1 spatial element when training, got input size {size}"
        )


# op: (the wrapper capture names in ``torch_fn``, the op's "use the batch's statistics" argument,
# the check). The batch norm's op is ``batch_norm`` in an inference capture and one of its native
# forms in a training capture.
_BATCH_STATISTICS = ("function.batch_norm", "training", more_than_one_value_per_channel)
_RULES: dict[object, tuple[str, str, Callable[[torch.Tensor], None]]] = {
    aten.batch_norm.default: _BATCH_STATISTICS,
    aten.native_batch_norm.default: _BATCH_STATISTICS,
    aten._native_batch_norm_legit.default: _BATCH_STATISTICS,
    aten._native_batch_norm_legit.no_stats: _BATCH_STATISTICS,
    aten._native_batch_norm_legit_functional.default: _BATCH_STATISTICS,
    aten.instance_norm.default: (
        "function.instance_norm", "use_input_stats", more_than_one_spatial_element
    ),
}
