"""The zoo: one entry per model, with its request inputs, builder and batch maker."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from . import bst, dcnv2, din, dlrm, finalmlp, hstu, mmoe, target_attention, two_tower, wukong
from .batch import Batch

__all__ = ["ZOO", "ZooEntry", "get_entry", "names"]


@dataclass(frozen=True)
class ZooEntry:
    """A zoo model.

    `build(seed=0)` returns the model in eval mode with weights fixed by the seed.
    `make_batch(counts, *, seed=0, shuffle=False)` returns a shared-layout Batch with
    R = len(counts) requests and N = sum(counts) candidates, deterministic per seed.
    """

    name: str
    description: str
    request_inputs: tuple[str, ...]
    build: Callable[..., nn.Module]
    make_batch: Callable[..., Batch]


def _entry(module) -> ZooEntry:
    name = module.__name__.rsplit(".", 1)[-1]
    return ZooEntry(
        name, module.DESCRIPTION, module.REQUEST_INPUTS, module.build, module.make_batch
    )


ZOO: dict[str, ZooEntry] = {
    e.name: e
    for e in map(
        _entry,
        (dlrm, dcnv2, finalmlp, wukong, din, bst, two_tower, mmoe, hstu, target_attention),
    )
}


def names() -> list[str]:
    return list(ZOO)


def get_entry(name: str) -> ZooEntry:
    try:
        return ZOO[name]
    except KeyError:
        raise KeyError(f"unknown zoo model {name!r}; known: {', '.join(ZOO)}") from None
