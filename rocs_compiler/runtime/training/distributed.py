"""Training calls that would skip DistributedDataParallel's gradient sync are refused.

``DDP(model)`` all-reduces gradients only for backward passes of forwards run through the DDP
module (its forward prepares the reducer; outside it, the reducer's hooks return without a
word). A compiled model of that same ``model`` called directly computes ``model``'s gradients
without DDP's forward, so every rank would step on its own gradients and drift apart silently.
The working pattern is the other way around, ``DDP(rocs.compile(model, ..., training=True))``:
the compiled model's parameters are the original's (``runtime/follow/module_state.py``), so DDP's
reducer hooks them, and DDP's forward calls the compiled model.

How: DDP holds its module as a registered submodule (``ddp.module``), so wrapping ``model``, or
a module holding it or the compiled model (``DDP(parent)`` with ``parent.tower`` the model), in DDP
is a module registration (``weights.registrations()`` moves). Whenever that count moved since the
last look and a process group is initialized, a training call looks for a DDP among the modules
holding the compiled model or its original, their holders, and so on up (``gc.get_referrers``:
a holder's ``_modules`` dict, then its ``__dict__`` and the holder; a few milliseconds per level,
once per registration, not per step); a call made while no such DDP's forward is running
(``DistributedDataParallel._active_ddp_module``) is refused. A parent's forward calling the
compiled model inside its DDP's forward is the working pattern.

``rocs.compile(DDP(model), ...)`` (torch.compile's order) is refused before capture, naming the
order that works.
"""

from __future__ import annotations

import gc
import weakref

import torch
from torch import nn

from ...errors import CompileError, InputError
from ..follow.weights import registrations


class DDPWatch:
    """Finds the ``DistributedDataParallel`` modules wrapping ``modules`` (the original and the
    compiled model) or a module holding them, and refuses calls past them."""

    def __init__(self, *modules: nn.Module):
        self._modules = [weakref.ref(m) for m in modules if m is not None]
        self._seen = -1  # ``registrations()`` at the last look
        self._wrappers: list[weakref.ref] = []

    def check(self) -> None:
        """Raise :class:`InputError` when a module watched is wrapped by DDP (itself or through
        a parent) and this call is not inside that DDP's forward."""
        if not torch.distributed.is_available() or not torch.distributed.is_initialized():
            return
        count = registrations()
        if count != self._seen:
            self._seen = count
            modules = [m for m in (ref() for ref in self._modules) if m is not None]
            self._wrappers = [weakref.ref(ddp) for ddp in _ddps_holding(modules)]
        wrappers = [w for w in (ref() for ref in self._wrappers) if w is not None]
        if not wrappers:
            return
        from torch.nn.parallel import DistributedDataParallel

        active = DistributedDataParallel._active_ddp_module
        if any(active is wrapper for wrapper in wrappers):
            return
        raise InputError(
            "the compiled model's original (or a module holding it) is wrapped in "
            "DistributedDataParallel, but this call does not go through it, so its gradients "
            "would not be all-reduced across ranks: wrap the compiled model instead, "
            "DDP(rocs.compile(model, ..., training=True)), or call it from the forward of the "
            "module DDP wraps, and call that"
        )


def _ddps_holding(modules: list[nn.Module]) -> list:
    """The live ``DistributedDataParallel`` modules among the holders of ``modules``, their
    holders, and so on up."""
    from torch.nn.parallel import DistributedDataParallel

    found, seen = [], {id(m) for m in modules}
    level = list(modules)
    while level:
        holders = [h for h in _holders(level) if id(h) not in seen]
        seen.update(id(h) for h in holders)
        found += [h for h in holders if isinstance(h, DistributedDataParallel)]
        level = holders
    return found


def _holders(modules: list[nn.Module]) -> list[nn.Module]:
    """The modules whose ``_modules`` dict holds one of ``modules`` (one scan of the heap per
    step: ``gc.get_referrers`` takes them all at once)."""
    ids = {id(m) for m in modules}
    tables = [
        t for t in gc.get_referrers(*modules)
        if isinstance(t, dict) and any(id(v) in ids for v in t.values())
    ]  # fmt: skip
    if not tables:
        return []
    table_ids = {id(t) for t in tables}
    holders, dicts = [], []
    for owner in gc.get_referrers(*tables):  # a module, or the ``__dict__`` holding its table
        if isinstance(owner, nn.Module):
            holders.append(owner)
        elif isinstance(owner, dict) and id(owner.get("_modules")) in table_ids:
            dicts.append(owner)
    if dicts:
        holders += [o for o in gc.get_referrers(*dicts) if isinstance(o, nn.Module)]
    # Only modules whose own submodule table holds one of ``modules``.
    unique = {id(h): h for h in holders if id(getattr(h, "_modules", None)) in table_ids}
    return list(unique.values())


def refuse_wrapped(model: nn.Module) -> None:
    """Refuse ``rocs.compile(DDP(model), ...)`` before capture, naming the order that works."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        raise CompileError(
            "rocs.compile got a DistributedDataParallel module: compile the model first and "
            "wrap the compiled model in DDP, DDP(rocs.compile(model, ..., training=True)), so "
            "DDP's forward and gradient hooks run around the compiled program (for inference, "
            "compile the wrapped model, rocs.compile(ddp.module, ...))"
        )


def sharded_by_fsdp(module: nn.Module) -> bool:
    """True when ``module`` is the root unit of an FSDP2 ``fully_shard`` tree.

    Its training calls never choose between the program and the original model by timing
    (``runtime/training/program.py``, "Program choice"): the two run different collectives (the program
    all-gathers every unit at once, the original one unit at a time), and each rank timing its
    own trials may settle a bucket its own way, after which the ranks' collectives stop pairing
    and every rank waits for ever. They run the program, on every rank alike."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def unshard_fsdp(module: nn.Module) -> bool:
    """All-gather the parameters of every FSDP2 unit under ``module`` when ``module`` is the root
    of a ``fully_shard`` tree; True when it is. The compiled program reads the weights itself,
    so the units' forward hooks (which all-gather them in eager) never run: the units stay
    unsharded until the root's end-of-backward callback, which reduce-scatters their gradients
    and reshards every unit whose own backward hook did not."""
    if not sharded_by_fsdp(module):
        return False
    from torch.distributed.fsdp import FSDPModule

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
