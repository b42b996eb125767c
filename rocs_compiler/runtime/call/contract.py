"""The input contract of a compiled model: its input names, which are request-side or batched,
its constant inputs and its output tree; it names a call's tensor leaves (the fast paths for
keyword, positional and one-level dict calls, else a bind and a tree walk) and rebuilds outputs.

Identity: ``contract.outputs(graph(*[leaves[n] for n in contract.input_names]))`` is the
original's output tree for the call whose leaves are ``leaves``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Optional

import torch
from torch.utils import _pytree as pytree

from ...errors import InputError
from ...formats.leaves import GRAPH_OUTPUT, bind_inputs, is_tensor, named_leaves


class InputContract:
    """What a compiled model expects: names, which leaves are request-side or batched."""

    def __init__(self, signature, input_names, request_inputs, batched, constant_inputs, out_spec, out_constants):
        self.signature: inspect.Signature = signature
        self.input_names: list[str] = list(input_names)
        self.request_inputs: list[str] = list(request_inputs)
        self.batched: dict[str, bool] = dict(batched)
        self.constant_inputs: dict[str, Any] = dict(constant_inputs)
        self.out_spec = out_spec
        self.out_constants = list(out_constants)
        # A forward returning one tensor: no tree to rebuild.
        self._single_output = (
            len(self.out_constants) == 1
            and self.out_constants[0] is GRAPH_OUTPUT
            and isinstance(out_spec, pytree.TreeSpec)
            and out_spec.is_leaf()
        )
        # A forward whose parameters are exactly the tensor inputs can take keyword calls as they
        # are (no binding, no flattening); None when any input is nested or non-tensor.
        params = signature.parameters
        plain = all(p.kind == p.POSITIONAL_OR_KEYWORD or p.kind == p.KEYWORD_ONLY for p in params.values())
        flat = plain and not self.constant_inputs and set(params) == set(self.input_names)
        self._keyword_names = frozenset(self.input_names) if flat else None
        # Keyword calls whose values are tensors or dicts of tensors (one level) are named
        # without binding or a tree walk when every parameter is given and none is a constant.
        nested = plain and not self.constant_inputs
        self._param_names = frozenset(params) if nested else None
        # Positional calls of such a forward are named by parameter order, without binding.
        self._param_order = tuple(params) if nested and all(
            p.kind == p.POSITIONAL_OR_KEYWORD for p in params.values()
        ) else None
        self._input_set = frozenset(self.input_names)
        self.batched_inputs = [n for n in self.input_names if self.batched[n]]
        self.candidate_inputs = [n for n in self.batched_inputs if n not in self.request_inputs]
        self._first_batched = _locator(signature, self.batched_inputs[:1]) if nested else None

    @property
    def places_rows(self) -> bool:
        """Whether :meth:`first_rows` can read a call's rows (its first batched input is a
        parameter, or one key or field of one)."""
        return self._first_batched is not None

    def first_rows(self, args: tuple, kwargs: dict) -> Optional[int]:
        """The row count of the call's first batched input, read without naming the call's
        leaves, for a parameter that is that tensor or a dict or batch object holding it; None
        when it is not found so (the caller names the leaves)."""
        where = self._first_batched
        if where is None:
            return None
        param, position, key = where
        if param in kwargs:
            value = kwargs[param]
        elif position is not None and position < len(args):
            value = args[position]
        else:
            return None
        if key is not None:
            value = value.get(key) if type(value) is dict else getattr(value, key, None)
        if not isinstance(value, torch.Tensor) or not value.dim():
            return None
        return value.shape[0]

    def leaves(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        order = self._param_order
        if args and order is not None and len(args) + len(kwargs) == len(order):
            named = dict(zip(order, args))
            if len(named) == len(args) and named.keys().isdisjoint(kwargs):
                kwargs = {**named, **kwargs}
                args = ()
        if not args and kwargs.keys() == self._keyword_names:
            if all(isinstance(v, torch.Tensor) for v in kwargs.values()):
                return kwargs
        if not args and kwargs.keys() == self._param_names:
            flat = _nested_leaves(kwargs)
            if flat is not None and flat.keys() == self._input_set:
                return flat
        leaves = named_leaves(bind_inputs(self.signature, args, kwargs))
        tensors = {n for n, v in leaves.items() if is_tensor(v)}
        missing = [n for n in self.input_names if n not in tensors]
        extra = sorted(tensors - set(self.input_names))
        not_tensors = [n for n in missing if n in leaves and leaves[n] is not None]
        if not_tensors:
            name = not_tensors[0]
            raise InputError(
                f"input {name!r} must be a torch.Tensor, got {type(leaves[name]).__name__}"
            )
        if missing:
            raise InputError(f"missing input(s): {', '.join(missing)}")
        if extra:
            raise InputError(
                f"unknown input(s): {', '.join(extra)}; expected: {', '.join(self.input_names)}"
            )
        for name, expected in self.constant_inputs.items():
            if name in leaves and not _same_constant(leaves[name], expected):
                raise InputError(
                    f"non-tensor input {name}={leaves[name]!r} differs from the value it had at "
                    f"compile time ({type(expected).__name__} {expected!r}); compile again for "
                    "another value"
                )
        return leaves

    def outputs(self, tensors: list[torch.Tensor]) -> Any:
        if self._single_output:
            return tensors[0]
        it = iter(tensors)
        flat = [next(it) if c is GRAPH_OUTPUT else c for c in self.out_constants]
        return pytree.tree_unflatten(flat, self.out_spec)


def _locator(signature: inspect.Signature, names: list[str]) -> Optional[tuple]:
    """``(parameter, its position or None, key or None)`` of the leaf ``names[0]``, a parameter or
    one key or field of one (``InputContract.first_rows``); None for any other leaf."""
    if not names:
        return None
    param, _, key = names[0].partition(".")
    if param not in signature.parameters or "." in key:
        return None
    kinds = [p.kind for p in signature.parameters.values()]
    position = list(signature.parameters).index(param)
    positional = all(k == inspect.Parameter.POSITIONAL_OR_KEYWORD for k in kinds[: position + 1])
    return param, position if positional else None, key or None


def _nested_leaves(kwargs: dict) -> Optional[dict]:
    """``named_leaves`` of keyword arguments that are tensors, str-keyed dicts of tensors or
    dataclasses of tensors (batch objects, named by field as pytree names them); None for any
    other structure (left to the general path)."""
    flat = {}
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            flat[name] = value
            continue
        if type(value) is dict:
            items = value.items()
        else:
            fields = _tensor_fields(type(value))
            if fields is None:
                return None
            items = zip(fields, map(value.__getattribute__, fields))
        for key, leaf in items:
            if type(key) is not str or not isinstance(leaf, torch.Tensor):
                return None
            flat[f"{name}.{key}"] = leaf
    return flat


@functools.lru_cache(maxsize=256)
def _tensor_fields(cls: type) -> Optional[tuple[str, ...]]:
    """The fields pytree flattens of a dataclass registered as a pytree node; None for any
    other type."""
    if not dataclasses.is_dataclass(cls) or cls not in pytree.SUPPORTED_NODES:
        return None
    return tuple(f.name for f in dataclasses.fields(cls) if f.init)


def _same_constant(a: Any, b: Any) -> bool:
    try:  # ``2.0 == 2``, but the graph was traced with an int
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - incomparable values count as different
        return False
