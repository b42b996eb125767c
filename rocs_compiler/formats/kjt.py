"""Request features that are keys of a TorchRec ``KeyedJaggedTensor``: ``"sparse_features[user_id]"``.

TorchRec models take ``forward(dense_features, sparse_features: KeyedJaggedTensor)``; the
request side is some keys of the KJT (a user id, a behaviour history). A request name
``"<argument>[<key>]"`` names one key; the argument's name alone names all its keys.

A KJT keeps every row of a key in one flat ``values`` tensor, which no row-wise analysis can
split by request. The model is compiled as a wrapper (as for column ranges,
``column_lanes.py``) whose input is the KJT in pieces, every key as per-row tensors:
``sparse_features.user_id.ids`` ``[B, W]`` (row i holds ``values`` of row i, then zeros up to
``W``, the longest row of the call: a dynamic dim), ``sparse_features.user_id.lengths`` ``[B]``,
and ``.weights`` ``[B, W]`` for a weighted KJT. The wrapper hands the model a
:class:`~.kjt_pooling.PaddedKJT`, which its ``EmbeddingBagCollection`` modules pool and its
``EmbeddingCollection`` modules look up (``kjt_pooling.py`` and ``kjt_sequences.py`` state those
identities). A request key's pieces are request inputs, so its
lookups, and everything computed only from them, run once per request.

Identity: a key's jagged row i is ``ids[i, :lengths[i]]`` (with ``weights[i, :lengths[i]]``),
and the padding is a function of the row alone, so two equal jagged rows give equal padded rows:
drop-in calls find requests among consecutive equal rows exactly as for dense inputs.

Call layouts, named by the call (:class:`KJTLanes`):

* drop-in, ``cm(dense, kjt)``: every key has one row per candidate;
* shared, ``cm(dense, kjt, candidate_to_request=idx)`` with a KJT whose request keys have R rows
  and candidate keys N (TorchRec's variable batch per feature, ``stride_per_key_per_rank``);
  (or no ``candidate_to_request`` when the KJT carries TorchRec's ``inverse_indices``, which say
  the same);
* the same call with a KJT of N rows in every key: replicated rows with the grouping known; the
  request keys' rows are checked to agree within each request.
"""

from __future__ import annotations

import inspect
import re
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .columns import PiecesModel
from ..errors import CompileError, InputError
from .leaves import bind_inputs, named_leaves, rebuild_call, replace_leaves
from ..runtime.program_choice import ProgramChoice, bucket

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

    def pieces(self, kjt, min_width: int = 1) -> dict[str, dict[str, torch.Tensor]]:
        """``{key: {"ids", "lengths"[, "weights"]}}``, the rows of each key padded to its
        longest row (at least ``min_width``)."""
        lengths = kjt.lengths().split(kjt.stride_per_key())
        sizes = kjt.length_per_key()
        values = kjt.values().split(sizes)
        weights = kjt.weights_or_none()
        weights = weights.split(sizes) if weights is not None else [None] * len(sizes)
        out = {}
        for key, key_lengths, key_values, key_weights in zip(kjt.keys(), lengths, values, weights):
            width = max(int(key_lengths.max()) if key_lengths.numel() else 0, min_width)
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
        if "[" in name or any(leaf == name or leaf.startswith(name + ".") for leaf in leaves):
            continue  # a column range (checked by column_lanes) or a tensor input
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
        from .kjt_pooling import PaddedKey, PaddedKJT

        return PaddedKJT(
            {key: PaddedKey(p["ids"], p["lengths"], p.get("weights")) for key, p in pieces.items()}
        )


def pieces_model(model: nn.Module, splits: list[KJTSplit]) -> nn.Module:
    """A :class:`_Pieces` whose ``forward`` has ``model.forward``'s signature."""
    from .columns import with_signature

    return with_signature(_Pieces, model, "KJT", splits)


def _marked(pieces: dict[str, dict[str, torch.Tensor]]) -> dict:
    """The example's pieces with their padded width marked dynamic (capture reads the mark)."""
    for piece in pieces.values():
        for part in ("ids", "weights"):
            if part in piece:
                torch._dynamo.mark_dynamic(piece[part], 1)
    return pieces


