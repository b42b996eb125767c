"""A call at a history length the example did not have: the model compiled again, that length
dynamic, and adopted by the compiled model for every later call.

``rocs.compile`` specializes every size past the batch dim to the example's, except the dims the
example marked dynamic (``torch._dynamo.mark_dynamic``). The first call whose inputs differ from
those sizes only past the batch dim of batched inputs (a history length, say) compiles the
original again, once, on the compile's own example and options with each such dim marked, as if
the user had marked them, and the compiled model adopts that program: every later call, at any
length, runs it without compiling again (what ``torch.compile``'s automatic dynamic shapes do
after a recompile). A dim the model fixes (a ``Linear``'s input width, a positional table added
whole) fails that compile, capture having specialized it; the call is refused with an
``InputError`` naming the input, the dim and the compile's reason, and later calls that change
the same dims are refused at once, without compiling again (a call changing one of two lengths
the model ties together fails, and one changing both may still grow).

Identity: a program compiled with a size dynamic computes, at every size capture admits, what the
original computes there (the symbolic trace is the same program; a size the graph caps is checked
per call, ``runtime/call/input_checks.py``), and at the example's sizes what the static program
computed.

Adoption replaces the compiled model's programs, specs and choices by the new compile's, keeping
what is the compiled model's own: its module state (the original's parameters), its DDP watch, its
request cache (cleared: its split was of the old graph). The input specs go last, so a concurrent
call at the new size is admitted only once the programs that serve it are in place.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

import torch

from ...errors import CompileError, InputError, SizeChange
from ..follow.moves import MODULE_STATE

# What a grown program does not replace: nn.Module's own state (shared with the original), the
# watch of a DDP wrapping this compiled model, its request cache, and the input specs (last).
_KEPT = frozenset({"_ddp", "_cache", "_input_specs"})


class SizeGrowth:
    """Compiles ``cm``'s original again with more dims dynamic, through ``compile_marked``
    (``{input: dims}`` -> a compiled model; the door's closure: the runtime calls no door)."""

    def __init__(self, compile_marked: Callable[[Mapping[str, tuple[int, ...]]], object]):
        self._compile_marked = compile_marked
        # The dims changed by calls that failed to compile, ((input, dim), ...) -> why.
        self._fixed: dict[tuple[tuple[str, int], ...], str] = {}
        self._lock = threading.Lock()

    def grow(self, cm, change: SizeChange) -> None:
        """Make ``cm`` run a program dynamic in ``change.places``, or raise ``InputError`` saying
        which of them the model fixes."""
        self._refuse_fixed(change)
        with self._lock:
            if cm._growth is not self:  # another call grew it meanwhile
                return
            self._refuse_fixed(change)
            dims: dict[str, tuple[int, ...]] = {}
            for name, dim in change.places:
                dims[name] = (*dims.get(name, ()), dim)
            try:
                grown = self._compile_marked(dims)
            except CompileError as err:
                self._fixed[change.places] = str(err)
                raise InputError(_refusal(change, str(err))) from err
            if grown._growth is not None:
                grown._growth._fixed.update(self._fixed)
            adopt(cm, grown)

    def _refuse_fixed(self, change: SizeChange) -> None:
        if change.places in self._fixed:
            raise InputError(_refusal(change, self._fixed[change.places])) from None


def _refusal(change: SizeChange, reason: str) -> str:
    dims = ", ".join(f"dim {dim} of {name!r}" for name, dim in change.places)
    return (
        f"{change}, and the model fixes that size: compiling it with {dims} dynamic failed "
        f"({reason}); only the number of rows and the sizes the model does not fix may change "
        "between calls"
    )


def adopt(cm, grown) -> None:
    """``cm`` runs ``grown``'s programs from now on (both compiled from the same original)."""
    for name, value in vars(grown).items():
        if name not in MODULE_STATE and name not in _KEPT:
            object.__setattr__(cm, name, value)
    if cm._cache is not None:
        object.__setattr__(cm, "_cache", cm._cache.over(cm.graph_module))
    object.__setattr__(cm, "_input_specs", grown._input_specs)


def make_dynamic(cm, dynamic: Mapping[str, object]) -> None:
    """``cm`` compiled again with the dims ``dynamic`` names (``{input: dim or dims}``) dynamic,
    as a call that changed them would (:meth:`SizeGrowth.grow`), unless they already are; an
    unknown input, the batch dim, or a model compiled without growth (moved to another dtype) is
    refused naming it."""
    places = []
    shapes = _compiled_shapes(cm)
    for name, dims in dynamic.items():
        if name not in shapes:
            raise InputError(
                f"dynamic names {name!r}, which is not an input of the compiled model (its "
                f"inputs: {', '.join(shapes)})"
            )
        for dim in (dims,) if isinstance(dims, int) else tuple(dims):
            shape = shapes[name]
            if not isinstance(dim, int) or not 1 <= dim < len(shape):
                raise InputError(
                    f"dynamic[{name!r}] = {dim!r}: a dim past the rows of the input's "
                    f"{len(shape)} dims (the rows, dim 0, are dynamic already)"
                )
            if isinstance(shape[dim], int):  # specialized: a size of the example
                places.append((name, dim))
    if not places:
        return
    change = SizeChange(
        ", ".join(f"dim {dim} of {name!r} asked dynamic" for name, dim in places), tuple(places)
    )
    if cm._growth is None:
        raise InputError(
            f"{change}, but this compiled model compiles no other sizes (a compiled model moved "
            "to another dtype takes the sizes it had then): mark the size dynamic, "
            "torch._dynamo.mark_dynamic(example[name], dim), before rocs.compile"
        )
    cm._growth.grow(cm, change)


def _compiled_shapes(cm) -> dict[str, tuple]:
    """Each input's shape in the compiled program (a dynamic dim as its symbolic size)."""
    placeholders = {n.name: n for n in cm.graph_module.graph.nodes if n.op == "placeholder"}
    shapes = {}
    for name in cm.contract.input_names:
        val = placeholders[cm.placeholder_of[name]].meta.get("val")
        if isinstance(val, torch.Tensor):
            shapes[name] = tuple(val.shape)
    return shapes
