"""What each tensor input of a compiled graph was compiled for: dtype, device, non-batch sizes.

The compiled graph is specialized to them (the batch dim is symbolic, and any dim the example
marked dynamic, ``torch._dynamo.mark_dynamic``: a history length), so a call with another dtype,
device or feature width would fail deep inside an op ("mat1 and mat2 must have the same dtype")
or, worse, compute something eager would not. :meth:`InputSpecs.check` refuses such a call before
any compute with an ``InputError`` naming the input, what it got and what the model was compiled
for. Dynamic dims the model ties together (two histories it concatenates: one size symbol in the
graph) must agree in every call; a call where they differ is refused naming both inputs. A size
the model caps (a positional table of 64 rows sliced to the history's length: capture leaves the
length's symbol a range of at most 64) is checked in every call too, and a longer one refused
naming the input, its size and the cap, where the graph would fail deep inside an op or, sliced
another way, truncate silently. A size the model reads at least so much of (a third column of a
packed input: its symbol's range starts at 3) is checked likewise, where the graph would fail
deep inside an op; the default floor of 2 that capture gives a dynamic size is not checked (a
length of 1 runs). A compiled model moved with ``.to(device or dtype)`` expects its
inputs moved the same way (:meth:`InputSpecs.moved`).

A call that differs from the compiled sizes only past the batch dims of batched inputs (a history
length the example did not mark) is refused with a :class:`SizeChange`, which names those dims: the
compiled model may compile itself again with them dynamic (``runtime/modes/new_sizes.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Mapping, Optional

import sympy
import torch
from torch import fx

from ...errors import InputError, SizeChange


@dataclass(frozen=True)
class _Spec:
    dtype: torch.dtype
    device: torch.device
    sizes: tuple  # every dim but the batch dim (batched) or every dim; None where symbolic
    batched: bool
    symbols: tuple = ()  # per dim of ``sizes``, the graph's size symbol where symbolic
    caps: tuple = ()  # per dim of ``sizes``, the largest size the graph allows where it caps one
    floors: tuple = ()  # per dim of ``sizes``, the smallest size past 2 the graph asks for


class InputSpecs:
    def __init__(self, specs: Mapping[str, _Spec]):
        self._specs = dict(specs)
        # What a call that fits exactly compares: (name, dtype, device, sizes, batched).
        self._exact = [(n, s.dtype, s.device, s.sizes, s.batched) for n, s in self._specs.items()]
        self._ties = {s: dims for s, dims in _symbol_dims(self._specs).items() if len(dims) > 1}
        self._caps = _capped_dims(self._specs)
        self._floors = _floored_dims(self._specs)

    @property
    def caps(self) -> list[tuple[str, int, str, int]]:
        """``[(input, dim, size symbol, cap), ...]``: each dynamic size the graph caps."""
        return list(self._caps)

    @classmethod
    def of_graph(
        cls, gm: object, placeholder_of: Mapping[str, str], batched: Mapping[str, bool]
    ) -> Optional["InputSpecs"]:
        """The specs of ``gm``'s placeholders; None when ``gm`` is no FX graph module."""
        if not isinstance(gm, fx.GraphModule):
            return None
        vals = {n.name: n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"}
        specs = {}
        for name, placeholder in placeholder_of.items():
            val = vals.get(placeholder)
            if not isinstance(val, torch.Tensor):
                continue
            is_batched = bool(batched.get(name, False)) and val.dim() > 0
            dims = val.shape[1:] if is_batched else val.shape
            sizes = tuple(s if isinstance(s, int) else None for s in dims)
            symbols = tuple(None if isinstance(s, int) else str(s) for s in dims)
            caps = tuple(_cap(s) for s in dims)
            floors = tuple(_floor(s) for s in dims)
            specs[name] = _Spec(val.dtype, val.device, sizes, is_batched, symbols, caps, floors)
        return cls(specs)

    def size_dims(self) -> list[tuple[str, int]]:
        """``(input, dim)`` per symbolic size past the batch dim (a history length): the first
        dim that carries it, ``dim`` counted with the batch dim."""
        return [dims[0] for dims in _symbol_dims(self._specs).values()]

    def empty_tensors(self) -> list[torch.Tensor]:
        """An empty tensor of each input's dtype and device (what a move is probed with)."""
        return [torch.empty(0, dtype=s.dtype, device=s.device) for s in self._specs.values()]

    def moved(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "InputSpecs":
        """The specs after ``module._apply(fn)``: floating inputs follow a dtype change as the
        weights do, every input follows a device change."""
        specs = {}
        for name, spec in self._specs.items():
            probe = fn(torch.empty(0, dtype=spec.dtype, device=spec.device))
            specs[name] = replace(spec, dtype=probe.dtype, device=probe.device)
        return InputSpecs(specs)

    def check(self, leaves: Mapping[str, object]) -> None:
        """Raise ``InputError`` for the first tensor input that does not fit its spec."""
        for name, dtype, device, sizes, batched in self._exact:
            value = leaves.get(name)
            if isinstance(value, torch.Tensor) and (
                value.dtype != dtype
                or value.device != device
                or (value.shape[1:] if batched and value.dim() else value.shape) != sizes
            ):
                self._check_one(name, self._specs[name], value, leaves)  # symbolic, or an error
        if self._ties:
            self._check_ties(leaves)
        if self._caps or self._floors:
            self.check_caps(leaves)

    def check_caps(self, leaves: Mapping[str, object]) -> None:
        """Refuse a call with a dynamic size past the largest the compiled graph allows, or
        short of the smallest it asks for."""
        for name, dim, symbol, floor in self._floors:
            value = leaves.get(name)
            if isinstance(value, torch.Tensor) and value.dim() > dim and value.shape[dim] < floor:
                raise InputError(
                    f"input {name!r} has size {value.shape[dim]} at dim {dim}, but the compiled "
                    f"model takes at least {floor} there (the model reads that much of it: "
                    f"{symbol} >= {floor} in its graph)"
                )
        refuse_past_caps(self._caps, leaves)

    def _check_ties(self, leaves: Mapping[str, object]) -> None:
        """Refuse a call whose inputs disagree on a dynamic size the graph ties together."""
        for symbol, places in self._ties.items():
            seen = [
                (name, dim, value.shape[dim])
                for name, dim in places
                if isinstance(value := leaves.get(name), torch.Tensor) and value.dim() > dim
            ]
            if any(size != seen[0][2] for _, _, size in seen):
                detail = ", ".join(f"{name!r} dim {dim}: {size}" for name, dim, size in seen)
                raise InputError(
                    f"inputs disagree on a size the model ties together ({detail}); the compiled "
                    f"graph computes them as one size ({symbol}): give them the same size"
                )

    def _check_one(self, name: str, spec: _Spec, value: torch.Tensor, leaves: Mapping) -> None:
        if value.dtype != spec.dtype:
            raise InputError(
                f"input {name!r} has dtype {value.dtype}, but the model was compiled for "
                f"{spec.dtype}: convert the input, or compile the model again for {value.dtype}"
            )
        if value.device != spec.device:
            raise InputError(
                f"input {name!r} is on {value.device}, but the compiled model is on "
                f"{spec.device}: move the input, or the compiled model with .to()"
            )
        dims = value.shape[1:] if spec.batched else value.shape
        if dims != spec.sizes and (spec.batched and value.dim() == 0 or not _fits(dims, spec.sizes)):
            expected = ", ".join("?" if s is None else str(s) for s in spec.sizes)
            expected = f"(rows, {expected})" if spec.batched else f"({expected})"
            message = (
                f"input {name!r} has shape {tuple(value.shape)}, but the model was compiled "
                f"for {expected}"
            )
            places = self._changed_sizes(leaves)
            if places:
                raise SizeChange(message, places)
            raise InputError(
                f"{message}; only the number of rows may change between calls (and the dims "
                "past the batch dim of batched inputs, which the model does not fix)"
            )

    def _changed_sizes(self, leaves: Mapping[str, object]) -> tuple[tuple[str, int], ...]:
        """Every ``(input, dim)`` of the call whose size differs from a compiled constant size,
        when all of them lie past the batch dim of batched inputs that otherwise fit their specs
        (dtype, device, number of dims); () when any does not."""
        places = []
        for name, spec in self._specs.items():
            value = leaves.get(name)
            if not isinstance(value, torch.Tensor):
                continue
            if value.dtype != spec.dtype or value.device != spec.device:
                return ()
            dims = value.shape[1:] if spec.batched and value.dim() else value.shape
            if len(dims) != len(spec.sizes) or (spec.batched and value.dim() == 0):
                return ()
            changed = [i for i, (d, s) in enumerate(zip(dims, spec.sizes)) if s not in (None, d)]
            if changed and not spec.batched:
                return ()
            places.extend((name, i + 1) for i in changed)
        return tuple(places)


def refuse_past_caps(caps, leaves: Mapping[str, object]) -> None:
    """Refuse a call with a dynamic size past its cap; ``caps``: ``(input, dim, size symbol,
    cap)`` (``InputSpecs.caps``; an exported program's jagged plan carries them too)."""
    for name, dim, symbol, cap in caps:
        value = leaves.get(name)
        if isinstance(value, torch.Tensor) and value.dim() > dim and value.shape[dim] > cap:
            raise InputError(
                f"input {name!r} has size {value.shape[dim]} at dim {dim}, but the compiled "
                f"model takes at most {cap} there: the model caps that size ({symbol} <= "
                f"{cap} in its graph: it slices a table of fixed rows to it, a positional "
                f"table say); give it at most {cap}, or grow the table and compile again"
            )


def _symbol_dims(specs: Mapping[str, _Spec]) -> dict[str, list[tuple[str, int]]]:
    """``{size symbol: [(input, dim), ...]}`` for each symbolic size (the batch dim of batched
    inputs is the runtime's: R and N are checked elsewhere)."""
    places: dict[str, list[tuple[str, int]]] = {}
    for name, spec in specs.items():
        offset = 1 if spec.batched else 0
        for i, symbol in enumerate(spec.symbols):
            if symbol is not None:
                places.setdefault(symbol, []).append((name, i + offset))
    return places


def _capped_dims(specs: Mapping[str, _Spec]) -> list[tuple[str, int, str, int]]:
    """``[(input, dim, size symbol, cap), ...]`` for each dynamic dim whose symbol the graph
    bounds from above (``dim`` counted with the batch dim)."""
    return _bounded_dims(specs, lambda spec: spec.caps)


def _floored_dims(specs: Mapping[str, _Spec]) -> list[tuple[str, int, str, int]]:
    """``[(input, dim, size symbol, floor), ...]`` for each dynamic dim whose symbol the graph
    bounds from below past 2."""
    return _bounded_dims(specs, lambda spec: spec.floors)


def _bounded_dims(specs: Mapping[str, _Spec], bounds_of) -> list[tuple[str, int, str, int]]:
    bounded = []
    for name, spec in specs.items():
        offset = 1 if spec.batched else 0
        for i, (symbol, bound) in enumerate(zip(spec.symbols, bounds_of(spec))):
            if bound is not None:
                bounded.append((name, i + offset, symbol, bound))
    return bounded


def _cap(size: object) -> Optional[int]:
    """The largest value the captured graph allows a symbolic ``size``: the upper end of its
    range in the graph's shape environment, where capture refined it (export turns a guard such
    as ``s <= 64``, from slicing a 64-row table to ``s`` rows, into the symbol's range); None for
    a constant size or an unbounded one."""
    upper = _range(size, "upper")
    return int(upper) if isinstance(upper, sympy.Integer) else None  # not int_oo: no cap


def _floor(size: object) -> Optional[int]:
    """The smallest value the captured graph allows a symbolic ``size`` where it is above 2,
    the floor capture gives every dynamic size; None otherwise."""
    lower = _range(size, "lower")
    return int(lower) if isinstance(lower, sympy.Integer) and lower > 2 else None


def _range(size: object, end: str) -> object:
    """One end of a symbolic ``size``'s range in its shape environment; None for a constant."""
    if not isinstance(size, torch.SymInt):
        return None
    shape_env = getattr(size.node, "shape_env", None)
    if shape_env is None:
        return None
    return getattr(shape_env.bound_sympy(size.node.expr), end)


def _fits(dims: tuple, sizes: tuple) -> bool:
    return len(dims) == len(sizes) and all(s is None or d == s for d, s in zip(dims, sizes))


def row_count_error(rows: Mapping[str, Optional[int]], request_inputs: frozenset) -> InputError:
    """The error for a call without ``candidate_to_request`` whose batched inputs ``rows``
    (name -> row count, None without a dim) disagree. Request inputs agreeing on R rows and
    candidate inputs on N > R rows are a shared-layout call without its index; anything else is
    an input taken as batched that is not (its rows equalled the example's batch size)."""
    detail = ", ".join(f"{n}: {r}" for n, r in rows.items())
    request = {r for n, r in rows.items() if n in request_inputs}
    candidate = {r for n, r in rows.items() if n not in request_inputs}
    if len(request) == len(candidate) == 1 and None not in request | candidate:
        (num_requests,), (num_candidates,) = request, candidate
        if 0 < num_requests < num_candidates:
            return InputError(
                f"request inputs have {num_requests} rows and candidate inputs "
                f"{num_candidates} ({detail}): a shared-layout call, whose candidate_to_request "
                f"is missing: pass cm(..., candidate_to_request=idx), idx an int64 "
                f"[{num_candidates}] tensor holding each candidate's request in "
                f"[0, {num_requests}); or give every input {num_candidates} rows (drop-in)"
            )
    return InputError(
        f"batched inputs disagree on the number of rows ({detail}); an input without a "
        "batch dim whose rows equalled the example's batch size is taken as batched: "
        "name it in rocs.compile(..., unbatched_inputs=[...])"
    )