class KJTLanes(nn.Module):
    """A compiled model whose inputs include ``KeyedJaggedTensor``\\ s; called like the original.

    ``compiled`` is None for an eager fallback (the original model runs)."""

    def __init__(
        self,
        compiled: nn.Module | None,
        original: nn.Module,
        signature: inspect.Signature,
        splits: list[KJTSplit],
        request_names: Sequence[str] = (),
        fallback_reason: str | None = None,
    ):
        super().__init__()
        self.compiled = compiled
        self.signature = signature
        self.splits = splits
        self._request_names = list(request_names)  # the other request inputs, for the fallback
        self._fallback_reason = fallback_reason
        object.__setattr__(self, "_original", original)  # not a submodule: the user's model
        # Drop-in calls choose between the pieces program and the original model itself, per
        # batch size (``runtime/program_choice.py``): converting a KJT into padded pieces costs
        # more than sharing saves on a model with little request-side work.
        autotune = getattr(compiled, "_choice", None) is not None
        object.__setattr__(self, "_choice", ProgramChoice() if autotune else None)
        # Only EmbeddingBagCollections read a KJT's inverse indices (EmbeddingCollections do
        # not): the original model takes a shared-layout KJT only when it has no other lookup.
        self._pools_only = not _has_embedding_collection(original)

    @property
    def is_fallback(self) -> bool:
        return self.compiled is None

    def forward(self, *args, candidate_to_request: torch.Tensor | None = None, **kwargs):
        bound = bind_inputs(self.signature, args, kwargs)
        choose = self._choice is not None and candidate_to_request is None
        if choose and not torch.is_grad_enabled() and not torch.compiler.is_compiling():
            if self._replicated(bound):
                return self._dropin_choosing(args, kwargs, bound)
        given = candidate_to_request
        if given is None:
            candidate_to_request = inverse = self._inverse_indices(bound)
        else:
            inverse = self._inverse_indices_if_any(bound) if self._may_run_original() else None
        shared = self._layout(bound, candidate_to_request)
        if self.compiled is None:
            return self._eager(bound, candidate_to_request, shared)
        if shared and inverse is not None and self._may_run_original():
            if given is None or torch.equal(given, inverse):
                return self._shared_choosing(args, kwargs, bound, inverse)
        return self._pieces_call(bound, candidate_to_request, shared)

    def _may_run_original(self) -> bool:
        """True when a shared-layout call may run the original model on its KJT instead: under
        the program choice, outside autograd and tracing, with only EmbeddingBagCollections."""
        return (
            self._choice is not None
            and self._pools_only
            and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling()
        )

    def _inverse_indices_if_any(self, bound: dict) -> torch.Tensor | None:
        """The grouping the KJTs' inverse indices state, or None when they state none or
        none that holds (the call's own ``candidate_to_request`` is then checked as before)."""
        try:
            return self._inverse_indices(bound)
        except InputError:
            return None

    def _shared_choosing(self, args: tuple, kwargs: dict, bound: dict, index: torch.Tensor):
        """A shared-layout call whose KJTs carry TorchRec's inverse indices: the pieces program,
        or the original model, which reads the same KJT through its inverse indices (its
        ``EmbeddingBagCollection`` expands each request row to its candidates), whichever this
        size's first calls measured faster."""
        split = self.splits[0]
        rows = split.rows(bound[split.argument])
        num_requests = max((rows[k] for k in split.request), default=0)
        key = bucket("shared", index.shape[0], num_requests)
        return self._choice.run(
            key,
            lambda: self._pieces_call(bound, index, True),
            lambda: self._original(*args, **kwargs),
        )

    def _replicated(self, bound: dict) -> bool:
        """True when every split argument is a KJT with one row per candidate in every key."""
        return all(
            is_kjt(kjt) and not kjt.variable_stride_per_key()
            for kjt in (bound.get(split.argument) for split in self.splits)
        )

    def _dropin_choosing(self, args: tuple, kwargs: dict, bound: dict):
        """A drop-in call: the pieces program, or the original model on the original call,
        whichever this batch size's first calls measured faster (both exact: the second is
        the model itself)."""
        key = bucket("dropin", bound[self.splits[0].argument].stride())

        def pieces():
            self._layout(bound, None)
            return self._pieces_call(bound, None, False)

        # The original model checks its own call.
        return self._choice.run(key, pieces, lambda: self._original(*args, **kwargs))

    def program_choices(self) -> dict[tuple, str]:
        """Per drop-in batch size bucket, ``"shared"`` (the pieces program) or ``"plain"`` (the
        original model), for the buckets decided so far."""
        return {} if self._choice is None else self._choice.decisions()

    def _pieces_call(self, bound: dict, candidate_to_request, shared: bool):
        for split in self.splits:
            bound[split.argument] = split.pieces(bound[split.argument])
        args, kwargs = rebuild_call(self.signature, bound)
        if candidate_to_request is None:
            return self.compiled(*args, **kwargs)
        if shared:
            return self.compiled(*args, candidate_to_request=candidate_to_request, **kwargs)
        return self.compiled.call_replicated(
            *args, candidate_to_request=candidate_to_request, **kwargs
        )

    def call_replicated(self, *args, candidate_to_request: torch.Tensor, **kwargs):
        return self(*args, candidate_to_request=candidate_to_request, **kwargs)

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
                    if not torch.equal(row, torch.arange(row.shape[0], device=row.device)):
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

    def _eager(self, bound: dict, index: torch.Tensor | None, shared: bool):
        """The original model on the replicated batch (the eager fallback)."""
        from ..integrations.torchrec import replicated_kjt

        if index is not None and shared:
            for split in self.splits:
                bound[split.argument] = replicated_kjt(bound[split.argument], index, split.request)
            args, kwargs = rebuild_call(self.signature, bound)
            leaves = named_leaves({n: v for n, v in bound.items() if not is_kjt(v)})
            gathered = {
                n: v.index_select(0, index)
                for n, v in leaves.items()
                if isinstance(v, torch.Tensor)
                and any(n == r or n.startswith(r + ".") for r in self._request_names)
            }
            args, kwargs = replace_leaves(self.signature, args, kwargs, gathered)
        else:
            args, kwargs = rebuild_call(self.signature, bound)
        with torch.no_grad():
            return self._original(*args, **kwargs)

    def report(self, *args, **kwargs):
        if self.compiled is None:
            from ..report.build import Report

            return Report.for_fallback(self._fallback_reason or "eager fallback")
        return self.compiled.report(*args, **kwargs)

    def refresh_weights(self) -> None:
        if self.compiled is not None:
            self.compiled.refresh_weights()


