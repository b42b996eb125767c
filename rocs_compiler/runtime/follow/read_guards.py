"""Guards on what forward reads beyond its modules' own attributes, and on its forward hooks.

Export bakes into the graph the globals the model's code reads (``x * SCALE``), the attributes
of objects its modules hold (``self.cfg.scale``, a dataclass or plain object held by identity),
the class attributes it reads (``type(self).K``, ``self.K`` defined on the class), and the
effect of every forward pre-hook and forward hook of the modules it called. Capture records the
globals and the attribute names the model's code reads (``capture/code_reads.py``); this module
turns that record into entries of the guards' per-call comparison (``runtime/follow/guards.py``).

Identity relied on: each such value is one entry of a dict that stays the same object: a globals
dictionary, a held object's instance ``__dict__``, the ``__dict__`` of the class that defines the
attribute (a ``mappingproxy`` over it), and a module's hook tables, whose keys are handle ids that
``register_forward_hook`` never reuses. So the per-call cost is that of the existing tables: one
``itemgetter`` per dictionary read, and the keys of the hook tables of the modules called, read
only when a hook was registered since (:class:`HookWatch`); an unchanged entry is short-cut by
identity. Plain data is compared by type and value, other objects by identity
(``guard_values.py``). Globals holding library modules (``torch``, ``F``) are left out.

Hooks are followed when unchanged and refused otherwise (added, removed); torch's own hooks
that the program does without are left out: FSDP2's (added by ``fully_shard`` after compiling;
the runtime unshards the units itself, ``runtime/training/distributed.py``) and the global hooks of the
module trackers (``FlopCounterMode``, which the report's cost model runs, in any thread).

Not followed: attributes of objects without an instance ``__dict__`` (``__slots__``), of torch's
objects, and held objects deeper than :data:`MAX_DEPTH` attributes from a module or a global.
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as module_state
from torch.utils.hooks import RemovableHandle

from ...capture.code_reads import LIBRARIES, CodeReads, library_object
from ...capture.reads import FROM_CLASS, Reads
from .guard_values import MISSING, is_plain, refuse, same_data, show, snapshot

MAX_DEPTH = 4  # attributes followed from a module attribute, a global or a class
_HOOK_TABLES = {"_forward_pre_hooks": "forward pre-hooks", "_forward_hooks": "forward hooks"}
_GLOBAL_HOOKS = {
    "_global_forward_pre_hooks": "global forward pre-hooks",
    "_global_forward_hooks": "global forward hooks",
}
# Hooks torch adds itself that the compiled program does without: FSDP2's (``fully_shard`` after
# compiling; the runtime unshards the units itself) and the module trackers of FlopCounterMode and
# torch.distributed's tools (global hooks that only note which module runs, in any thread).
_TORCHS = ("torch.distributed.", "torch.utils.module_tracker", "torch.utils.flop_counter")
_NOT_FOLLOWED = (
    nn.Module, torch.Tensor, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
    functools.partial, property, staticmethod, classmethod,
)  # fmt: skip


@dataclass
class _Start:
    """Where a chain of attribute names starts: a module path (its instance ``__dict__``), a
    globals dictionary, or a class."""

    kind: str  # "module", "globals" or "class"
    where: Any  # the module path, the globals dict, or the class

    def label(self, chain: tuple[str, ...]) -> str:
        if self.kind == "module":
            return ".".join(filter(None, ("model", self.where, *chain)))
        if self.kind == "globals":
            return f"global {'.'.join(chain)} (module {self.where.get('__name__', '?')})"
        return f"class attribute {self.where.__qualname__}.{'.'.join(chain)}"


@dataclass
class ReadSpec:
    """What was compiled: values reached by attribute names, and the hooks of called modules."""

    values: list[tuple[_Start, tuple[str, ...], Any]] = field(default_factory=list)
    hooks: list[tuple[str | None, str, tuple]] = field(default_factory=list)


def read_spec(
    reads: Reads, modules: dict[str, nn.Module], attributes: dict[tuple[str, str], Any],
    called: list[str],
) -> ReadSpec:  # fmt: skip
    """The spec for ``modules`` (path -> module, the paths the guards watch), given capture's
    ``reads``, the module attributes read (``(path, name) -> value``, FROM_CLASS for a class's)
    and the paths of the modules forward called."""
    code = getattr(reads, "code", None) or CodeReads()
    spec, names = ReadSpec(), code.attribute_names

    def follow(start: _Start, chain: tuple[str, ...], value: Any, seen: frozenset) -> None:
        if len(chain) >= MAX_DEPTH or id(value) in seen or not _followed(value):
            return
        for name in sorted(names & _attribute_names(value)):
            table = _table_of(value, name)
            if table is None or name not in table:
                continue
            spec.values.append((start, chain + (name,), snapshot(table[name])))
            follow(start, chain + (name,), table[name], seen | {id(value)})

    for (path, name), value in attributes.items():
        if value is not FROM_CLASS:
            follow(_Start("module", path), (name,), value, frozenset())
    class_names: dict[type, set[str]] = {}
    for path, module in modules.items():
        class_names.setdefault(type(module), set(names))
    for (path, name), value in attributes.items():
        if value is FROM_CLASS and path in modules:
            class_names[type(modules[path])].add(name)
    for cls, wanted in class_names.items():
        for name in sorted(wanted):
            owner = _defining_class(cls, name)
            if owner is None or name == "forward" or name.startswith("__"):
                continue  # ``forward`` is guarded with the module's class
            if library_object(owner):
                continue
            value = owner.__dict__[name]
            spec.values.append((_Start("class", owner), (name,), snapshot(value)))
            follow(_Start("class", owner), (name,), value, frozenset({id(owner)}))
    for namespace, name in code.global_reads():
        value = namespace.get(name, MISSING)
        library = isinstance(value, types.ModuleType) and library_object(value)
        if value is not MISSING and not library:  # ``torch``, ``F``: code, not settings
            start = _Start("globals", namespace)
            spec.values.append((start, (name,), snapshot(namespace[name])))
            follow(start, (name,), namespace[name], frozenset())
    for path in called:
        for table in _HOOK_TABLES:
            spec.hooks.append((path, table, _hooks(getattr(modules[path], table))))
    for table in _GLOBAL_HOOKS:
        spec.hooks.append((None, table, _hooks(getattr(module_state, table))))
    return spec


def resolve_reads(spec: ReadSpec, modules: dict[str, nn.Module], fast: Any) -> None:
    """Add ``spec``'s entries, read from the model as it is, to ``fast`` (the guards' per-call
    lists), or raise :class:`CompileError` naming the first value or hook table that changed."""
    proxies: dict[int, Any] = {}  # one ``mappingproxy`` per class, so one table per class
    for start, chain, expected in spec.values:
        table, value = _walk(start, chain, modules, proxies)
        if not same_data(value, expected):
            change = f"{show(expected)} -> {show(value)}"
            raise refuse(f"{start.label(chain)} changed since compile ({change})")
        fast.entry(table, chain[-1], value, by_identity=not is_plain(value))
        if isinstance(value, (list, dict, set)) and value is not expected and is_plain(value):
            fast.contents.append(value)
            fast.snapshots.append(expected)
    for path, table_name, compiled in spec.hooks:
        owner = module_state if path is None else modules[path]
        table = getattr(owner, table_name)
        now = _hooks(table)
        if len(now) != len(compiled) or not all(map(_same_hook, now, compiled)):
            where = _GLOBAL_HOOKS.get(table_name) or (
                f"{_HOOK_TABLES[table_name]} of {'.'.join(filter(None, ('model', path)))}"
            )
            change = f"{_describe(compiled)} -> {_describe(now)}"
            raise refuse(f"the {where} changed since compile ({change})")
        fast.hooks.watch(table)


class HookWatch:
    """Per call, that no forward hook was added to or removed from the tables watched.

    Every hook registration takes a new handle id from ``RemovableHandle.next_id``, so while
    that counter stands still no table gained a hook, and only the tables that held hooks at
    the last look can have lost one: one counter read, plus one ``tuple`` of the keys of each
    table holding hooks (usually none). When the counter moved (a hook registered anywhere, a
    tensor's included) the tables are compared again once."""

    def __init__(self) -> None:
        self.counter = RemovableHandle.next_id
        self.tables: list[dict] = []
        self.keys: list[tuple] = []
        self.held: list[dict] = []  # the tables holding hooks, and their keys
        self.held_keys: list[tuple] = []

    def watch(self, table: dict) -> None:
        self.tables.append(table)
        self.keys.append(tuple(table))
        if table:
            self.held.append(table)
            self.held_keys.append(self.keys[-1])

    def holds(self) -> bool:
        counter = RemovableHandle.next_id
        if self.held and list(map(tuple, self.held)) != self.held_keys:
            return False
        if counter != self.counter:
            if list(map(tuple, self.tables)) != self.keys:
                return False
            self.counter = counter  # registered elsewhere: none of these tables changed
        return True


def _walk(start: _Start, chain: tuple[str, ...], modules: dict, proxies: dict):
    """(the table holding the last name of ``chain``, its value there or MISSING)."""
    if start.kind == "module":
        obj: Any = modules[start.where]
        table = object.__getattribute__(obj, "__dict__")
    elif start.kind == "globals":
        table = start.where
    else:
        table = _proxy(start.where, proxies)
    value = table.get(chain[0], MISSING)
    for name in chain[1:]:
        table = _table_of(value, name, proxies) if value is not MISSING else None
        if table is None:
            return {}, MISSING
        value = table.get(name, MISSING)
    return table, value


def _followed(value: Any) -> bool:
    """Whether the attributes of ``value`` are followed: a held object, class or module of the
    model's own code (not a function, tensor, module of the model, or plain data)."""
    if isinstance(value, _NOT_FOLLOWED) or is_plain(value):
        return False
    if isinstance(value, (type, types.ModuleType)):
        return not library_object(value)
    if type(value).__module__.split(".")[0] in LIBRARIES:
        return False
    try:
        return isinstance(object.__getattribute__(value, "__dict__"), dict)
    except AttributeError:
        return False


def _attribute_names(value: Any) -> set[str]:
    if isinstance(value, type):
        return {n for c in value.__mro__ if not library_object(c) for n in vars(c)}
    names = set(object.__getattribute__(value, "__dict__"))
    if not isinstance(value, types.ModuleType):
        names |= _attribute_names(type(value)) if _followed(type(value)) else set()
    return names


def _table_of(value: Any, name: str, proxies: dict | None = None):
    """The dict that holds attribute ``name`` of ``value``: its instance ``__dict__``, else the
    ``__dict__`` of the class that defines it; None when there is none."""
    if not isinstance(value, type):
        try:
            own = object.__getattribute__(value, "__dict__")
        except AttributeError:
            return None
        if not isinstance(own, dict):
            return None
        if name in own or isinstance(value, types.ModuleType):
            return own
        value = type(value)
    owner = _defining_class(value, name) or value
    return _proxy(owner, proxies) if proxies is not None else owner.__dict__


def _defining_class(cls: type, name: str) -> type | None:
    return next((c for c in cls.__mro__ if name in vars(c)), None)


def _proxy(cls: type, proxies: dict):
    return proxies.setdefault(id(cls), cls.__dict__)


def _hooks(table: dict) -> tuple:
    """The hooks of one hook table as ``(handle id, hook)``, less torch's own (:data:`_TORCHS`)."""
    return tuple(
        (key, hook) for key, hook in table.items()
        if not (getattr(hook, "__module__", None) or "").startswith(_TORCHS)
    )  # fmt: skip


def _same_hook(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and a[1] is b[1]


def _describe(hooks: tuple) -> str:
    if not hooks:
        return "none"
    names = [getattr(h, "__qualname__", type(h).__name__) for _, h in hooks]
    return ", ".join(names)
