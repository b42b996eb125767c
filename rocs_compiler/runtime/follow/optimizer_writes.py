"""Optimizer steps made visible to the version counters that the weight refresh reads.

Fused optimizers (``torch.optim.SGD/Adam/AdamW/Adagrad(fused=True)``) update their parameters in
one kernel that bumps no version counter, so the weight refresh (``runtime/follow/weights.py``), which
finds in-place writes by those counters, would keep folded constants, copies and request-cache
entries computed from the weights before the step. Third-party optimizers with kernels of their
own can do the same.

:func:`follow` records the weights that compiled models read; one process-wide optimizer
post-step hook (``register_optimizer_step_post_hook``, installed by the first :func:`follow`)
bumps the version counter of every followed tensor that the stepping optimizer holds, through
``torch.autograd.graph.increment_version``, PyTorch's own way to declare a write that a kernel
made behind autograd's back. Every optimizer derived from ``torch.optim.Optimizer`` runs the
hook, fused or not: a second bump after a step that already bumped one is harmless (the refresh
compares counters for equality only). Tensors that no compiled model reads are left alone, so
the hook changes nothing for other models: it looks each parameter up by ``id`` in a table of
weak references (a followed tensor that dies leaves it).

Not seen: a fused step run inside ``torch.compile``'d code. The hook returns there, so that it
adds no graph break nor guard to a compiled step, and the compiled fused kernel bumps no counter
either (a compiled step of another kind bumps its own); call ``CompiledModel.refresh_weights()``
after it.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

# id(tensor) -> a weak reference to it; an entry whose reference no longer points at the tensor
# with that id (it died, and another took its id) is not followed.
_FOLLOWED: dict[int, weakref.ref] = {}
_HOOK: list = []  # the hook's handle, once installed


def follow(tensors: Iterable[torch.Tensor]) -> None:
    """Have optimizer steps that write any of ``tensors`` bump its version counter."""
    for t in tensors:
        key = id(t)
        held = _FOLLOWED.get(key)
        if held is None or held() is not t:
            _FOLLOWED[key] = weakref.ref(t, _forget(key))
    if not _HOOK:
        _HOOK.append(register_optimizer_step_post_hook(_bump_followed))


def _forget(key: int):
    def forget(ref: weakref.ref) -> None:
        if _FOLLOWED.get(key) is ref:
            del _FOLLOWED[key]

    return forget


def _bump_followed(optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
    if torch.compiler.is_compiling() or not _FOLLOWED:  # compiling first: no guard on the table
        return
    written = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            held = _FOLLOWED.get(id(p))
            if held is not None and held() is p:
                written.append(p)
    if written:
        torch.autograd.graph.increment_version(written)
