"""What one scoring request must hold, and its check: one place for every bad-input error.

A served model's inputs are :class:`Field`\\ s named as at compile time (``user_id``,
``features.user_age``, ``sparse_features[user_id]`` for a KeyedJaggedTensor key). A request
brings every request field once (one row) and every candidate field once per candidate (a list
of rows of one length, at least one). :meth:`Schema.check` turns JSON values, NumPy arrays or
tensors into tensors of the field's dtype and shape, or raises :class:`RequestError` naming the
field: it runs per request before packing, so a bad request never joins a batch. Values are
checked too: a float feature must be finite (NaN or infinity: 400; the model would score NaN,
which JSON cannot carry), and an id field's ids must lie in the embedding tables it looks up
(``Field.ids``, read from the model's graph by ``id_ranges.py``: an id past a table or negative
answers 400 naming the field instead of failing the model call).

Shapes: a field's ``shape`` is one row's shape; ``None`` marks a dim of any length (a padded
width of a saved program), which packing pads with zeros to the longest row of the batch. A
jagged field (a KJT key) takes a list of ids of any length per row.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import InputError
from .id_ranges import IdRange

REQUEST, CANDIDATE = "request", "candidate"


class RequestError(InputError):
    """A scoring request that does not fit the model: ``field`` names the feature (or the part
    of the body) at fault; ``status`` is the HTTP status it answers (400, or 413 for size)."""

    def __init__(self, message: str, field: str | None = None, status: int = 400):
        super().__init__(message)
        self.field = field
        self.status = status

    def to_json(self) -> dict:
        return {"error": str(self), "field": self.field}


@dataclass(frozen=True)
class Field:
    """One input of the served model: its name, side, dtype and one row's shape."""

    name: str
    side: str  # REQUEST or CANDIDATE
    dtype: torch.dtype
    shape: tuple[int | None, ...] = ()
    jagged: bool = False  # a KeyedJaggedTensor key: a row is a list of ids of any length
    ids: tuple[IdRange, ...] = ()  # the tables its ids look up

    def describe(self) -> dict:
        shape = ["*"] if self.jagged else ["*" if s is None else s for s in self.shape]
        return {
            "name": self.name,
            "side": self.side,
            "dtype": str(self.dtype).replace("torch.", ""),
            "shape": shape,
        }


@dataclass
class Request:
    """One checked request: request rows without a batch dim, candidate rows ``[n, ...]`` (a list
    of 1-D id tensors for a jagged field, a list of rows where a dim is of any length)."""

    request: dict[str, Any]
    candidates: dict[str, Any]
    num_candidates: int
    meta: dict = field(default_factory=dict)  # the server's own per-request notes


_KINDS = {"b": "booleans", "i": "integers", "u": "integers", "f": "numbers"}


def _accepts(dtype: torch.dtype, kind: str) -> bool:
    """Whether values of NumPy ``kind`` convert to ``dtype`` without changing meaning."""
    if dtype == torch.bool:
        return kind == "b"
    if dtype.is_floating_point:
        return kind in "iuf"
    return kind in "iu"  # integer ids: a float is a mistake, not an id


