"""Guards: a compiled model runs only while its original model is the model it compiled.

The compiled graph follows the original's tensors (``runtime/follow/weights.py``), but it also depends
on what capture traced and baked in: which module object sits at each path, its class and
``forward``, the plain Python attributes its forward read (``capture/reads.py``), which
parameters were one tensor (tied weights are one graph attribute), and that each parameter it
reads is still there. :class:`Guards` checks all of that before every call and refuses, with a
:class:`CompileError` naming what changed, a model that is no longer the one compiled; it never
runs the old computation.

Identity relied on: every one of those dependencies is one entry of a dict the model owns (a
parent's ``_modules``, a module's ``_parameters``/``_buffers``, an instance ``__dict__``), plus
each module's class and its class's ``forward``. Any assignment, through ``nn.Module.__setattr__``
or around it (``m.bias = None`` fires no registration hook; ``m.__dict__[k] = v``, ``del``),
changes what such an entry holds. So the per-call check is a flat comparison of precomputed
lists, read with C-level ``map``, no walk of the model and no Python frame per entry: the
entries' values with ``==`` (which Python short-cuts by identity, so an unchanged entry costs no
comparison; it runs behind the weight refresh's registration count, so a reassigned module or
parameter never reaches ``==``), the numbers among them by type too, other objects read by
identity, the modules' classes and the called classes' ``forward`` functions. Hooking
``__setattr__`` instead would be cheaper per call but miss writes that bypass it.

When the comparison fails, the guards resolve every path again from the root and compare with
what was compiled: a replaced module of the same class whose attributes are equal (type and
value), an attribute set again to an equal value, weights replaced by new tensors (still tied
where they were) pass, and the fast lists are rebuilt; anything else is refused. Plain data is
compared by type and value (``2`` is not ``2.0``); lists, dicts and sets of plain data read by
forward are also compared by value on every call (in-place edits); other objects (functions,
tensors held as plain attributes, config objects) by identity, except that a dataclass read again
equal field by field (a replaced module's config) passes the rebuild.

Globals the model's code reads, the attributes of objects its modules hold (``self.cfg.scale``),
class attributes read, and the forward hooks of the modules called are guarded the same way by
``runtime/follow/read_guards.py``; an attribute the call itself assigns before reading it (the weight
that ``torch.nn.utils.weight_norm``'s pre-hook computes) is the graph's own value, not guarded.
"""

from __future__ import annotations

import operator
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ...capture.reads import ABSENT, FROM_CLASS, WRITTEN, Reads
from .guard_values import MISSING
from .guard_values import is_plain as _is_plain
from .guard_values import refuse as _refuse
from .guard_values import same_data as _same_data
from .guard_values import show as _show
from .guard_values import snapshot as _snapshot
from .read_guards import HookWatch, ReadSpec, read_spec, resolve_reads
from .weights import note_reassignment, registrations

_FORWARD = operator.attrgetter("forward")
_LOCK = threading.RLock()


@dataclass
class _Spec:
    """What was compiled, by path ('' is the model itself)."""

    classes: dict[str, type] = field(default_factory=dict)  # guarded module paths, parents first
    same_modules: list[tuple[str, ...]] = field(default_factory=list)  # paths of one object
    forwards: dict[str, Any] = field(default_factory=dict)  # called path -> class's forward
    attrs: dict[tuple[str, str], Any] = field(default_factory=dict)  # (path, name) -> value read
    weights: list[tuple[tuple[str, str, str], ...]] = field(default_factory=list)  # tied groups
    reads: ReadSpec = field(default_factory=ReadSpec)  # globals, held objects, hooks


