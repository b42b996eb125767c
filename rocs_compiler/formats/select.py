"""Which input format a compile's request names and example call use."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from ..errors import InputError
from .base import Prepared, prepare_leaves
from .columns import parse as parse_columns, prepare_columns
from .kjt import prepare_kjt, takes_kjt


def prepare(
    model: nn.Module,
    request_inputs: Sequence[str],
    example_args: Sequence[Any],
    example_kwargs: Mapping[str, Any],
) -> Prepared:
    """KeyedJaggedTensor keys when the call passes a KJT, column ranges when a request name is
    one (``"X[:, 0:12]"``), else tensors by name."""
    args, kwargs = tuple(example_args), dict(example_kwargs)
    if takes_kjt(model, args, kwargs):
        prepared = prepare_kjt(model, list(request_inputs), args, kwargs)
        if any(_is_column_range(name) for name in prepared.request_inputs):
            raise InputError(
                "column ranges of a packed input and KeyedJaggedTensor keys in one model are not "
                "supported; name the packed input whole"
            )
        return prepared
    ranges, plain = parse_columns(request_inputs)
    if ranges:
        return prepare_columns(model, ranges, plain, args, kwargs)
    return prepare_leaves(model, request_inputs, args, kwargs)


def _is_column_range(name: str) -> bool:
    ranges, _ = parse_columns([name]) if "[" in name else ({}, [])
    return bool(ranges)