def _expected(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "booleans"
    return "numbers" if dtype.is_floating_point else "integers"


class Schema:
    """The served model's fields, and the check of one request against them."""

    def __init__(self, fields: list[Field]):
        self.fields = list(fields)
        self.by_name = {f.name: f for f in self.fields}
        self.request_fields = [f for f in self.fields if f.side == REQUEST]
        self.candidate_fields = [f for f in self.fields if f.side == CANDIDATE]
        if not self.candidate_fields:
            raise InputError("a served model needs at least one candidate input")

    def describe(self) -> list[dict]:
        return [f.describe() for f in self.fields]

    def check(self, payload: Any) -> Request:
        """A :class:`Request` from ``{"request": {name: row}, "candidates": {name: [rows]}}``."""
        if not isinstance(payload, Mapping):
            raise RequestError(
                f"the body must be an object with 'request' and 'candidates', got "
                f"{type(payload).__name__}",
                "body",
            )
        extra = sorted(set(payload) - {"request", "candidates"})
        if extra:
            raise RequestError(
                f"unknown key {extra[0]!r}; the body has 'request' and 'candidates'", extra[0]
            )
        request = self._part(payload, "request", self.request_fields, REQUEST)
        candidates = self._part(payload, "candidates", self.candidate_fields, CANDIDATE)
        rows = {name: _rows(value, name) for name, value in candidates.items()}
        counts = set(rows.values())
        if len(counts) > 1:
            detail = ", ".join(f"{n}: {r}" for n, r in rows.items())
            lengths = list(rows.values())
            usual = max(lengths, key=lengths.count)
            odd = next(n for n, r in rows.items() if r != usual)  # the one that disagrees
            raise RequestError(f"candidate lists disagree in length ({detail})", odd)
        num = counts.pop()
        if num == 0:
            raise RequestError("a request needs at least one candidate", next(iter(rows)))
        checked_request = {f.name: self._row(f, request[f.name]) for f in self.request_fields}
        checked_candidates = {
            f.name: self._rows(f, candidates[f.name], num) for f in self.candidate_fields
        }
        return Request(checked_request, checked_candidates, num)

    def _part(self, payload: Mapping, key: str, fields: list[Field], side: str) -> Mapping:
        part = payload.get(key)
        if part is None and not fields and key == "request":
            return {}
        if not isinstance(part, Mapping):
            raise RequestError(f"'{key}' must be an object of features by name", key)
        names = {f.name for f in fields}
        for name in part:
            if name not in names:
                known = self.by_name.get(name)
                if known is not None:
                    where = "request" if known.side == REQUEST else "candidates"
                    raise RequestError(
                        f"{name!r} is a {known.side} feature: give it under '{where}'", name
                    )
                raise RequestError(
                    f"unknown feature {name!r} in '{key}'; expected: {', '.join(sorted(names))}",
                    name,
                )
        for f in fields:
            if f.name not in part:
                raise RequestError(f"missing {side} feature {f.name!r} in '{key}'", f.name)
        return part

    def _row(self, f: Field, value: Any, check: bool = True) -> torch.Tensor:
        """One row of ``f``: a tensor of ``f.shape`` (no batch dim)."""
        if f.jagged:
            tensor = _ids(f, value)
        else:
            tensor = _tensor(f, value)
            _check_shape(f, tuple(tensor.shape), f.shape, "a row")
        if check:
            _check_values(f, tensor, 0)
        return tensor

    def _rows(self, f: Field, value: Any, num: int):
        """``num`` rows of ``f``: one tensor ``[num, *shape]``, or a list where rows may differ
        in length (jagged fields, dims of any length)."""
        if f.jagged or None in f.shape:
            rows = [self._row(f, row, check=not f.jagged) for row in value]
            if f.jagged and rows:  # 1-D rows: their values checked at once
                _check_values(f, torch.cat(rows), 0)
            return rows
        tensor = _tensor(f, value)
        _check_shape(f, tuple(tensor.shape), (num, *f.shape), f"{num} rows")
        _check_values(f, tensor, 1)
        return tensor


def _rows(value: Any, name: str) -> int:
    if isinstance(value, (torch.Tensor, np.ndarray)):
        if value.ndim == 0:
            raise RequestError(f"candidate feature {name!r} must be a list of rows", name)
        return int(value.shape[0])
    if not isinstance(value, (list, tuple)):
        raise RequestError(
            f"candidate feature {name!r} must be a list with one row per candidate, got "
            f"{type(value).__name__}",
            name,
        )
    return len(value)


def _tensor(f: Field, value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        kind = "f" if value.dtype.is_floating_point else ("b" if value.dtype == torch.bool else "i")
        if value.is_complex() or not _accepts(f.dtype, kind):
            raise RequestError(
                f"{f.name!r} must hold {_expected(f.dtype)}, got {value.dtype}", f.name
            )
        return value.detach().to(f.dtype)
    try:
        array = np.asarray(value)
    except (ValueError, TypeError):  # ragged nested lists
        raise RequestError(
            f"{f.name!r} is not a regular array of {_expected(f.dtype)}", f.name
        ) from None
    if array.size == 0 and array.dtype.kind in "fO":  # ``[]`` is no float: it is empty
        return torch.zeros(array.shape, dtype=f.dtype)
    if array.dtype.kind not in _KINDS or not _accepts(f.dtype, array.dtype.kind):
        got = _KINDS.get(array.dtype.kind, "ragged lists or non-numbers")
        if array.dtype.kind == "O":
            got = "ragged lists or non-numbers"
        raise RequestError(f"{f.name!r} must hold {_expected(f.dtype)}, got {got}", f.name)
    return torch.as_tensor(np.asarray(array, order="C")).to(f.dtype)


def _ids(f: Field, value: Any) -> torch.Tensor:
    tensor = _tensor(f, value)
    if tensor.dim() != 1:
        raise RequestError(
            f"{f.name!r} takes a list of ids per row, got shape {list(tensor.shape)}", f.name
        )
    return tensor.to(f.dtype)


def _check_shape(f: Field, got: tuple, want: tuple, what: str) -> None:
    fits = len(got) == len(want) and all(w is None or g == w for g, w in zip(got, want))
    if not fits:
        expected = ["*" if w is None else w for w in want]
        raise RequestError(
            f"{f.name!r}: {what} of shape {expected} expected, got shape {list(got)}", f.name
        )


def _check_values(f: Field, values: torch.Tensor, batch_dims: int) -> None:
    """Finite numbers in a float field; ids inside the tables they look up (``batch_dims``: 1
    where ``values`` holds rows, 0 for one row)."""
    if values.numel() == 0:
        return
    if values.dtype.is_floating_point:
        if not bool(torch.isfinite(values).all()):
            raise RequestError(
                f"{f.name!r} holds NaN or infinity; features must be finite numbers", f.name
            )
        return
    for bound in f.ids:
        part = values
        if bound.column is not None:
            dim, index = bound.column
            part = values.select(dim + batch_dims, index)
        low, high = (int(v) for v in torch.aminmax(part))
        if low < 0 or high >= bound.rows:
            bad = low if low < 0 else high
            raise RequestError(
                f"{f.name!r}: id {bad}{bound.where()} is outside embedding table {bound.table!r} "
                f"of {bound.rows} rows (ids 0 to {bound.rows - 1})",
                f.name,
            )
