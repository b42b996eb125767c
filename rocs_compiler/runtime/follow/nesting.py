"""The parameters whose ``requires_grad`` eager's nested fast-path check reads, followed by name.

``nn.TransformerEncoder`` refuses its nested path in grad mode when its input or its first layer's
parameters require grad (``kernels/nested_padding.py``, ``blocks_fast_path``). Capture names those
parameters (``capture/nested_fast_path.py``); a call reads them through their owning modules, so a
parameter reassigned after compiling (``layer.weight = nn.Parameter(...)``) is the one read.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn


class NestingParameters:
    """``iter()`` gives the current parameters named ``names`` in ``model``."""

    __slots__ = ("_owners",)

    def __init__(self, model: nn.Module, names: list[str]):
        owners = []
        for name in names:
            prefix, _, leaf = name.rpartition(".")
            owners.append((model.get_submodule(prefix), leaf))
        self._owners = tuple(owners)

    def __iter__(self) -> Iterator[torch.Tensor]:
        for owner, leaf in self._owners:
            yield getattr(owner, leaf)
