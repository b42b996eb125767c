"""Weight refresh: a compiled model computes with its original model's current weights.

The compiled graph reads each parameter and buffer of the original model through an alias (a
``get_attr`` attribute that shares storage and version counter with it, made at capture), so
in-place updates (``load_state_dict``, optimizer steps, ``copy_`` under ``no_grad``) reach it
with no work at all. Three things do not follow by themselves:

- *folded constants* (``passes/cleanup.py``): weight-only subgraphs evaluated once into buffers
  of their own, e.g. the column slices of a weight that ``split_linear`` makes, or a GLM weight
  times its mask. Each ``get_attr`` node reading one carries its recipe (``graph_meta.FOLD``);
- *rebinding*: a new tensor object where a weight was (``module.weight = nn.Parameter(...)``,
  ``load_state_dict(assign=True)``, a replaced submodule), or a weight whose storage was swapped
  in place (``set_``, which a parametrization's ``right_inverse`` uses);
- *copies*: after ``compiled.to(device)`` the graph module holds copies of the weights.

Identity: a folded constant (or a copy) equals its recipe evaluated on the weights as long as no
weight it reads was written since. Every in-place write bumps a tensor's ``_version`` counter
(autograd's own staleness check relies on it; a fused optimizer step, whose kernel does not, is
made to by ``runtime/follow/optimizer_writes.py``), every assignment of a parameter, buffer or
submodule goes through ``nn.Module``'s registration hooks, which here count into one
process-wide number (except inside ``torch.compile``d code, where ``runtime/follow/guards.py`` finds
reassignments), and an assignment to ``.data`` gives the tensor another storage. So before
each call :meth:`WeightRefresh.current` compares that number, the version counters and the data
pointers of the model's weights with those of the last refresh (two C reads per weight, a few
us for 40 weights); when any moved, :meth:`WeightRefresh.refresh`
looks the weights up again by name, rebinds the aliases that no longer alias, copies into the
copies, and evaluates again the folds that read a changed weight. Folds and copies are updated
in place (``copy_``), so whoever holds them keeps valid references; rebinding replaces graph
module attributes and bumps :attr:`WeightRefresh.epoch`, after which a runner that bound the
old tensors (the direct program) must be rebuilt.

Inference tensors (a model built or loaded under ``torch.inference_mode()``) have no version
counter, and can be written only inside inference mode, where nothing counts the writes. Their
in-place reload is seen through ``load_state_dict``: the modules owning such weights get a
``load_state_dict`` post-hook (it runs for every module a load reaches, whichever module it was
called on) that counts into a second process-wide number, compared per call like the first.
Other in-place writes to inference tensors (``p.copy_(w)`` under inference mode) are not seen:
``CompiledModel.refresh_weights()``.

Refused (``CompileError``, "compile again"): a weight that is no longer a parameter or buffer
under its name, or whose new tensor has another shape, dtype or device. Not seen: in-place
writes through ``.data`` (``p.data.copy_(x)``) and by kernels that bump no version counter
(batch norm's running statistics in a train-mode forward, a fused optimizer step inside
``torch.compile``d code), which by PyTorch's definition bypass version tracking: the aliases
see them, folded constants and copies do not; ``CompiledModel.refresh_weights()`` re-reads
everything after such writes. (The request cache
compares the buffers it depends on by content, ``runtime/follow/content_watch.py``.)
"""

from __future__ import annotations

import operator
import threading
import weakref
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional

import torch
from torch import fx, nn
from torch.nn.modules import module as _module

from ...errors import CompileError
from ...ir.folded import Fold
from ...ir.graph_meta import FOLD
from . import optimizer_writes


class _Registrations:
    """How many parameters, buffers and submodules were assigned anywhere in the process."""

    count = 0


