"""Request features that are column ranges of one input: ``"X[:, 0:12]"``.

Libraries such as DeepCTR-Torch pack every feature of a row into one float tensor ``X`` and
slice it inside ``forward`` (``X[:, start:end]``, from ``model.feature_index``); the request side
is a set of column ranges. A request name of the form ``"<argument>[:, a:b]"`` names such a
range (several may name ranges of one argument); a packed tensor inside a dict or dataclass
argument is named by its leaf name, ``"X.deeptabular[:, 0:4]"``.

Identity: ``X == cat([X[:, p0], X[:, p1], ...], dim=1)`` for the pieces ``p0, p1, ...`` that
cover its columns in order. The model is compiled as a wrapper that takes ``X`` as a dict of
its pieces (``X.0:12`` request-side, ``X.12:30`` candidate-side) and concatenates them before
calling the model; the model's own slices of that concatenation become slices of the pieces
(normalization's ``slice_of_cat``), so a request feature's work runs once per request. The
compiled model is called with ``X`` whole: :class:`ColumnFormat` splits it into views.
"""

from __future__ import annotations

import functools
import inspect
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from ..errors import CompileError, InputError
from .base import DROPIN, REPLICATED, SHARED, InputFormat, Prepared, ProgramCall
from .leaves import (
    bind_inputs,
    given_by_name,
    leaf_at,
    parameter_order,
    rebuild_call,
    with_leaf,
)
from .packed_plain import packed_plain_graph

_COLUMNS = re.compile(
    r"^(?P<leaf>[A-Za-z_]\w*(?:\.\w+)*)\[\s*:\s*,\s*(?P<start>\d+)\s*:\s*(?P<stop>\d+)\s*\]$"
)


@dataclass(frozen=True)
class ColumnSplit:
    """An argument whose columns ``request`` (sorted, disjoint ``(start, stop)`` ranges) are
    request-side."""

    argument: str
    width: int
    request: tuple[tuple[int, int], ...]

    @functools.cached_property  # read on every call of the compiled model
    def piece_slices(self) -> tuple[tuple[str, slice], ...]:
        return tuple((key, slice(start, stop)) for key, start, stop, _ in self.pieces())

    def pieces(self) -> list[tuple[str, int, int, bool]]:
        """``(key, start, stop, request-side)`` for ranges covering every column in order."""
        out, at = [], 0
        for start, stop in self.request:
            if at < start:
                out.append((f"{at}:{start}", at, start, False))
            out.append((f"{start}:{stop}", start, stop, True))
            at = stop
        if at < self.width:
            out.append((f"{at}:{self.width}", at, self.width, False))
        return out

    def request_names(self) -> list[str]:
        return [f"{self.argument}.{key}" for key, _, _, req in self.pieces() if req]

    def split(self, value: Any) -> dict[str, torch.Tensor]:
        if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[1] != self.width:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise InputError(
                f"input {self.argument!r} must be a tensor with {self.width} columns (dim 1), "
                f"as at compile time; got {shape}"
            )
        return {key: value[:, columns] for key, columns in self.piece_slices}


def parse(request_inputs: Sequence[str]) -> tuple[dict[str, list[tuple[int, int]]], list[str]]:
    """(column ranges by argument, the other request names)."""
    ranges: dict[str, list[tuple[int, int]]] = {}
    plain = []
    for name in request_inputs:
        match = _COLUMNS.match(name.strip())
        if match is None:
            if "[" in name:
                raise InputError(
                    f"cannot read the request input {name!r}: a column range is written "
                    "'<argument>[:, start:stop]', e.g. 'X[:, 0:12]'; a key of a "
                    "KeyedJaggedTensor argument '<argument>[<key>]'"
                )
            plain.append(name)
            continue
        start, stop = int(match["start"]), int(match["stop"])
        if stop <= start:
            raise InputError(f"request input {name!r}: the column range is empty")
        ranges.setdefault(match["leaf"], []).append((start, stop))
    return ranges, plain


