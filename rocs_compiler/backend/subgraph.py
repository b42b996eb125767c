"""One dynamo graph as the backend hands it back: :class:`Subgraph`, callable with the graph's
arguments, and the state of a shared-layout call (:data:`SHARED_CALL`) it reads.

A subgraph compiles itself with ``rocs.compile`` at its first call (one variant per set of
non-batch shapes), recompiles when module state (a tensor's identity, version or data pointer)
or a baked scalar changed since, and runs
plainly (Inductor or the graph itself) when the rewrite fails or shares nothing. Inside
``shared_call`` a subgraph that receives the request inputs untouched runs on their R-row
tensors with ``candidate_to_request``.
"""

from __future__ import annotations

import contextvars
import operator
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import torch
from torch import fx

from .dynamo_graph import Slot, dotted, graph_model
from .fast_paths import decompose_fast_paths
from ..errors import CompileError
from ..formats.leaves import nest
from ..options import BackendOptions
from ..runtime import CompiledModel
from ..runtime.training import no_backward
from ..runtime.follow.weights import tensor_version
from .lowering import Lowered
from .settled_shared import SettledShared
from .unshared import unshared_reason


@dataclass
class SharedCall:
    index: torch.Tensor
    shared: dict[str, torch.Tensor]  # request leaf name -> R-row tensor
    replicated: dict[str, torch.Tensor]  # request leaf name -> the N-row tensor handed to dynamo
    graphs_shared: int = 0


SHARED_CALL: contextvars.ContextVar[Optional[SharedCall]] = contextvars.ContextVar(
    "rocs_shared_call", default=None
)


# -- one compiled dynamo graph --------------------------------------------------------------------


@dataclass
class _Variant:
    """The rocs compilation of one dynamo graph for one set of non-batch shapes."""

    model: Any  # the rocs CompiledModel (runs the FX graph)
    runner: Callable  # the same contract, running the lowered graph
    requests: tuple = ()  # (path, dotted name) of each of its request leaves
    settled: Optional[SettledShared] = None  # its shared calls without the call path