@dataclass
class _Fast:
    """The per-call comparison: ``getters[i](args[i])`` is ``expected[i]`` while the model is
    the one compiled. Entries of one table (a parent's ``_modules``, a module's ``__dict__``)
    are read together, by one ``operator.itemgetter`` of the keys that hold something and one
    ``isdisjoint`` of those that must stay absent; the others read a module's class (``type``)
    and a traced class's ``forward`` (``_FORWARD``). :meth:`seal` builds them."""

    registrations: int = -1  # ``weights.registrations()`` when these lists were made
    getters: list = field(default_factory=list)
    args: list = field(default_factory=list)
    expected: list = field(default_factory=list)
    same_dicts: list = field(default_factory=list)  # objects compared by identity, again
    same_keys: list = field(default_factory=list)
    same: list = field(default_factory=list)
    typed_dicts: list = field(default_factory=list)  # the numbers again: ``2 == 2.0``, by type
    typed_keys: list = field(default_factory=list)
    types: list = field(default_factory=list)
    called: list = field(default_factory=list)  # classes whose forward was traced
    contents: list = field(default_factory=list)  # containers read, compared by value
    snapshots: list = field(default_factory=list)
    hooks: HookWatch = field(default_factory=HookWatch)  # forward hooks of the called modules
    tables: dict = field(default_factory=dict)  # id -> (table, {key: value}, {absent keys})

    def entry(self, table: dict, key: str, value: Any, by_identity: bool = False) -> None:
        _, present, absent = self.tables.setdefault(id(table), (table, {}, set()))
        if value is MISSING:
            absent.add(key)
            return
        present[key] = value
        if by_identity:  # a tensor or object whose ``==`` may say equal for another one
            self.same_dicts.append(table)
            self.same_keys.append(key)
            self.same.append(value)
        if isinstance(value, (bool, int, float, complex)):
            self.typed_dicts.append(table)
            self.typed_keys.append(key)
            self.types.append(type(value))

    def check(self, getter: Any, arg: Any, expected: Any) -> None:
        self.getters.append(getter)
        self.args.append(arg)
        self.expected.append(expected)

    def seal(self) -> "_Fast":
        for table, present, absent in self.tables.values():
            if present:
                self.check(operator.itemgetter(*present), table, tuple(present.values()))
                if len(present) == 1:
                    self.expected[-1] = self.expected[-1][0]
            if absent:
                self.check(table.keys().isdisjoint, frozenset(absent), True)
        self.tables = {}
        return self

    def holds(self) -> bool:
        # Entries are compared with ``==``, which Python short-cuts by identity, so an unchanged
        # entry costs no comparison. A changed one is one of: a module or tensor reassigned
        # through ``__setattr__`` (the registration count moved first, so no tensor is ever
        # compared by value here), an equal value of another type (``typed``), or a change.
        if self.registrations != registrations():
            return False
        # Tables are dicts, or a class's ``mappingproxy`` (``read_guards.py``): ``getitem``.
        try:
            if list(map(operator.call, self.getters, self.args)) != self.expected:
                return False
            if self.types and (
                list(map(type, map(operator.getitem, self.typed_dicts, self.typed_keys)))
                != self.types
            ):
                return False
            if self.same and not all(
                map(operator.is_, map(operator.getitem, self.same_dicts, self.same_keys), self.same)
            ):
                return False
        except Exception:  # noqa: BLE001 - a key gone, or an ``__eq__`` that cannot say
            return False
        if self.contents and self.contents != self.snapshots:
            return False
        hooks = self.hooks
        return (hooks.counter == RemovableHandle.next_id and not hooks.held) or hooks.holds()


class Guards:
    """Checks, per call, that ``model`` is still the model compiled (see the module docstring).

    ``reads`` is capture's record of the attributes forward read; ``weight_names`` maps graph
    attributes to the parameter and buffer names the graph reads."""

    def __init__(self, model: nn.Module, reads: Reads, weight_names: Mapping[str, str]):
        self._model = model
        self._spec = _spec_of(model, reads, weight_names)
        self._fast = _resolve(model, self._spec)

    def check(self) -> None:
        """Return when the model is unchanged (or changed only in ways the graph follows);
        raise :class:`CompileError` naming the change otherwise."""
        if torch.compiler.is_compiling():
            return  # a tracer reading the compiled model: its own guards apply
        if not self._fast.holds():
            self._recheck()

    def _recheck(self) -> None:
        with _LOCK:
            if self._fast.holds():
                return
            # Entries may have been written without nn.Module's registration hooks
            # (``_parameters[k] = p``): have the weight refresh look every weight up again.
            note_reassignment()
            self._fast = _resolve(self._model, self._spec)


class NoGuards:
    """For a compiled model without an original to watch."""

    def check(self) -> None:
        pass


NO_GUARDS = NoGuards()


# -- what was compiled --------------------------------------------------------------------------