def _count_registration(*_args) -> None:
    # Dynamo traces the hooks of modules made inside a compiled forward (``self.seq[:2]`` makes
    # a new ``nn.Sequential`` per call): counting there would guard every other model's compiled
    # code on this number, recompiling it on every call. Registrations inside compiled code are
    # not counted: the guards still find a compiled model's reassigned weights (``guards.py``
    # compares the module tables themselves and calls ``note_reassignment``).
    if torch.compiler.is_compiling():
        return
    _Registrations.count += 1


_module.register_module_parameter_registration_hook(_count_registration)
_module.register_module_buffer_registration_hook(_count_registration)
_module.register_module_module_registration_hook(_count_registration)


def registrations() -> int:
    """How many parameters, buffers and submodules were assigned anywhere in the process."""
    return _Registrations.count


def note_reassignment() -> None:
    """Count a reassignment made without the registration hooks (``runtime/follow/guards.py`` finds
    them): the next refresh looks every weight up again by name."""
    _Registrations.count += 1


class _Reloads:
    """How many ``load_state_dict`` calls reached a module owning an inference-tensor weight."""

    count = 0


def _count_reload(*_args) -> None:
    _Reloads.count += 1


_RELOAD_HOOKED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def _watch_reloads(module: nn.Module) -> None:
    if module not in _RELOAD_HOOKED:
        module.register_load_state_dict_post_hook(_count_reload)
        _RELOAD_HOOKED.add(module)


def tensor_version(t: torch.Tensor) -> int:
    """``t._version``, or for an inference tensor (no version counter) a number that moves
    when a ``load_state_dict`` reached a watched module (negative: never a real version)."""
    return -1 - _Reloads.count if t.is_inference() else t._version

_VERSION = operator.attrgetter("_version")
_DATA_PTR = torch.Tensor.data_ptr
# One lock for every compiled model's refreshes: they are rare, and a per-instance lock would make
# compiled models impossible to deep-copy.
_LOCK = threading.RLock()


@dataclass
class _Weight:
    attr: str  # graph module attribute
    name: str  # the parameter's or buffer's name in the original model
    source: torch.Tensor  # the model's tensor, as last seen
    alias: bool  # the attribute aliases ``source`` (else it is a copy kept equal to it)
    version: int = -1  # ``source._version`` as last seen
    pointer: int = 0  # ``source.data_ptr()`` as last seen (``.data = x`` moves it)


@dataclass
class _Folded:
    attr: str
    fold: Fold
    sources: frozenset[str]
    owned: bool  # the buffer has storage of its own (else it is a view of a weight)