def compile_kjt(
    compile_fn, model, request_inputs, example_args, example_kwargs, *, fallback="error", **kwargs
):
    """``rocs.compile`` for a model taking ``KeyedJaggedTensor``\\ s (``compile_fn`` is
    ``rocs.compile`` itself, applied to the pieces model)."""
    if fallback not in ("error", "eager"):
        raise ValueError(f"fallback must be 'error' or 'eager', got {fallback!r}")
    signature = inspect.signature(model.forward)
    bound = bind_inputs(signature, tuple(example_args), dict(example_kwargs))
    splits, rest = splits_for(bound, request_inputs)
    check_names(bound, splits, rest)
    names = rest + [name for split in splits for name in split.request_names()]
    try:
        from .kjt_pooling import with_padded_lookups

        wrapper = pieces_model(with_padded_lookups(model), splits)
        for split in splits:
            bound[split.argument] = _marked(split.pieces(bound[split.argument], _EXAMPLE_WIDTH))
        args, call_kwargs = rebuild_call(signature, bound)
        inner = compile_fn(wrapper, names, args, call_kwargs, fallback="error", **kwargs)
    except CompileError as err:
        if fallback == "error":
            raise
        warnings.warn(f"rocs: compilation failed, the model will run eagerly: {err}", stacklevel=3)
        reason = str(err).splitlines()[0]
        return KJTLanes(None, model, signature, splits, rest, fallback_reason=reason)
    return KJTLanes(inner, model, signature, splits, rest)
