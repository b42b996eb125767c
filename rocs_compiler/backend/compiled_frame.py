"""A module's forward that dynamo has compiled, run without dynamo's eval-frame hook:
:class:`CompiledFrame`.

``torch.compile(module)(*args)`` reaches the compiled code through the optimized module's call,
the module's call, dynamo's context (which installs its eval-frame hook and restores it) and the
hook's lookup of the frame's cache: 20-25 us per call on the CPU, as much as a small graph's
kernels at one request. Once dynamo has compiled ``module.forward``, the frame's cache holds, for
each compiled variant, the guards it checks and the transformed bytecode that calls the compiled
graph.

Identity: dynamo runs the frame as the code of a cache entry whose guards pass on the frame's
locals, with the frame's globals; calling that code as a function of the same arguments, after
the same guards passed, computes the same thing; with no eval-frame hook installed, the code runs
with dynamo's helpers and the compiled graph called past their disable wrappers, which then have
nothing to do (``direct_code.py``). A call that no entry's guards accept (another
dtype, grad mode on, a size a guard pins), an entry that resumes after a graph break (its resume
functions are compiled frames of their own), a stance other than the default, or a torch without
these internals goes through ``torch.compile`` as before, which compiles anew where it must.
"""

from __future__ import annotations

import inspect
import types
from typing import Any

from torch import nn

from .direct_code import direct_function

MISS = object()  # what a call returns when no compiled entry accepts it
_VARIADIC = inspect.CO_VARARGS | inspect.CO_VARKEYWORDS


class CompiledFrame:
    """Runs ``module.forward``'s compiled entries directly; :data:`MISS` when none accepts the
    call. :meth:`refresh` reads the entries again after dynamo compiled one."""

    __slots__ = (
        "_module", "_code", "_globals", "_self", "_names", "_name_set", "_defaults", "_backend",
        "_entries", "_misses",
    )  # fmt: skip

    def __init__(self, module: nn.Module, backend: Any = None):
        """``backend``: run only the entries that backend compiled (None: any). The forward's
        code is its class's, shared by every instance and by every ``torch.compile`` of one,
        and an entry's guards do not tell the instances apart."""
        function = getattr(module.forward, "__func__", None)  # a forward that is no method: None
        code = getattr(function, "__code__", None)
        if code is not None and (code.co_flags & _VARIADIC or code.co_kwonlyargcount):
            code = None  # ``*args``, ``**kwargs`` or keyword-only parameters: dynamo runs it
        self._module = module
        self._code = code
        self._globals = getattr(function, "__globals__", None)
        self._self = code.co_varnames[0] if code and code.co_argcount else "self"
        self._names = code.co_varnames[1 : code.co_argcount] if code else ()
        self._name_set = frozenset(self._names)
        defaults = (getattr(function, "__defaults__", None) or ()) if code else ()
        self._defaults = dict(zip(self._names[len(self._names) - len(defaults) :], defaults))
        self._backend = backend
        # Per entry: its guards, its code as a function, and the same with dynamo's helpers
        # called past their disable wrappers (``direct_code.py``; None where it has none).
        self._entries: list[tuple[Any, types.FunctionType, Any]] = []
        self._misses = 0  # calls in a row that no entry accepted

    def __call__(self, args: tuple) -> Any:
        if not self._entries or len(args) != len(self._names):
            return MISS
        return self._run(dict(zip(self._names, args)), args)

    def call(self, args: tuple, kwargs: dict) -> Any:
        """:meth:`__call__` with arguments by position and by name, defaults filled in."""
        if not self._entries or len(args) > len(self._names):
            return MISS
        if args and any(n in kwargs for n in self._names[: len(args)]):
            return MISS  # an argument given twice: Python's own call raises
        bound = {**self._defaults, **dict(zip(self._names, args)), **kwargs}
        if bound.keys() != self._name_set:
            return MISS  # a name forward does not take, or a parameter left without a value
        return self._run(bound, tuple(map(bound.__getitem__, self._names)))

    def _run(self, frame_locals: dict, args: tuple) -> Any:
        """The entry whose guards accept ``frame_locals`` (``args`` by name, ``self`` to come),
        run on ``args``; :data:`MISS` when none does."""
        if not _default_stance():
            return MISS
        frame_locals[self._self] = self._module
        for guards, run, direct in self._entries:
            if guards.check(frame_locals):
                self._misses = 0
                if direct is not None and _no_eval_frame_hook():
                    return direct(self._module, *args)
                return run(self._module, *args)
        return MISS

    @property
    def module(self) -> nn.Module:
        """The module whose forward it runs."""
        return self._module

    @property
    def has_entries(self) -> bool:
        """Whether some compiled entry may run a call (one that refuses a call means dynamo
        compiles another for it)."""
        return bool(self._entries)

    def __deepcopy__(self, memo: dict) -> None:
        """None: a copied module's forward is code of its own, which dynamo compiles at the
        copy's first call; its owner makes a frame of it then."""
        return None

    def missed(self) -> None:
        """After a call no entry accepted, which dynamo ran (compiling an entry where it could):
        :meth:`refresh` at the 1st, 2nd, 4th, 8th... such call in a row, so that a frame whose
        entries never accept (resume functions after a graph break) reads its cache rarely."""
        self._misses += 1
        if not self._misses & (self._misses - 1):
            self.refresh()

    def refresh(self) -> None:
        """Read the frame's cache entries (after dynamo compiled one); none on a torch whose
        cache cannot be read so."""
        if self._code is None:
            return
        try:
            from torch._dynamo.eval_frame import _debug_get_cache_entry_list

            cached = _debug_get_cache_entry_list(self._code)
        except Exception:  # a torch without these internals: every call takes dynamo's path
            self._entries = []
            return
        entries = []
        for entry in cached:
            code, guards = getattr(entry, "code", None), getattr(entry, "guard_manager", None)
            if code is None or not callable(getattr(guards, "check", None)) or _resumes(code):
                continue
            if self._backend is not None and getattr(entry, "backend", None) is not self._backend:
                continue
            run = types.FunctionType(code, self._globals, code.co_name)
            entries.append((guards, run, direct_function(code, self._globals)))
        self._entries = entries


def _resumes(code: types.CodeType) -> bool:
    """True for transformed code that continues after a graph break in resume functions, or that
    closes over variables a plain function of it would not have."""
    return bool(code.co_freevars) or any(n.startswith("__resume_at") for n in code.co_names)


_EVAL_FRAME: Any = None  # torch._dynamo.eval_frame, imported at the first call

try:  # part of torch's C extension: no import of dynamo's Python
    from torch._C._dynamo.eval_frame import get_eval_frame_callback as _eval_frame_hook
except ImportError:  # a torch without it: a hook may be installed, run dynamo's code as written
    _eval_frame_hook = object


def _no_eval_frame_hook() -> bool:
    """True when no eval-frame hook is installed (no dynamo frame runs around this call), where
    dynamo's disable wrappers have nothing to take off (``direct_code.py``)."""
    return _eval_frame_hook() is None


def _default_stance() -> bool:
    """True under dynamo's default stance, where a call runs the entry whose guards accept it.
    Dynamo reads ``config.disable`` only when it converts a frame: an entry compiled before runs
    whatever the option says, and so does a call here (reading the option took 2 us a call)."""
    global _EVAL_FRAME
    if _EVAL_FRAME is None:
        from torch._dynamo import eval_frame

        _EVAL_FRAME = eval_frame
    stance = getattr(_EVAL_FRAME, "_stance", None)
    return stance is None or (stance.stance == "default" and not stance.skip_guard_eval_unsafe)
