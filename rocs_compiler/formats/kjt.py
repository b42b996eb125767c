"""Request features that are keys of a TorchRec ``KeyedJaggedTensor``: ``"sparse_features[user_id]"``.

TorchRec models take ``forward(dense_features, sparse_features: KeyedJaggedTensor)``; the
request side is some keys of the KJT (a user id, a behaviour history). A request name
``"<argument>[<key>]"`` names one key; the argument's name alone names all its keys.

A KJT keeps every row of a key in one flat ``values`` tensor, which no row-wise analysis can
split by request. The model is compiled as a wrapper (as for column ranges,
``columns.py``) whose input is the KJT in pieces, every key as per-row tensors:
``sparse_features.user_id.ids`` ``[B, W]`` (row i holds ``values`` of row i, then zeros up to
``W``, the longest row of the call: a dynamic dim), ``sparse_features.user_id.lengths`` ``[B]``,
and ``.weights`` ``[B, W]`` for a weighted KJT. The wrapper hands the model a
:class:`~.kjt_padded.PaddedKJT`, which its ``EmbeddingBagCollection`` modules pool and its
``EmbeddingCollection`` modules look up (``kjt_pooling.py`` and ``kjt_sequences.py`` state those
identities). A request key's pieces are request inputs, so its
lookups, and everything computed only from them, run once per request.

Identity: a key's jagged row i is ``ids[i, :lengths[i]]`` (with ``weights[i, :lengths[i]]``),
and the padding is a function of the row alone, so two equal jagged rows give equal padded rows:
drop-in calls find requests among consecutive equal rows exactly as for dense inputs.

Call layouts, named by the call (:class:`KJTFormat`):

* drop-in, ``cm(dense, kjt)``: every key has one row per candidate;
* shared, ``cm(dense, kjt, candidate_to_request=idx)`` with a KJT whose request keys have R rows
  and candidate keys N (TorchRec's variable batch per feature, ``stride_per_key_per_rank``);
  (or no ``candidate_to_request`` when the KJT carries TorchRec's ``inverse_indices``, which say
  the same);
* the same call with a KJT of N rows in every key: replicated rows with the grouping known; the
  request keys' rows are checked to agree within each request.
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import CompileError, InputError
from .base import (
    DROPIN, REPLICATED, SHARED, InputFormat, OriginalProgram, Prepared, ProgramCall,
)
from .columns import PiecesModel, with_signature
from .kjt_lookups import with_padded_lookups
from .kjt_lengths import check_lengths
from .kjt_padded import PaddedKey, PaddedKJT
from .kjt_rows import replicated_kjt
from .leaves import (
    bind_inputs,
    bind_quickly,
    covers,
    named_leaves,
    parameter_order,
    rebuild_call,
)

_KEY = re.compile(r"^(?P<argument>[A-Za-z_]\w*)\[(?P<key>.+)\]$")

# The padded width of a compile's example: sizes 0 and 1 are specialized by export.
_EXAMPLE_WIDTH = 2


def is_kjt(value: Any) -> bool:
    """True for a ``KeyedJaggedTensor`` (torchrec is not imported: no KJT exists without it)."""
    module = sys.modules.get("torchrec.sparse.jagged_tensor")
    return module is not None and isinstance(value, module.KeyedJaggedTensor)


def parse(
    request_inputs: Sequence[str], arguments: Sequence[str]
) -> tuple[dict[str, list[str]], list[str]]:
    """(keys by KJT argument, the other request names): ``"<argument>[<key>]"`` names a key
    when ``argument`` is one of ``arguments``, the KJT arguments; a key may be quoted,
    ``sparse['user_id']``. Anything else (``X[:, 0:4]``, a column range) stays with the others."""
    keys: dict[str, list[str]] = {}
    rest = []
    for name in request_inputs:
        match = _KEY.match(name.strip())
        if match is None or match["argument"] not in arguments:
            rest.append(name)
            continue
        key = match["key"].strip()
        if len(key) >= 2 and key[0] == key[-1] and key[0] in "'\"":
            key = key[1:-1]
        keys.setdefault(match["argument"], []).append(key)
    return keys, rest


def takes_kjt(model: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """True when the call ``model(*args, **kwargs)`` passes a ``KeyedJaggedTensor``."""
    if "torchrec.sparse.jagged_tensor" not in sys.modules:
        return False
    return any(map(_holds_kjt, (*args, *kwargs.values())))


def _holds_kjt(value: Any) -> bool:
    if is_kjt(value):
        return True
    if isinstance(value, Mapping):
        return any(_holds_kjt(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_kjt(v) for v in value)
    return False


@dataclass(frozen=True)
class KJTSplit:
    """A KJT argument: its keys (the example's order), which are request-side, and whether it
    carries per-id weights."""

    argument: str
    keys: tuple[str, ...]
    request: frozenset[str]
    weighted: bool
    # Keys the model reads at the batch's longest row (``kjt_sequences.py``), found by tracing.
    read_whole: set[str] = field(default_factory=set, compare=False, hash=False)

    def request_names(self) -> list[str]:
        """The pieces' names for the inner compile: one per request key (covering its tensors)."""
        return [f"{self.argument}.{k}" for k in self.keys if k in self.request]

    def check(self, value: Any) -> None:
        if not is_kjt(value):
            raise InputError(
                f"input {self.argument!r} must be a KeyedJaggedTensor, as at compile time; got "
                f"{type(value).__name__}"
            )
        if set(value.keys()) != set(self.keys):
            raise InputError(
                f"KeyedJaggedTensor {self.argument!r} has keys {list(value.keys())}, but the "
                f"model was compiled for {list(self.keys)}"
            )
        if (value.weights_or_none() is not None) != self.weighted:
            state = "has" if self.weighted else "has no"
            raise InputError(
                f"KeyedJaggedTensor {self.argument!r}: the compile's example {state} weights; "
                "a call must agree"
            )

    def rows(self, kjt) -> dict[str, int]:
        """Each key's number of rows (its batch size; TorchRec's stride per key)."""
        return dict(zip(kjt.keys(), kjt.stride_per_key()))

    def request_rows(self, kjt) -> int | None:
        """The most rows of a request key (R in the shared layout; 0 without request keys), or
        None when ``kjt`` lacks one of them."""
        if kjt.keys() == self._key_list:  # keys in the example's order: read by position
            strides = kjt.stride_per_key()
            return max(map(strides.__getitem__, self._request_positions), default=0)
        rows = self.rows(kjt)
        if not self.request <= rows.keys():
            return None
        return max((rows[k] for k in self.request), default=0)

    @functools.cached_property
    def _key_list(self) -> list[str]:
        return list(self.keys)

    @functools.cached_property
    def _request_positions(self) -> tuple[int, ...]:
        return tuple(i for i, key in enumerate(self.keys) if key in self.request)

    def pieces(self, kjt, min_width: int = 1) -> dict[str, dict[str, torch.Tensor]]:
        """``{key: {"ids", "lengths"[, "weights"]}}``, the rows of each key padded to its
        longest row (at least ``min_width``)."""
        check_lengths(self.argument, kjt)
        lengths = kjt.lengths().split(kjt.stride_per_key())
        sizes = kjt.length_per_key()
        values = kjt.values().split(sizes)
        weights = kjt.weights_or_none()
        weights = weights.split(sizes) if weights is not None else [None] * len(sizes)
        out = {}
        for key, key_lengths, key_values, key_weights in zip(kjt.keys(), lengths, values, weights):
            longest = int(key_lengths.max()) if key_lengths.numel() else 0
            if not longest and key in self.read_whole:
                raise InputError(
                    f"KeyedJaggedTensor {self.argument!r}: every row of key {key!r} is empty, and "
                    "the model reads it with to_padded_dense() at the batch's longest row, which "
                    "TorchRec gives no columns; the compiled model needs one id in some row (or "
                    "a desired_length)"
                )
            width = max(longest, min_width)
            piece = {
                "ids": _padded(key_values, key_lengths, width),
                "lengths": key_lengths,
            }
            if key_weights is not None:
                piece["weights"] = _padded(key_weights, key_lengths, width)
            out[key] = piece
        return {key: out[key] for key in self.keys}


def _padded(values: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
    """``[rows, width]``: row i holds ``values`` of row i (``lengths[i]`` of them), then zeros."""
    rows, total = lengths.shape[0], values.shape[0]
    out = values.new_zeros((rows, width))
    if total:
        lengths = lengths.long()
        row = torch.repeat_interleave(
            torch.arange(rows, device=lengths.device), lengths, output_size=total
        )
        starts = torch.cumsum(lengths, 0) - lengths
        column = torch.arange(total, device=lengths.device) - starts.index_select(0, row)
        out[row, column] = values
    return out


def splits_for(bound: Mapping[str, Any], request_inputs: Sequence[str]):
    """Describe every KJT argument of the example; a request name that is a KJT argument takes
    all its keys. Returns (splits, the other request names)."""
    kjts = {name: value for name, value in bound.items() if is_kjt(value)}
    nested = [n for n, v in bound.items() if n not in kjts and _holds_kjt(v)]
    if nested:
        raise InputError(
            f"a KeyedJaggedTensor inside the argument {nested[0]!r} is not supported; rocs takes "
            "KeyedJaggedTensor inputs that are arguments of forward"
        )
    keys, rest = parse(request_inputs, list(kjts))
    whole = [n for n in rest if n in kjts]
    splits = []
    for argument, kjt in kjts.items():
        if kjt.variable_stride_per_key():
            raise InputError(
                f"the example KeyedJaggedTensor {argument!r} has a batch size per key; the "
                "example batch is replicated: one row per candidate in every key"
            )
        all_keys = tuple(kjt.keys())
        unknown = [k for k in keys.get(argument, ()) if k not in all_keys]
        if unknown:
            raise InputError(
                f"unknown key {unknown[0]!r} of the KeyedJaggedTensor {argument!r}; its keys "
                f"are: {', '.join(f'{argument}[{k}]' for k in all_keys)}"
            )
        named = set(all_keys) if argument in whole else set(keys.get(argument, ()))
        weighted = kjt.weights_or_none() is not None
        splits.append(KJTSplit(argument, all_keys, frozenset(named), weighted))
    return splits, [n for n in rest if n not in whole]


def _nameable(bound: Mapping[str, Any], kjts: Mapping[str, Any]) -> str:
    """What can be named: the tensor inputs and every KJT key."""
    others = {n: v for n, v in bound.items() if n not in kjts}
    tensors = [n for n, v in named_leaves(others).items() if isinstance(v, torch.Tensor)]
    keys = [f"{a}[{k}]" for a, kjt in kjts.items() for k in kjt.keys()]  # noqa: SIM118 - a KJT
    return "the model's inputs are: " + ", ".join(tensors + keys)


def check_names(bound: Mapping[str, Any], splits: list[KJTSplit], names: list[str]) -> None:
    """Refuse a plain name that is not a tensor input, listing the KJT keys too."""
    kjts = {s.argument for s in splits}
    others = {n: v for n, v in bound.items() if n not in kjts}
    leaves = [n for n, v in named_leaves(others).items() if isinstance(v, torch.Tensor)]
    for name in names:
        if "[" in name or any(covers(name, leaf) for leaf in leaves):
            continue  # a column range (checked by columns.py) or a tensor input
        head, _, key = name.partition(".")
        owners = [s.argument for s in splits if name in s.keys]
        if head in kjts and key:
            hint = f" (did you mean '{head}[{key}]'?)"
        elif owners:
            hint = f" (a key of a KeyedJaggedTensor: '{owners[0]}[{name}]')"
        else:
            hint = ""
        raise InputError(
            f"unknown input name {name!r}{hint}; "
            + _nameable(bound, {s.argument: bound[s.argument] for s in splits})
        )


def _has_embedding_collection(model: nn.Module) -> bool:
    module = sys.modules.get("torchrec.modules.embedding_modules")
    if module is None:
        return False
    return any(isinstance(m, module.EmbeddingCollection) for m in model.modules())


class _Pieces(PiecesModel):
    """``model`` taking each KJT argument as its pieces (handed over as a PaddedKJT)."""

    def assemble(self, split: KJTSplit, pieces: dict) -> Any:
        return PaddedKJT(
            {
                key: PaddedKey(p["ids"], p["lengths"], p.get("weights"), key, split.read_whole)
                for key, p in pieces.items()
            }
        )


def pieces_model(model: nn.Module, splits: list[KJTSplit]) -> nn.Module:
    """A :class:`_Pieces` whose ``forward`` has ``model.forward``'s signature."""
    return with_signature(_Pieces, model, "KJT", splits)


def _marked(pieces: dict[str, dict[str, torch.Tensor]]) -> dict:
    """The example's pieces with their padded width marked dynamic (capture reads the mark)."""
    for piece in pieces.values():
        for part in ("ids", "weights"):
            if part in piece:
                torch._dynamo.mark_dynamic(piece[part], 1)
    return pieces


class KJTFormat(InputFormat):
    """``KeyedJaggedTensor`` arguments: the program takes each as its keys' padded pieces.

    The call names its layout (module docstring). Where the original model can take the
    user's call as it is (a drop-in call; a shared-layout KJT with TorchRec's inverse indices
    when every lookup is an ``EmbeddingBagCollection``, which reads them), it is offered to the
    program choice as the plain program: converting a KJT into padded pieces costs more than
    sharing saves on a model with little request-side work."""

    converts = True
    name = "KeyedJaggedTensor keys"
    offers_original = True

    def __init__(self, signature, splits: list[KJTSplit], request_names, pools_only: bool):
        super().__init__(signature, request_names)
        self.splits = splits
        self._pools_only = pools_only
        self._order = parameter_order(signature)
        # One KJT argument, positional or keyword: a drop-in call's rows are its stride.
        self._kjt_at = None
        if len(splits) == 1 and self._order is not None:
            self._kjt_at = (splits[0].argument, self._order.index(splits[0].argument))
        self._identity: torch.Tensor | None = None  # ``arange(N)`` of the last call, read only

    def original_sizes(self, args, kwargs):
        if self._kjt_at is None or len(args) + len(kwargs) != len(self._order):
            return None
        name, position = self._kjt_at
        kjt = args[position] if position < len(args) else kwargs.get(name)
        if not is_kjt(kjt):
            return None
        if not kjt.variable_stride_per_key():
            return DROPIN, kjt.stride(), 0
        if not self._pools_only or self.request_names:
            return None  # request leaves beside the KJT are gathered by the checked path
        inverse = kjt.inverse_indices_or_none()
        if inverse is None or not isinstance(inverse[1], torch.Tensor) or inverse[1].dim() != 2:
            return None
        requests = self.splits[0].request_rows(kjt)
        return None if requests is None else (SHARED, inverse[1].shape[1], requests)

    def program_call(self, args, kwargs, index, replicated):
        bound = bind_inputs(self.signature, args, kwargs)
        if index is None:
            index = self._inverse_indices(bound)
        shared = self._layout(bound, index)
        for split in self.splits:
            bound[split.argument] = split.pieces(bound[split.argument])
        args, kwargs = rebuild_call(self.signature, bound)
        if index is None:
            return ProgramCall(args, kwargs, None, DROPIN)
        return ProgramCall(args, kwargs, index, SHARED if shared else REPLICATED)

    def original_program(self, original, args, kwargs, index):
        bound = bind_quickly(self.signature, self._order, args, kwargs)
        kjts = [bound.get(split.argument) for split in self.splits]
        if not all(is_kjt(kjt) for kjt in kjts):
            return None  # the program call reports the wrong input
        if index is None and not any(kjt.variable_stride_per_key() for kjt in kjts):
            return OriginalProgram(DROPIN, kjts[0].stride(), 0, lambda: original(*args, **kwargs))
        if not self._pools_only or not all(kjt.variable_stride_per_key() for kjt in kjts):
            return None
        num_requests = self.splits[0].request_rows(kjts[0])
        if num_requests is None:
            return None  # the program call names the missing key
        try:
            inverse = self._inverse_indices(bound)
        except InputError:
            return None  # the program call reports it
        if inverse is None or (index is not None and not torch.equal(index, inverse)):
            return None

        def run():
            # The KJTs' request keys are expanded by the model's own lookups (inverse indices);
            # the other request inputs are gathered to the candidates as the model takes them.
            call_args, call_kwargs = self.replicate_plain_leaves(args, kwargs, inverse)
            return original(*call_args, **call_kwargs)

        return OriginalProgram(SHARED, inverse.shape[0], num_requests, run, inverse)

    def run_original(self, original, args, kwargs, index):
        bound = bind_inputs(self.signature, args, kwargs)
        if index is None:
            index = self._inverse_indices(bound)
        shared = self._layout(bound, index)
        if index is not None and shared:
            for split in self.splits:
                bound[split.argument] = replicated_kjt(bound[split.argument], index, split.request)
            args, kwargs = rebuild_call(self.signature, bound)
            args, kwargs = self.replicate_plain_leaves(args, kwargs, index)
        return original(*args, **kwargs)

    def _inverse_indices(self, bound: dict) -> torch.Tensor | None:
        """``candidate_to_request`` of a shared-layout KJT that carries TorchRec's inverse
        indices (every request key's row for each candidate, the identity for candidate keys);
        None for any other call."""
        index = None
        for split in self.splits:
            kjt = bound.get(split.argument)
            if not is_kjt(kjt) or not kjt.variable_stride_per_key():
                continue
            inverse = kjt.inverse_indices_or_none()
            if inverse is None:
                continue
            rows = dict(zip(inverse[0], inverse[1]))
            for key in split.keys:
                row = rows.get(key)
                if row is None:
                    raise InputError(
                        f"KeyedJaggedTensor {split.argument!r}: its inverse indices have no "
                        f"row for the key {key!r}"
                    )
                if key not in split.request:
                    if not torch.equal(row, self._identity_like(row)):
                        raise InputError(
                            f"KeyedJaggedTensor {split.argument!r}: the candidate key {key!r} "
                            "has inverse indices other than one row per candidate, in order"
                        )
                elif index is None:
                    index = row
                elif not torch.equal(row, index):
                    raise InputError(
                        f"KeyedJaggedTensor {split.argument!r}: the request keys' inverse "
                        "indices differ; they must map every candidate to its request"
                    )
        return index

    def _identity_like(self, row: torch.Tensor) -> torch.Tensor:
        """``arange(len(row))`` on ``row``'s device, kept across calls of one N: a candidate
        key's inverse indices are compared with it on every shared call."""
        identity = self._identity
        if identity is None or identity.shape != row.shape or identity.device != row.device:
            identity = self._identity = torch.arange(row.shape[0], device=row.device)
        return identity

    def _layout(self, bound: dict, index: torch.Tensor | None) -> bool:
        """Check every KJT; True for the shared layout (request keys with their own rows)."""
        layouts = set()
        for split in self.splits:
            kjt = bound[split.argument]
            split.check(kjt)
            rows = split.rows(kjt)
            variable = kjt.variable_stride_per_key()
            if variable and index is None:
                raise InputError(
                    f"KeyedJaggedTensor {split.argument!r} has a batch size per key "
                    f"({rows}): that is the shared layout, which needs candidate_to_request "
                    "(or TorchRec's inverse_indices in the KJT)"
                )
            if variable:
                candidates = {k: r for k, r in rows.items() if k not in split.request}
                wrong = {k: r for k, r in candidates.items() if r != index.shape[0]}
                if wrong:
                    raise InputError(
                        f"KeyedJaggedTensor {split.argument!r}: candidate keys need one row per "
                        f"candidate ({index.shape[0]}, as candidate_to_request); got {wrong}"
                    )
                requests = {k: r for k, r in rows.items() if k in split.request}
                if len(set(requests.values())) > 1:
                    raise InputError(
                        f"KeyedJaggedTensor {split.argument!r}: request keys need one row per "
                        f"request, the same number in each; got {requests}"
                    )
            layouts.add(variable)
        if len(layouts) > 1:
            raise InputError(
                "one KeyedJaggedTensor has a batch size per key (shared layout) and another "
                "does not; pass every one in the same layout"
            )
        return bool(layouts) and layouts.pop()


def prepare_kjt(model, request_inputs, example_args, example_kwargs) -> Prepared:
    """The pieces model, its request leaves and example call for a model taking
    ``KeyedJaggedTensor``\\ s (its collections read padded pieces, ``kjt_lookups.py``)."""
    signature = inspect.signature(model.forward)
    bound = bind_inputs(signature, tuple(example_args), dict(example_kwargs))
    splits, rest = splits_for(bound, request_inputs)
    check_names(bound, splits, rest)
    names = rest + [name for split in splits for name in split.request_names()]
    input_format = KJTFormat(signature, splits, rest, not _has_embedding_collection(model))
    try:
        lookups, stand_ins = with_padded_lookups(model)
    except CompileError as err:
        return Prepared(model, names, (), {}, input_format, failure=err)
    wrapper = pieces_model(lookups, splits)
    for split in splits:
        bound[split.argument] = _marked(split.pieces(bound[split.argument], _EXAMPLE_WIDTH))
    args, kwargs = rebuild_call(signature, bound)
    return Prepared(wrapper, names, args, kwargs, input_format, stand_ins=stand_ins)
