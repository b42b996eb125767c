"""What a forward reads of its modules beyond their tensors, recorded during one eager call.

A captured graph depends on more than the weights it holds: which module object sits at each
path and its class and ``forward`` (their code was traced), and every plain Python attribute the
forward read (``self.temperature``, a flag choosing a branch), which export bakes into the graph
as a constant. :func:`recording` runs a call with ``nn.Module.__getattribute__`` replaced by a
recorder, so every attribute read of every module of the model is seen, through ``forward``,
helper methods and properties alike; ``runtime/follow/guards.py`` turns the record into per-call checks.

Identity relied on: the example call runs the same Python code export traces, so it reads the
same attributes. Reads that resolve through ``nn.Module.__getattr__`` (parameters, buffers,
submodules) are not recorded here: the guards follow those by path.

An attribute the call assigns before it reads it (``weight``, which the forward pre-hook of
``torch.nn.utils.weight_norm`` computes from ``weight_g`` and ``weight_v`` on every call) is the
call's own value, traced into the graph: it is recorded as :data:`WRITTEN`, not as a dependency.
What the model's code reads outside its modules (globals, fields of held objects, class
attributes) is recorded beside, by ``code_reads.py``, in :attr:`Reads.code`.

Not seen: a module class that defines its own ``__getattribute__`` (its reads bypass the
recorder).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

from torch import nn

from .code_reads import CodeReads, code_recording

# Markers for a read that did not find the name in the instance ``__dict__``.
FROM_CLASS = type("FROM_CLASS", (), {"__repr__": lambda self: "FROM_CLASS"})()
ABSENT = type("ABSENT", (), {"__repr__": lambda self: "ABSENT"})()
# Marker for an attribute the call assigned before reading it: the call's own value.
WRITTEN = type("WRITTEN", (), {"__repr__": lambda self: "WRITTEN"})()

# Reads of nn.Module's own machinery (hook tables, ``_call_impl``): not the model's state.
# ``training`` (read by dropout and batch norm) and ``forward`` are the model's.
_MACHINERY = (set(vars(nn.Module())) | set(dir(nn.Module))) - {"training", "forward"}
_MODULE_SETATTR = nn.Module.__setattr__


class Reads(dict):
    """nn.Module -> {attribute name: instance value, FROM_CLASS, ABSENT or WRITTEN}, with
    :attr:`code`, what the model's own code read beside (``code_reads.py``)."""

    code: CodeReads

    def __init__(self, *args, code: CodeReads | None = None):
        super().__init__(*args)
        self.code = code if code is not None else CodeReads()

    def with_modules(self, tables: dict) -> "Reads":
        """These reads with their module tables replaced by ``tables``."""
        return Reads(tables, code=self.code)


_ACTIVE: list = []  # (thread id, modules being recorded, reads); at most one recording at a time
_LOCK = threading.Lock()


def _recording_getattribute(self, name: str) -> Any:
    try:
        value = object.__getattribute__(self, name)
    except AttributeError:
        _note(self, name, ABSENT)
        raise
    _note(self, name, value)
    return value


def _recording_setattr(self, name: str, value: Any) -> None:
    _note(self, name, WRITTEN)
    _MODULE_SETATTR(self, name, value)


def _note(module: nn.Module, name: str, value: Any) -> None:
    active = _ACTIVE[:1]  # other threads read attributes too while the recorder is installed
    if not active or name in _MACHINERY or name.startswith("__"):
        return
    thread, modules, reads = active[0]
    if threading.get_ident() != thread or id(module) not in modules:
        return
    table = reads.setdefault(module, {})
    if name in table:
        return  # the first read is what the graph saw
    own = object.__getattribute__(module, "__dict__")
    if value is WRITTEN:
        table[name] = WRITTEN
    elif name in own:
        table[name] = own[name]
    elif value is ABSENT:
        tables = ("_parameters", "_buffers", "_modules")
        if not any(name in own.get(t, ()) for t in tables):
            table[name] = ABSENT  # a ``getattr(self, name, default)`` that found nothing
    else:
        table[name] = FROM_CLASS


@contextlib.contextmanager
def recording(model: nn.Module) -> Iterator[Reads]:
    """Record, while the block runs, the attributes this thread reads of ``model``'s modules.

    Yields the :class:`Reads` that fills up: module -> {name: value read}; a module whose
    ``forward`` was read (every module called) has a ``"forward"`` entry."""
    reads = Reads()
    me = threading.get_ident()
    if any(thread == me for thread, _, _ in _ACTIVE[:1]):
        yield reads  # a capture inside a recorded call (never the model's own reads): nothing
        return
    modules = {id(m) for m in model.modules()}
    with _LOCK:
        _ACTIVE.append((me, modules, reads))
        nn.Module.__getattribute__ = _recording_getattribute
        nn.Module.__setattr__ = _recording_setattr
        try:
            with code_recording() as reads.code:
                yield reads
        finally:
            del nn.Module.__getattribute__
            nn.Module.__setattr__ = _MODULE_SETATTR
            _ACTIVE.clear()