@dataclass
class Subgraph:
    """What the backend returns to dynamo for one graph: callable with the graph's arguments."""

    gm: fx.GraphModule
    slots: list[Slot]
    request_inputs: list[str]
    options: BackendOptions
    consts: list[tuple[int, torch.Tensor, int]] = field(default_factory=list)
    # Baked values, compared per call: (position, tensor, its number when it is a scalar).
    values: list[tuple[int, torch.Tensor, Any]] = field(default_factory=list)
    variants: dict = field(default_factory=dict)
    plain: Optional[Callable] = None  # set when rocs does not rewrite this graph
    # Called when the rewrite shares nothing: True when dynamo will trace the frame again
    # (``UnsharedGraphs.retrace``), whose graph the backend then lowers with Inductor at once.
    retrace: Optional[Callable[[str], bool]] = None
    fallback_reason: Optional[str] = None
    static_rows: Optional[int] = None  # the batch size of a graph dynamo traced with static shapes
    # Per input, the dims past the batch that dynamo traced as sizes (``symbolic_dims``), and
    # those of them whose size changed between calls (``dynamic_dims``: a history length): the
    # rewrite takes the changed ones dynamic, and one variant serves every value of them. A size
    # that never changes (a feature width dynamo also traced as a symbol) stays fixed.
    symbolic_dims: dict = field(default_factory=dict)
    dynamic_dims: dict = field(default_factory=dict)
    _first_sizes: dict = field(default_factory=dict)
    # The consts' positions, tensors and versions, compared per call in C-level passes; None
    # before the first compile, or with an inference tensor among them (``_seen_state``).
    _seen: Optional[tuple] = None
    # The consts and their data pointers (``_pointers_of``): an assignment to ``.data`` gives a
    # tensor another storage without a new object or a version bump.
    _pointers: Optional[tuple] = None
    _input_slots: list = field(init=False)  # (position, path) of each input

    def __post_init__(self):
        self._input_slots = [(i, s.path) for i, s in enumerate(self.slots) if s.kind == "input"]

    @property
    def compiled_model(self):
        """The rocs ``CompiledModel`` of the most recent variant (None if not rewritten)."""
        return next(reversed(self.variants.values())).model if self.variants else None

    def __call__(self, *args):
        if self.plain is not None:
            return self.plain(*args)
        if self._state_changed(args):
            self.variants.clear()  # weights or scalars changed since compile time: rewrite again
        leaves = {path: args[i] for i, path in self._input_slots}
        variant = self.variants.get(self._key(leaves))
        if variant is None:
            if self._sizes_changed(leaves):
                self.variants.clear()  # the next rewrite serves every value of the new sizes
            variant = self._compile(args)
        if variant is None:
            return self.plain(*args)
        state = SHARED_CALL.get()
        if state is not None and _takes_shared(variant, state, leaves):
            state.graphs_shared += 1
            if variant.settled is not None:
                out = variant.settled(leaves, state.shared, state.index)
                if out is not None:
                    return list(out)
            for path in leaves:
                name = dotted(path)
                if name in state.shared:
                    leaves[path] = state.shared[name]
            out = variant.runner(**nest(leaves), candidate_to_request=state.index)
        else:
            out = variant.runner(**nest(leaves))
        return self._refuse_backward(list(out))

    def _refuse_backward(self, out: list) -> list:
        """In grad mode, with module state requiring grad (a model trained through
        ``torch.compile``), outputs get a ``grad_fn`` whose backward raises, naming the training
        compile, instead of coming back detached (``runtime/training/no_backward.py``)."""
        if not torch.is_grad_enabled():
            return out
        anchor = no_backward.first_requiring_grad(value for _, value, _ in self.consts)
        if anchor is None:
            return out
        return no_backward.attach(out, [True] * len(out), anchor)

    def _state_changed(self, args: tuple) -> bool:
        seen = self._seen
        if seen is not None:
            positions, tensors, versions = seen
            if not all(map(operator.is_, map(args.__getitem__, positions), tensors)):
                return True
            if list(map(_VERSION, tensors)) != versions:
                return True
        elif any(
            args[i] is not value or tensor_version(value) != version
            for i, value, version in self.consts
        ):
            return True
        if self._pointers is not None:
            tensors, pointers = self._pointers
            if list(map(_DATA_PTR, tensors)) != pointers:
                return True
        return any(not _same_value(args[i], value, number) for i, value, number in self.values)

    def _key(self, leaves: dict) -> tuple:
        dynamic = self.dynamic_dims
        if not dynamic:  # the sizes past the batch as they are
            return tuple([(t.shape[1:], t.dim(), t.dtype, t.device) for t in leaves.values()])
        return tuple(
            (_static_sizes(t.shape, dynamic.get(path, ())), t.dim(), t.dtype, t.device)
            for path, t in leaves.items()
        )

    def _sizes_changed(self, leaves: dict) -> bool:
        """Note the sizes dynamo traced as symbols; True when one of them changed since the
        first call (it joins :attr:`dynamic_dims`)."""
        if not self._first_sizes:
            self._first_sizes = {p: tuple(leaves[p].shape) for p in self.symbolic_dims}
            return False
        changed = False
        for path, dims in self.symbolic_dims.items():
            first, now = self._first_sizes[path], leaves[path].shape
            for d in dims:
                if now[d] != first[d] and d not in self.dynamic_dims.get(path, ()):
                    self.dynamic_dims[path] = (*self.dynamic_dims.get(path, ()), d)
                    changed = True
        return changed

    def _rewrite(self, model, leaves: dict, options: BackendOptions):
        """``rocs.compile`` of the graph, its inputs' dynamic dims marked dynamic on the example
        (one program for every length); where that fails, with every such size fixed at this
        call's, one variant per value (:meth:`_key`)."""
        from .. import api

        if self.dynamic_dims:
            marked = {}
            for path, leaf in leaves.items():
                leaf = leaf.detach()
                for d in self.dynamic_dims.get(path, ()):
                    torch._dynamo.mark_dynamic(leaf, d)
                marked[path] = leaf
            try:
                return api.compile(
                    model, self.request_inputs, example_kwargs=nest(marked), options=options
                )
            except CompileError as err:
                warnings.warn(
                    "rocs: the rewrite of a dynamo graph with its dynamic sizes failed; each "
                    "size it sees compiles a program of its own: "
                    + str(err).splitlines()[0],
                    stacklevel=3,
                )
                self.dynamic_dims, self.symbolic_dims = {}, {}
        return api.compile(model, self.request_inputs, example_kwargs=nest(leaves), options=options)

    def _compile(self, args: tuple) -> Optional[_Variant]:
        self.consts = [
            (i, args[i], tensor_version(args[i]))
            for i, s in enumerate(self.slots)
            if s.kind == "const"
        ]
        self._seen = _seen_state(self.consts)
        self._pointers = _pointers_of([value for _, value, _ in self.consts])
        baked = [(i, args[i].detach().clone())
                 for i, s in enumerate(self.slots) if s.kind == "value"]
        self.values = [(i, value, None if value.dim() else value.item()) for i, value in baked]
        # Aliases, not the caller's tensors: export marks its example inputs dynamic, and dynamo's
        # guards on the frame being compiled must not see that.
        leaves = {s.path: args[i].detach() for i, s in enumerate(self.slots) if s.kind == "input"}
        model = graph_model(decompose_fast_paths(self.gm), self.slots, list(args))
        # Lowered with Inductor, the shared program always runs: the runtime's measured choice
        # would time it against a plain program that runs eagerly, not as Inductor compiles it.
        options = replace(self.options, autotune=False) if self.options.inductor else self.options
        try:
            compiled = self._rewrite(model, leaves, options)
        except CompileError as err:
            hint = ""
            if self.static_rows is not None:
                hint = (
                    f" (dynamo traced it with a static batch of {self.static_rows} rows; "
                    "torch.compile(..., dynamic=True) gives rocs a dynamic batch)"
                )
            message = "\n".join(str(err).splitlines()[:4])
            warnings.warn(
                f"rocs: could not rewrite a dynamo graph, it runs without sharing{hint}: {message}",
                stacklevel=2,
            )
            self.fallback_reason = str(err)
            # Dynamo's compile of this frame is over: ``compile_fx`` would trace the graph
            # outside dynamo's context (and fail on a baked scalar's ``.item()``), so the graph
            # is compiled as a frame of its own at its first call instead.
            self.plain = Lowered(self.gm, self.options.inductor, functional=False)
            return None
        unshared = unshared_reason(compiled)
        if unshared is not None:
            self.fallback_reason = unshared
            if not self.options.inductor or (self.retrace is not None and self.retrace(unshared)):
                self.plain = self.gm.forward  # until dynamo traces the frame again (next call)
            else:
                self.plain = Lowered(self.gm, True, functional=False)
            return None
        # Without Inductor the compiled model runs its graph itself (as a direct program).
        runner = compiled
        if self.options.inductor and isinstance(compiled, CompiledModel):  # not column lanes
            runner = compiled.with_graph(Lowered(compiled.graph_module, True))
        paths = list(leaves)
        request_names = set(compiled.contract.request_inputs)
        requests = tuple((p, dotted(p)) for p in paths if dotted(p) in request_names)
        variant = _Variant(compiled, runner, requests, SettledShared.of(runner, paths))
        self.variants[self._key(leaves)] = variant
        return variant