class WeightRefresh:
    """Keeps the weights and folded constants of ``gm`` equal to ``model``'s current weights.

    ``names`` maps graph module attributes to the model's parameter and buffer names (capture's
    ``param_names``); attributes whose name is not a parameter or buffer of ``model`` (constants
    lifted from the forward) are left alone.
    """

    def __init__(self, gm: fx.GraphModule, model: nn.Module, names: Mapping[str, str]):
        self._gm, self._model, self._names = gm, model, dict(names)
        self.epoch = 0  # bumped whenever an attribute of ``gm`` is replaced
        self.generation = 0  # bumped whenever a refresh found a weight written, or was forced
        self.bind()

    def bind(self) -> None:
        """Find what follows what (after compiling, or after ``gm``'s tensors moved)."""
        with _LOCK:
            self._bind()
            self.epoch += 1  # whoever bound ``gm``'s tensors must bind them again

    def _bind(self) -> None:
        gm = self._gm
        weights = []
        for attr, name in self._names.items():
            held = getattr(gm, attr, None)
            source = lookup_weight(self._model, name)
            if isinstance(held, torch.Tensor) and source is not None:
                weights.append(_Weight(attr, name, source, _same_view(held, source)))
                if source.is_inference():
                    _watch_reloads(self._model.get_submodule(name.rpartition(".")[0]))
        folds = []
        for node in gm.graph.nodes:
            fold = node.meta.get(FOLD) if node.op == "get_attr" else None
            if fold is None:
                continue
            missing = [s for s in fold.sources if not hasattr(gm, s)]
            if missing:
                raise RuntimeError(
                    f"rocs: folded constant {node.target} reads {missing}, which the graph module "
                    "lacks; it could not follow weight refreshes"
                )
            buffer = getattr(gm, node.target)
            owned = not any(_shares_storage(buffer, getattr(gm, s)) for s in fold.sources)
            folds.append(_Folded(node.target, fold, fold.sources, owned))
        self._weights, self._folds = weights, folds
        optimizer_writes.follow(w.source for w in weights)
        self._watched = [w.source for w in weights if _trackable(w.source)]
        self._versions: Optional[list[int]] = None  # the next call refreshes everything once
        self._pointed = [w.source for w in weights if _has_pointer(w.source)]
        self._pointers: Optional[list[int]] = None
        self._registrations = -1
        self._reloads = -1

    def following(self, model: nn.Module) -> "WeightRefresh":
        """The same graph's weights kept equal to ``model``'s, by the same names (a graph
        compiled from a moved copy of ``model`` follows ``model`` with cast copies)."""
        return WeightRefresh(self._gm, model, self._names)

    def held(self) -> list[torch.Tensor]:
        """The graph module's tensors that stand for the model's weights (no folded constants)."""
        return [getattr(self._gm, w.attr) for w in self._weights]

    def current(self) -> bool:
        """True when no weight was written or reassigned since the last refresh (per call)."""
        return (
            self._registrations == _Registrations.count
            and self._reloads == _Reloads.count
            and list(map(_VERSION, self._watched)) == self._versions
            and list(map(_DATA_PTR, self._pointed)) == self._pointers
        )

    def refresh(self, force: bool = False) -> None:
        """Bring ``gm`` up to date with the model's weights (see the module docstring)."""
        with _LOCK:
            if not force and self.current():
                return
            count = _Registrations.count  # read first: later registrations refresh again
            reloads = _Reloads.count
            look_up = force or count != self._registrations
            everything = force or self._versions is None
            gm, sources, steps = self._gm, [], []
            for w in self._weights:  # check everything before changing anything
                source = self._require(w) if look_up else w.source
                sources.append(source)
                held = getattr(gm, w.attr)
                moved = (
                    everything
                    or source is not w.source
                    or tensor_version(source) != w.version
                    or _pointer(source) != w.pointer
                )
                if w.alias and not _same_view(held, source):
                    _check_like(w, held, source, same_device=True)
                    steps.append((w, source, "rebind"))
                elif moved:
                    _check_like(w, held, source, same_device=w.alias)
                    steps.append((w, source, "written" if w.alias else "copy"))
            if steps or force:
                self.generation += 1
            changed, rebound = set(), set()
            for w, source, step in steps:
                if step == "rebind":
                    _assign(gm, w.attr, source.detach())
                    rebound.add(w.attr)
                elif step == "copy":
                    with torch.no_grad():
                        getattr(gm, w.attr).copy_(source)
                changed.add(w.attr)
            for w, source in zip(self._weights, sources):
                w.source, w.version, w.pointer = source, tensor_version(source), _pointer(source)
            if look_up:
                optimizer_writes.follow(sources)
            for f in self._folds:
                if f.sources & rebound or (f.owned and (everything or f.sources & changed)):
                    value = f.fold.evaluate(gm)
                    buffer = getattr(gm, f.attr)
                    if f.owned and buffer.shape == value.shape and buffer.dtype == value.dtype:
                        buffer.copy_(value)
                    else:
                        _assign(gm, f.attr, value)
                        rebound.add(f.attr)
            if rebound:
                self.epoch += 1
            self._watched = [w.source for w in self._weights if _trackable(w.source)]
            self._versions = [w.version for w in self._weights if _trackable(w.source)]
            self._pointed = [w.source for w in self._weights if _has_pointer(w.source)]
            self._pointers = [w.pointer for w in self._weights if _has_pointer(w.source)]
            self._registrations = count
            self._reloads = reloads

    def read_by_content(self, attrs: Iterable[str]) -> list[torch.Tensor]:
        """The tensors behind the graph attributes ``attrs`` whose writes a refresh may miss
        (``runtime/follow/content_watch.py``): the model's buffers (not its parameters), as they are
        or as sources of a folded constant, and the graph's tensors that are no weight of the
        model nor a folded constant (lifted from forward, e.g. a plain tensor attribute: the
        graph shares it with the model, and nothing counts its writes)."""
        sources = {f.attr: f.sources for f in self._folds}
        wanted = set(attrs).union(*(sources.get(a, ()) for a in attrs))
        weights = {w.attr for w in self._weights}
        found = [
            w.source
            for w in self._weights
            if w.attr in wanted and not isinstance(w.source, nn.Parameter)
        ]
        for attr in wanted - weights - sources.keys():
            value = getattr(self._gm, attr, None)
            if isinstance(value, torch.Tensor):
                found.append(value)
        return found

    def requiring_grad(self, attrs: Optional[frozenset[str]] = None) -> Optional[torch.Tensor]:
        """The first of the model's weights behind ``attrs`` (all when None) that requires grad."""
        for w in self._weights:
            if w.source.requires_grad and (attrs is None or w.attr in attrs):
                return w.source
        return None

    def _require(self, w: _Weight) -> torch.Tensor:
        source = lookup_weight(self._model, w.name)
        if source is None:
            raise CompileError(
                f"{w.name} is no longer a parameter or buffer of the compiled model's original; "
                "the compiled graph reads it: compile the model again"
            )
        return source


