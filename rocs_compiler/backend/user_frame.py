"""The user's model, compiled by dynamo with the rocs backend, called from :func:`shared_call`
without ``torch.compile``'s call machinery: :func:`call_compiled`.

``torch.compile(model)(**inputs)`` runs the optimized module's call, the model's ``_call_impl``
(which runs its hooks), dynamo's context (which installs the eval-frame hook and restores it) and
the hook's lookup of ``forward``'s cache: 20-40 us on the CPU before the first guard is checked.
``shared_call`` makes every call of a served model, so it keeps a :class:`CompiledFrame` of the
model's ``forward`` restricted to the entries the optimized module's own backend compiled (the
rocs backend; the code is the model class's, which other compiles may have cached entries on).

Identity: without hooks, ``_call_impl`` calls ``forward`` and nothing else, and dynamo runs
``forward`` as the code of a cache entry whose guards pass on its locals (``compiled_frame.py``),
so running that code after the same guards passed computes what ``compiled(**inputs)`` computes.
A model with hooks, a global module hook, a call no entry accepts, or a stance other than the
default goes through ``compiled(...)`` as before.

The frames dynamo compiles inside such a call (the model's, and the graphs the backend lowers
while compiling it: at the first call, and at a call the compiled entries refused) are guarded
with dynamo's recursive dict tags
(``use_recursive_dict_tags_for_guards``): a module whose ``__dict__``, and every dict below it,
is the same object with the same version tag as when the guards last passed has its subtree's
guards skipped, so a call checks one tag per module instead of every parameter's dtype, sizes
and strides (glm_dcnv2's frame: 17 mask buffers and 34 parameters). A module changed by
assignment (``model.train()``, a swapped parameter, a new float) changes its dict's tag and has
its guards checked in full. What the tags do not see is a tensor changed in place; dynamo's
default guards already skip a parameter's checks when its own module's dict tag matches
(``skip_tensor_guards_with_matching_dict_tags``), and the backend's rewrite checks the module
state it reads on every call, by identity, version and data pointer (``subgraph.py``). A torch
without the option keeps its default guards. The option is dynamo's process-wide configuration,
so it is set only around those calls (setting and restoring it costs about 20 us): a model with
hooks or a graph break, whose every call goes through ``torch.compile``, does not pay that per
call, and another thread's compile sees the option only while such a call compiles.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable

from torch import nn
from torch.nn.modules.module import _has_any_global_hook

from .compiled_frame import MISS, CompiledFrame

_FRAMES: "weakref.WeakKeyDictionary[nn.Module, CompiledFrame]" = weakref.WeakKeyDictionary()


def call_compiled(compiled: Callable, args: tuple, kwargs: dict) -> Any:
    """``compiled(*args, **kwargs)``, through its rocs-compiled ``forward`` entries where one
    accepts the call."""
    frame = _FRAMES.get(compiled) if isinstance(compiled, nn.Module) else None
    compiles = frame is None  # the first call compiles
    if frame is not None and not _hooked(compiled, frame.module):
        out = frame.call(args, kwargs)
        if out is not MISS:
            return out
        compiles = frame.has_entries  # an entry refused the call: dynamo compiles another
    if compiles:
        with _recursive_dict_tags():
            out = compiled(*args, **kwargs)
    else:
        out = compiled(*args, **kwargs)
    if frame is None:
        frame = _frame_of(compiled)
    if frame is not None:
        frame.missed()  # dynamo may have compiled an entry for this call
    return out


def _recursive_dict_tags():
    """Dynamo's recursive dict tags for the guards it builds in this scope; a torch without the
    option keeps its default guards."""
    from torch._dynamo import config

    if not hasattr(config, "use_recursive_dict_tags_for_guards"):
        return contextlib.nullcontext()
    return config.patch(use_recursive_dict_tags_for_guards=True)


def _frame_of(compiled: Callable):
    """A compiled frame of the model behind ``compiled``, for the entries its own backend
    compiles; None for anything but an optimized module (a function ``torch.compile`` wraps)."""
    from torch._dynamo.eval_frame import OptimizedModule, innermost_backend

    if not isinstance(compiled, OptimizedModule):
        return None
    callback = getattr(compiled.dynamo_ctx, "callback", None)
    backend = innermost_backend(callback) if callback is not None else None
    if backend is None:
        return None
    frame = CompiledFrame(compiled._orig_mod, backend)
    try:
        _FRAMES[compiled] = frame
    except TypeError:
        return None
    return frame


def _hooked(compiled: nn.Module, module: nn.Module) -> bool:
    """Whether a hook runs around ``module``'s forward (``compiled`` optimizes ``module``)."""
    return (
        _has_any_global_hook()
        or bool(module._forward_hooks or module._forward_pre_hooks)
        or bool(module._backward_hooks or module._backward_pre_hooks)
        or bool(compiled._forward_hooks or compiled._forward_pre_hooks)
        or bool(compiled._backward_hooks or compiled._backward_pre_hooks)
    )