def _spec_of(model: nn.Module, reads: Reads, weight_names: Mapping[str, str]) -> _Spec:
    paths: dict[int, list[str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        paths.setdefault(id(module), []).append(path)
    spec = _Spec()
    guarded: set[str] = {""}

    def guard(module_paths: list[str]) -> None:
        """Guard every path of one module, their parents, and that they stay one module."""
        for path in module_paths:
            parts = path.split(".") if path else []
            guarded.update(".".join(parts[:i]) for i in range(len(parts) + 1))
        if len(module_paths) > 1 and tuple(module_paths) not in spec.same_modules:
            spec.same_modules.append(tuple(module_paths))

    for module, table in reads.items():
        module_paths = paths.get(id(module))
        if not module_paths:
            continue  # not reachable from the model: nothing to resolve it by
        guard(module_paths)
        path = module_paths[0]
        own = object.__getattribute__(module, "__dict__")
        for name, value in table.items():
            if value is WRITTEN:
                continue  # assigned by the call before it read it: computed in the graph
            # As the model is now, after capture (export swaps parameters in and out, and a
            # module may update caches of its own then: an RNN's ``_flat_weight_refs``).
            if value is not FROM_CLASS and value is not ABSENT:
                value = own.get(name, ABSENT)
            spec.attrs[(path, name)] = _snapshot(value)
        if "forward" in table:
            spec.forwards[path] = type(module).forward
    names_of: dict[int, list[tuple[str, str, str]]] = {}
    for table_name, named in (
        ("_parameters", model.named_parameters(remove_duplicate=False)),
        ("_buffers", model.named_buffers(remove_duplicate=False)),
    ):
        for fqn, tensor in named:
            owner, _, leaf = fqn.rpartition(".")
            names_of.setdefault(id(tensor), []).append((owner, table_name, leaf))
    by_name = {
        ".".join(filter(None, (o, leaf))): i for i, ns in names_of.items() for o, _, leaf in ns
    }
    seen = set()
    for fqn in weight_names.values():
        key = by_name.get(fqn)
        if key is None or key in seen:
            continue  # a constant lifted from forward (guarded as an attribute read), or tied
        seen.add(key)
        group = tuple(names_of[key])
        spec.weights.append(group)
        for owner, _, _ in group:
            guard(paths[id(model.get_submodule(owner))])
    modules = {}
    for path in sorted(guarded, key=lambda p: (p.count(".") + bool(p), p)):
        modules[path] = model.get_submodule(path)
        spec.classes[path] = type(modules[path])
    spec.reads = read_spec(reads, modules, spec.attrs, list(spec.forwards))
    return spec


# A compiled model runs in the mode it was compiled in (``CompiledModel.train`` switches the
# original, so ``cm.train()`` and a parent's ``.train()`` land here). A training compile whose
# whole model is in eval mode runs its eval-mode program (``runtime/modes/eval_mode.py``): what lands
# here is a submodule switched alone.
_MODE_HINTS = {
    True: " (call model.eval() or cm.eval())",
    False: (
        " (compiled in training mode: switch the whole model, cm.eval() to evaluate or "
        "cm.train() to train on)"
    ),
}


# -- the model as it is -------------------------------------------------------------------------


def _where(path: str, name: str = "") -> str:
    return ".".join(filter(None, ("model", path, name)))


def _sharded(cls: type, compiled: type) -> bool:
    """True for the class ``fully_shard`` gives a module of class ``compiled`` (FSDP2: the
    same class with ``FSDPModule``'s unshard/reshard methods in front; its forward is the
    compiled class's)."""
    if cls.__bases__[-1:] != (compiled,) or len(cls.__bases__) != 2:
        return False
    from torch.distributed.fsdp import FSDPModule

    return cls.__bases__[0] is FSDPModule and cls.forward is compiled.forward


def _resolve(model: nn.Module, spec: _Spec) -> _Fast:
    """The fast lists for the model as it is, or :class:`CompileError` naming the first
    difference from what was compiled."""
    fast, modules = _Fast(registrations()), {"": model}
    for path, cls in spec.classes.items():
        if path:
            parent_path, _, name = path.rpartition(".")
            parent = modules[parent_path]
            child = parent._modules.get(name, MISSING)
            if not isinstance(child, nn.Module):
                raise _refuse(f"{_where(path)} was removed since compile")
            fast.entry(parent._modules, name, child)
            modules[path] = child
        module = modules[path]
        if type(module) is not cls and not _sharded(type(module), cls):
            old, new = cls.__name__, type(module).__name__
            raise _refuse(f"{_where(path)} was replaced since compile ({old} -> {new})")
        fast.check(type, module, type(module))
    for group in spec.same_modules:
        if len({id(modules[p]) for p in group}) > 1:
            first, *others = group
            raise _refuse(
                f"{_where(others[0])} is no longer the same module as {_where(first)}"
            )
    for path, forward in spec.forwards.items():
        cls = type(modules[path])
        if cls.forward is not forward:
            raise _refuse(f"{cls.__name__}.forward was replaced since compile")
        if cls not in fast.called:
            fast.called.append(cls)
            fast.check(_FORWARD, cls, forward)
    for (path, name), expected in spec.attrs.items():
        own = object.__getattribute__(modules[path], "__dict__")
        value = own.get(name, MISSING)
        if expected is FROM_CLASS or expected is ABSENT:
            if value is not MISSING:
                what = f"{_where(path, name)} was set on the instance since compile"
                raise _refuse(f"{what} ({_show(value)}; compiled with the class's)")
            fast.entry(own, name, MISSING)
            continue
        if not _same_data(value, expected):
            hint = _MODE_HINTS.get(value, "") if name == "training" else ""
            change = f"{_show(expected)} -> {_show(value)}"
            raise _refuse(f"{_where(path, name)} changed since compile ({change}){hint}")
        fast.entry(own, name, value, by_identity=not _is_plain(value))
        if isinstance(value, (list, dict, set)) and value is not expected and _is_plain(value):
            fast.contents.append(value)
            fast.snapshots.append(expected)
    for group in spec.weights:
        tensors = []
        for owner, table_name, leaf in group:
            table = getattr(modules[owner], table_name)
            tensor = table.get(leaf, MISSING)
            if tensor is MISSING or tensor is None:
                how = "set to None" if tensor is None else "removed"
                what = f"{_where(owner, leaf)} is no longer a parameter or buffer"
                raise _refuse(f"{what} ({how} since compile)")
            fast.entry(table, leaf, tensor)
            tensors.append(tensor)
        untied = [(o, leaf) for (o, _, leaf), t in zip(group, tensors) if t is not tensors[0]]
        if untied:
            first = _where(group[0][0], group[0][2])
            what = f"{_where(*untied[0])} is no longer tied to {first}"
            raise _refuse(f"{what} (one tensor at compile time)")
    resolve_reads(spec.reads, modules, fast)
    return fast.seal()