def lookup_weight(model: nn.Module, name: str) -> Optional[torch.Tensor]:
    """The parameter or buffer registered under ``name`` (not a computed attribute)."""
    prefix, _, leaf = name.rpartition(".")
    try:
        owner = model.get_submodule(prefix)
    except AttributeError:
        return None
    for table in (owner._parameters, owner._buffers):
        if leaf in table:
            return table[leaf]  # None when it was set to None
    return None


def _trackable(t: torch.Tensor) -> bool:
    """Inference tensors have no version counter (they cannot be written outside inference mode)."""
    return not t.is_inference()


def _has_pointer(t: torch.Tensor) -> bool:
    """A plain strided tensor of its own storage (not an inference tensor, whose writes no
    counter sees either way, nor a wrapper subclass such as a ``DTensor``, which has no data
    pointer)."""
    return (
        _trackable(t) and t.layout == torch.strided and type(t) in (torch.Tensor, nn.Parameter)
    )


def _pointer(t: torch.Tensor) -> int:
    return t.data_ptr() if _has_pointer(t) else 0


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.device == b.device
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.storage_offset() == b.storage_offset()
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    )


def _shares_storage(a: torch.Tensor, b: object) -> bool:
    return (
        isinstance(b, torch.Tensor)
        and a.device == b.device
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    )


def _check_like(w: _Weight, held: torch.Tensor, source: torch.Tensor, same_device: bool) -> None:
    problems = []
    if source.shape != held.shape:
        problems.append(f"shape {tuple(source.shape)}, compiled for {tuple(held.shape)}")
    if same_device and source.dtype != held.dtype:
        problems.append(f"dtype {source.dtype}, compiled for {held.dtype}")
    if same_device and source.device != held.device:
        problems.append(f"device {source.device}, compiled for {held.device}")
    if problems:
        raise CompileError(
            f"{w.name} was replaced by a tensor of {', '.join(problems)}; the compiled graph is "
            "specialized to it: compile the model again"
        )


def _assign(gm: nn.Module, attr: str, value: torch.Tensor) -> None:
    """Replace an attribute of the graph module; a buffer without the registration hooks (the
    graph module is ours, so that is no reassignment the compiled model needs to hear about)."""
    if attr in gm._buffers:
        gm._buffers[attr] = value
    else:
        setattr(gm, attr, value)