def splits_for(
    signature: inspect.Signature, bound: Mapping[str, Any], ranges: Mapping[str, list]
) -> list[ColumnSplit]:
    """Check the ranges against the example and describe each split argument."""
    out = []
    for argument, spans in ranges.items():
        try:
            value = leaf_at(bound, argument)
        except (KeyError, IndexError, AttributeError):
            raise InputError(
                f"unknown input name {argument!r} in a column range; the model's forward takes: "
                + ", ".join(p for p in signature.parameters)
                + " (name a tensor inside a dict or dataclass argument as 'arg.key[:, a:b]')"
            ) from None
        if not isinstance(value, torch.Tensor) or value.dim() != 2:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise InputError(
                f"column ranges need a 2-D tensor [rows, columns]; {argument!r} is {shape}"
            )
        spans = sorted(spans)
        width = value.shape[1]
        for (a, b), (c, _) in zip(spans, spans[1:]):
            if c < b:
                raise InputError(f"column ranges of {argument!r} overlap: {a}:{b} and {c}:...")
        if spans[-1][1] > width:
            raise InputError(
                f"column range {spans[-1][0]}:{spans[-1][1]} of {argument!r} is past its "
                f"{width} columns"
            )
        out.append(ColumnSplit(argument, width, tuple(_merge(spans))))
    return out


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, stop in spans:
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], stop)
        else:
            merged.append((start, stop))
    return merged


class PiecesModel(nn.Module):
    """``model`` taking each split argument as its pieces, put back together by the
    subclass's ``assemble(split, pieces)`` before the model runs (column ranges here, KJT keys
    in ``kjt.py``)."""

    assemble: Callable[[Any, Any], Any]

    def __init__(self, model: nn.Module, splits: list):
        super().__init__()
        self.model = model
        self.splits = splits

    def forward(self, *args, **kwargs):
        signature = inspect.signature(self.model.forward)
        bound = bind_inputs(signature, args, kwargs)
        for split in self.splits:
            pieces = leaf_at(bound, split.argument)
            bound = with_leaf(bound, split.argument, self.assemble(split, pieces))
        args, kwargs = rebuild_call(signature, bound)
        return self.model(*args, **kwargs)


class _Pieces(PiecesModel):
    """``model`` taking each split argument as a dict of column pieces (concatenated back)."""

    def assemble(self, split: ColumnSplit, pieces: dict) -> torch.Tensor:
        return torch.cat([pieces[key] for key, *_ in split.pieces()], dim=1)


def pieces_model(model: nn.Module, splits: list[ColumnSplit]) -> nn.Module:
    """A :class:`_Pieces` whose ``forward`` has ``model.forward``'s signature."""
    return with_signature(_Pieces, model, "Columns", splits)


def with_signature(base: type, model: nn.Module, suffix: str, *args) -> nn.Module:
    """``base(model, *args)`` (a wrapper module whose ``forward(*args, **kwargs)`` calls
    ``model``), given ``model.forward``'s signature: capture binds the example by it."""
    signature = inspect.signature(model.forward)
    cls = type(f"{type(model).__name__}{suffix}", (base,), {})

    def forward(self, *args, **kwargs):
        return base.forward(self, *args, **kwargs)

    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    parameters = [self_param, *signature.parameters.values()]
    forward.__signature__ = signature.replace(parameters=parameters)
    cls.forward = forward
    wrapper = cls(model, *args)
    wrapper.training = model.training  # the model's own mode, checked by capture
    return wrapper


def to_pieces(
    signature: inspect.Signature, splits: list[ColumnSplit], args: tuple, kwargs: Mapping[str, Any]
) -> tuple[tuple, dict, dict]:
    """The call with every split argument replaced by its dict of column views, and the split
    arguments as given, by leaf name."""
    whole = {}
    if not args and all(s.argument in kwargs for s in splits):
        # The common keyword call of top-level packed arguments: no binding needed.
        kwargs = dict(kwargs)
        for split in splits:
            whole[split.argument] = value = kwargs[split.argument]
            kwargs[split.argument] = split.split(value)
        return (), kwargs, whole
    bound = bind_inputs(signature, args, dict(kwargs))
    for split in splits:
        whole[split.argument] = value = leaf_at(bound, split.argument)
        bound = with_leaf(bound, split.argument, split.split(value))
    return (*rebuild_call(signature, bound), whole)


