"""A cache entry's code run as a plain function, with dynamo's helpers called past their
``disable`` wrappers: :func:`direct_function`.

The bytecode dynamo writes for a compiled frame reads the frame's sizes through helpers of
``torch._dynamo.utils`` (``call_size``, ``record_pregraph_bytecode_enter`` and ``_exit``) and
calls the compiled graph, each wrapped in dynamo's ``disable``: a wrapper that takes the
eval-frame hook off around the call and puts it back (four hook swaps, about 0.9 us on the CPU
over the call itself). Inside a frame dynamo runs, the hook is installed, and the wrapper keeps
dynamo from tracing the helper or the graph. A call of the code as a plain function with no hook
installed (``compiled_frame.py``) has no hook to take off: there the wrapper's only work is the
swaps, 15 wrapped calls per door call at glm_dcnv2 (the user's frame and the lowered graph's).

Identity: with no eval-frame hook installed and dynamo's default stance, ``disable(fn)(*args)``
calls ``fn(*args)`` and nothing else (it traces nothing and, outside an export, annotates
nothing), so the code with each such global read as the function it wraps computes what the code
computes. The direct function reads the same globals dict, so every other global stays live; the
unwrapped values live in it under names of their own (``__rocs_direct_<name>``), as dynamo's
own helpers do. The caller checks that no hook is installed before each call.
"""

from __future__ import annotations

import types
from typing import Any, Optional

import torch

_PREFIX = "__rocs_direct_"


def direct_function(code: types.CodeType, globals_: dict) -> Optional[types.FunctionType]:
    """``code`` as a function of ``globals_`` whose disable-wrapped globals are read unwrapped;
    None when the code reads none (the plain function is as fast)."""
    renamed = {}
    for name in code.co_names:
        if not name.startswith("__") or name not in globals_:
            continue
        direct = _unwrapped(globals_[name])
        if direct is not None:
            renamed[name] = _PREFIX + name
            globals_[_PREFIX + name] = direct
    if not renamed:
        return None
    names = tuple(renamed.get(n, n) for n in code.co_names)
    return types.FunctionType(code.replace(co_names=names), globals_, code.co_name)


def _unwrapped(value: Any) -> Any:
    """What a global of dynamo's bytecode stands for with its disable wrappers taken off: the
    compiled graph a ``disable`` wraps, or ``torch._dynamo.utils`` with its helpers unwrapped;
    None for anything else."""
    if isinstance(value, types.FunctionType) and getattr(value, "_torchdynamo_disable", False):
        return getattr(value, "_torchdynamo_orig_callable", None)
    if isinstance(value, types.ModuleType) and value.__name__ == "torch._dynamo.utils":
        return _helpers(value)
    return None


_HELPERS: Optional[types.ModuleType] = None


def _helpers(utils: types.ModuleType) -> types.ModuleType:
    """``torch._dynamo.utils`` with each function ``torch._disable_dynamo`` wraps read as the
    function itself: its functions as they are at the first call (a module attribute, not a
    lookup through ``__getattr__``), every other attribute as the module has it when read."""
    global _HELPERS
    if _HELPERS is None:
        wrapper_code = torch._disable_dynamo(_helpers).__code__  # the wrapper's, for any function
        helpers = _Helpers(utils.__name__)
        helpers.utils = utils
        for name, value in vars(utils).items():
            if not isinstance(value, types.FunctionType):
                continue  # read from the module when asked for
            if value.__code__ is wrapper_code and callable(getattr(value, "__wrapped__", None)):
                value = value.__wrapped__
            setattr(helpers, name, value)
        _HELPERS = helpers
    return _HELPERS


class _Helpers(types.ModuleType):
    utils: types.ModuleType

    def __getattr__(self, name: str) -> Any:
        return getattr(self.utils, name)
