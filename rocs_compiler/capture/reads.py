"""What a forward reads of its modules beyond their tensors, recorded during one eager call.

A captured graph depends on more than the weights it holds: which module object sits at each
path and its class and ``forward`` (their code was traced), and every plain Python attribute the
forward read (``self.temperature``, a flag choosing a branch), which export bakes into the graph
as a constant. :func:`recording` runs a call with ``nn.Module.__getattribute__`` replaced by a
recorder, so every attribute read of every module of the model is seen, through ``forward``,
helper methods and properties alike; ``runtime/guards.py`` turns the record into per-call checks.

Identity relied on: the example call runs the same Python code export traces, so it reads the
same attributes. Reads that resolve through ``nn.Module.__getattr__`` (parameters, buffers,
submodules) are not recorded here: the guards follow those by path.

Not seen: a module class that defines its own ``__getattribute__`` (its reads bypass the
recorder), and attributes of plain objects held by a module (``self.cfg.scale``: ``cfg`` is
recorded, not ``scale``).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

from torch import nn

# Markers for a read that did not find the name in the instance ``__dict__``.
FROM_CLASS = type("FROM_CLASS", (), {"__repr__": lambda self: "FROM_CLASS"})()
ABSENT = type("ABSENT", (), {"__repr__": lambda self: "ABSENT"})()

# Reads of nn.Module's own machinery (hook tables, ``_call_impl``): not the model's state.
# ``training`` (read by dropout and batch norm) and ``forward`` are the model's.
_MACHINERY = (set(vars(nn.Module())) | set(dir(nn.Module))) - {"training", "forward"}

Reads = dict  # nn.Module -> {attribute name: instance value, FROM_CLASS or ABSENT}

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
    if name in own:
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

    Yields the dict that fills up: module -> {name: value read}; a module whose ``forward`` was
    read (every module called) has a ``"forward"`` entry."""
    reads: Reads = {}
    me = threading.get_ident()
    if any(thread == me for thread, _, _ in _ACTIVE[:1]):
        yield reads  # a capture inside a recorded call (never the model's own reads): nothing
        return
    modules = {id(m) for m in model.modules()}
    with _LOCK:
        _ACTIVE.append((me, modules, reads))
        nn.Module.__getattribute__ = _recording_getattribute
        try:
            yield reads
        finally:
            del nn.Module.__getattribute__
            _ACTIVE.clear()