class ColumnFormat(InputFormat):
    """Column ranges of packed arguments: the program takes each split argument as a dict of
    its column views (``X.0:12`` request-side, ``X.12:30`` candidate-side).

    Layouts: drop-in as usual; with ``candidate_to_request`` a split argument has one row per
    candidate (its candidate columns need them), so its request columns are replicated leaves
    of a shared-layout call (checked constant within each request, read once per request),
    while the other request inputs have one row per request."""

    converts = True
    name = "column ranges"

    def __init__(self, signature: inspect.Signature, splits: list[ColumnSplit], request_names):
        super().__init__(signature, request_names)
        self.splits = splits
        self._replicated = frozenset(
            name for split in splits for name in split.request_names()
        )
        self._order = parameter_order(signature)
        self._parameters = None if self._order is None else frozenset(self._order)

    def program_call(self, args, kwargs, index, replicated):
        args, kwargs, whole = to_pieces(self.signature, self.splits, args, kwargs)
        if index is None:
            return ProgramCall(args, kwargs, None, DROPIN, given=whole)
        if replicated:
            return ProgramCall(args, kwargs, index, REPLICATED, given=whole)
        return ProgramCall(args, kwargs, index, SHARED, self._replicated, whole)

    def called_leaves(self, args, kwargs):
        """The call's arguments by parameter name, when every one is given once and is a tensor
        (the packed ones whole): what the plain graph takes, unless it takes nested leaves."""
        if not args and kwargs.keys() == self._parameters:  # every parameter by keyword
            named = kwargs
        else:
            named = given_by_name(self._order, args, kwargs)
            if named is None:
                return None
        for value in named.values():
            if not isinstance(value, torch.Tensor):
                return None
        return named

    def plain_graph(self, gm, input_names):
        """The plain graph over the packed arguments as called (``packed_plain.py``)."""
        return packed_plain_graph(gm, input_names, self.splits)


def prepare_columns(
    model: nn.Module, ranges: Mapping[str, list], plain: list[str], example_args, example_kwargs
) -> Prepared:
    """The pieces model, its request leaves and example call for request column ranges."""
    signature = inspect.signature(model.forward)
    bound = bind_inputs(signature, tuple(example_args), dict(example_kwargs))
    splits = splits_for(signature, bound, ranges)
    names = plain + [name for split in splits for name in split.request_names()]
    _refuse_writes(model, signature, splits, bound)
    args, kwargs, _ = to_pieces(signature, splits, tuple(example_args), dict(example_kwargs))
    return Prepared(
        pieces_model(model, splits), names, args, kwargs, ColumnFormat(signature, splits, plain)
    )


def _refuse_writes(model, signature, splits: list[ColumnSplit], bound: Mapping[str, Any]) -> None:
    """A forward that writes into a packed argument would write into the concatenation of its
    pieces, never into the caller's tensor: refuse it, as capture refuses any input mutation.
    The example runs once on copies; a write moves a copy's version counter."""
    copies = dict(bound)
    for split in splits:
        copies = with_leaf(copies, split.argument, leaf_at(bound, split.argument).clone())
    versions = {split.argument: leaf_at(copies, split.argument)._version for split in splits}
    args, kwargs = rebuild_call(signature, copies)
    with torch.no_grad():
        model(*args, **kwargs)
    for split in splits:
        if leaf_at(copies, split.argument)._version != versions[split.argument]:
            raise CompileError(
                f"the model's forward writes into its input {split.argument!r} in place; rocs "
                "needs a forward that leaves its inputs as they are (write into a copy)"
            )

