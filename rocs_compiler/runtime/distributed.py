"""Training calls that would skip DistributedDataParallel's gradient sync are refused.

``DDP(model)`` all-reduces gradients only for backward passes of forwards run through the DDP
module (its forward prepares the reducer; outside it, the reducer's hooks return without a
word). A compiled model of that same ``model`` called directly computes ``model``'s gradients
without DDP's forward, so every rank would step on its own gradients and drift apart silently.
The working pattern is the other way around, ``DDP(rocs.compile(model, ..., training=True))``:
the compiled model's parameters are the original's (``runtime/module_state.py``), so DDP's
reducer hooks them, and DDP's forward calls the compiled model.

How: DDP holds its module as a registered submodule (``ddp.module``), so wrapping ``model`` in
DDP is a module registration (``weights.registrations()`` moves). Whenever that count moved
since the last look and a process group is initialized, a training call looks for a DDP module
holding the compiled model's original (``gc.get_referrers``: the DDP's ``_modules`` dict, then
the DDP's ``__dict__`` and the DDP; a few milliseconds, once per registration, not per step); a call made while
that DDP's forward is not running (``DistributedDataParallel._active_ddp_module``) is refused.
"""

from __future__ import annotations

import gc
import weakref
from typing import Optional

import torch
from torch import nn

from ..errors import CompileError, InputError
from .weights import registrations


class DDPWatch:
    """Finds a ``DistributedDataParallel`` wrapping ``module`` and refuses calls past it."""

    def __init__(self, module: nn.Module):
        self._module = weakref.ref(module)
        self._seen = -1  # ``registrations()`` at the last look
        self._wrapper: Optional[weakref.ref] = None

    def check(self) -> None:
        """Raise :class:`InputError` when ``module`` is wrapped by DDP and this call is not
        inside that DDP's forward."""
        if not torch.distributed.is_available() or not torch.distributed.is_initialized():
            return
        count = registrations()
        if count != self._seen:
            self._seen = count
            module = self._module()
            wrapper = _ddp_holding(module) if module is not None else None
            self._wrapper = weakref.ref(wrapper) if wrapper is not None else None
        wrapper = self._wrapper() if self._wrapper is not None else None
        if wrapper is None:
            return
        from torch.nn.parallel import DistributedDataParallel

        if DistributedDataParallel._active_ddp_module is wrapper:
            return
        raise InputError(
            "the compiled model's original is wrapped in DistributedDataParallel, but this call "
            "does not go through it, so its gradients would not be all-reduced across ranks: "
            "wrap the compiled model instead, DDP(rocs.compile(model, ..., training=True)), "
            "and call that"
        )


def _ddp_holding(module: nn.Module):
    """The ``DistributedDataParallel`` whose ``module`` is ``module``, if one is alive."""
    from torch.nn.parallel import DistributedDataParallel

    for table in gc.get_referrers(module):
        if not isinstance(table, dict) or table.get("module") is not module:
            continue
        for owner in gc.get_referrers(table):  # the DDP, or the ``__dict__`` holding its table
            if isinstance(owner, dict) and owner.get("_modules") is table:
                owners = gc.get_referrers(owner)
            else:
                owners = [owner]
            for ddp in owners:
                if isinstance(ddp, DistributedDataParallel) and ddp._modules is table:
                    return ddp
    return None


def unshard_fsdp(module: nn.Module) -> bool:
    """All-gather the parameters of every FSDP2 unit under ``module`` when ``module`` is the root
    of a ``fully_shard`` tree; True when it is. The compiled program reads the weights itself,
    so the units' forward hooks (which all-gather them in eager) never run: the units stay
    unsharded until the root's end-of-backward callback, which reduce-scatters their gradients
    and reshards every unit whose own backward hook did not."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        return False
    for unit in module.modules():
        if unit is not module and isinstance(unit, FSDPModule):
            unit.unshard()
    return True


def refuse_sharded(model: nn.Module) -> None:
    """Refuse a model whose parameters FSDP2 already sharded (``DTensor``), before capture."""
    from torch.distributed.tensor import DTensor

    name = next((n for n, p in model.named_parameters() if isinstance(p, DTensor)), None)
    if name is not None:
        raise CompileError(
            f"parameter {name} is sharded by FSDP2 (a DTensor): compile before sharding, "
            "cm = rocs.compile(model, ..., training=True), then fully_shard each layer of model "
            "and fully_shard(cm) last (capture needs whole weights, and the compiled model must "
            "be the root unit whose hooks run around its program)"
        )