def _takes_shared(variant: _Variant, state: SharedCall, leaves: dict) -> bool:
    """True when every request leaf of the call is the one ``shared_call`` handed to dynamo."""
    replicated = state.replicated
    return bool(variant.requests) and all(
        replicated.get(name) is leaves[path] for path, name in variant.requests
    )


_VERSION = operator.attrgetter("_version")
_DATA_PTR = torch.Tensor.data_ptr


def _seen_state(consts: list) -> Optional[tuple]:
    """``(positions, tensors, versions)`` of the consts; None when one is an inference tensor,
    which has no version counter (``tensor_version`` reads each one instead)."""
    if any(value.is_inference() for _, value, _ in consts):
        return None
    return [i for i, _, _ in consts], [v for _, v, _ in consts], [n for _, _, n in consts]


def _pointers_of(tensors: list) -> Optional[tuple]:
    """``(tensors, their data pointers)``; None when one has no storage to point at (a sparse
    tensor), which leaves identity and version to tell its changes."""
    try:
        return tensors, list(map(_DATA_PTR, tensors))
    except RuntimeError:
        return None


def _static_sizes(shape: torch.Size, dynamic: tuple[int, ...]) -> tuple:
    """The sizes past the batch dim, a dynamic one as None."""
    return tuple(None if d in dynamic else size for d, size in enumerate(shape) if d)


def symbolic_dims_of(gm: fx.GraphModule, slots: list[Slot]) -> dict:
    """Per input path, the dims past the batch whose size dynamo traced as a symbol."""
    found = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, slot in zip(placeholders, slots):
        value = node.meta.get("example_value")
        if slot.kind != "input" or not isinstance(value, torch.Tensor):
            continue
        dims = tuple(
            d for d, size in enumerate(value.shape) if d and isinstance(size, torch.SymInt)
        )
        if dims:
            found[slot.path] = dims
    return found


def _same_value(now: torch.Tensor, baked: torch.Tensor, number: Any) -> bool:
    """Whether a scalar or NumPy array dynamo passed as a tensor still holds the baked value (a
    scalar, the common case, compared as the number read at compile time: a third of
    ``torch.equal``'s cost)."""
    if not baked.dim():
        return not now.dim() and now.dtype == baked.dtype and now.item() == number
    return now.shape == baked.shape and now.dtype == baked.dtype and torch.equal(now, baked)
