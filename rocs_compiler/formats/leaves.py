"""Naming the leaves of a model's inputs.

Every tensor a model receives is named by its argument and the keys that lead to it:
``user_ids`` for a plain argument, ``features.user_age`` inside a dict, ``history.0`` inside a
list. Capture and the runtime both go through :func:`named_leaves`, so a name means the same
leaf whether the input came positionally, by keyword, or nested.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Any, Iterable, Mapping, Optional

import torch
from torch.utils import _pytree as pytree

from ..errors import InputError
from .names import covers, nest  # noqa: F401 - names of leaves, re-exported


def bind_inputs(signature: inspect.Signature, args: tuple, kwargs: Mapping[str, Any]) -> dict:
    """Arguments by parameter name, as the model would see them."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as err:
        raise InputError(f"inputs do not match the model's forward{signature}: {err}") from None
    bound.apply_defaults()  # a defaulted argument is compared like a given one
    return dict(bound.arguments)


def parameter_order(signature: inspect.Signature) -> Optional[tuple[str, ...]]:
    """The parameter names of a forward whose every parameter is positional-or-keyword (what
    :func:`given_by_name` needs); None for any other signature."""
    params = signature.parameters.values()
    if all(p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params):
        return tuple(signature.parameters)
    return None


def given_by_name(order: Optional[tuple[str, ...]], args: tuple, kwargs: Mapping[str, Any]):
    """The call's arguments by parameter name without binding, when it gives each parameter of
    ``order`` (:func:`parameter_order`) exactly once; None otherwise (bind it)."""
    if order is None or len(args) + len(kwargs) != len(order):
        return None
    named = dict(zip(order, args))
    if kwargs:
        if not named.keys().isdisjoint(kwargs):
            return None
        named.update(kwargs)
        if named.keys() != set(order):
            return None
    return named


def bind_quickly(
    signature: inspect.Signature, order, args: tuple, kwargs: Mapping[str, Any]
) -> dict:
    """:func:`bind_inputs`, without binding when the call names every parameter once."""
    named = given_by_name(order, args, kwargs)
    return named if named is not None else bind_inputs(signature, args, kwargs)


def register_dataclasses(values: Iterable[Any]) -> None:
    """Make batch objects that are dataclasses pytree nodes, so that their tensor fields are
    leaves named by field (``batch.user_ids``) for capture and the runtime alike. NamedTuples,
    dicts and lists are nodes already. The registration is global, as ``torch.export`` needs;
    it happens once, when the example is described at compile time, so calls only flatten."""
    for value in values:
        cls = type(value)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            if cls not in pytree.SUPPORTED_NODES:
                pytree.register_dataclass(cls)
            register_dataclasses(getattr(value, f.name) for f in dataclasses.fields(value))
        elif isinstance(value, (list, tuple)):
            register_dataclasses(value)
        elif isinstance(value, Mapping):
            register_dataclasses(value.values())


def _key_name(key: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def named_leaves(bound: Mapping[str, Any]) -> dict[str, Any]:
    """Flatten bound arguments into ``{dotted name: leaf}`` in a stable order."""
    if all(isinstance(v, torch.Tensor) for v in bound.values()):
        return dict(bound)  # tensors are leaves: the common flat call needs no tree walk
    leaves, _ = pytree.tree_flatten_with_path(dict(bound))
    return {".".join(_key_name(k) for k in path): leaf for path, leaf in leaves}


def rebuild_call(signature: inspect.Signature, bound: Mapping[str, Any]) -> tuple[tuple, dict]:
    """Positional and keyword arguments that reproduce ``bound``."""
    call = inspect.BoundArguments(signature, dict(bound))
    return call.args, call.kwargs


def leaf_at(bound: Mapping[str, Any], path: str) -> Any:
    """The value at the dotted ``path`` of bound arguments (dict keys, list items, dataclass
    fields); KeyError when there is none."""
    head, *rest = path.split(".")
    value = bound[head]
    for key in rest:
        if isinstance(value, Mapping):
            value = value[key]
        elif isinstance(value, (list, tuple)) and key.isdigit():
            value = value[int(key)]
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = getattr(value, key)
        else:
            raise KeyError(path)
    return value


def with_leaf(bound: Mapping[str, Any], path: str, new: Any) -> dict:
    """Bound arguments with the value at the dotted ``path`` replaced by ``new``; the containers on
    the way are copied, the caller's are left as they are."""
    head, *rest = path.split(".")
    out = dict(bound)
    out[head] = _replaced(bound[head], rest, new)
    return out


def _replaced(value: Any, keys: list[str], new: Any) -> Any:
    if not keys:
        return new
    key, rest = keys[0], keys[1:]
    if isinstance(value, Mapping):
        out = dict(value)
        out[key] = _replaced(value[key], rest, new)
        return out
    if isinstance(value, (list, tuple)) and key.isdigit():
        items = list(value)
        items[int(key)] = _replaced(items[int(key)], rest, new)
        return type(value)(items) if isinstance(value, list) else tuple(items)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{key: _replaced(getattr(value, key), rest, new)})
    raise KeyError(key)


def match_names(requested: Iterable[str], available: Iterable[str]) -> dict[str, list[str]]:
    """Map each requested name to the leaves it covers (a name may cover a whole dict).

    Raises :class:`InputError` for a name that matches no leaf, listing the valid names.
    """
    available = list(available)
    out = {}
    for name in requested:
        hits = [leaf for leaf in available if covers(name, leaf)]
        if not hits:
            raise InputError(
                f"unknown input name {name!r}; the model's tensor inputs are: "
                + ", ".join(available)
            )
        out[name] = hits
    return out


def is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


class _GraphOutput:
    def __repr__(self) -> str:
        return "<graph output>"


GRAPH_OUTPUT = _GraphOutput()  # marks an output leaf that the graph computes


def is_graph_leaf(value: Any) -> bool:
    """Output leaves the captured graph computes: tensors and numbers (which may be batch sizes
    or arithmetic on them)."""
    if isinstance(value, bool):
        return False
    return isinstance(value, (torch.Tensor, int, float, torch.SymInt, torch.SymFloat))


def replace_leaves(
    signature: inspect.Signature, args: tuple, kwargs: Mapping[str, Any], values: Mapping[str, Any]
) -> tuple[tuple, dict]:
    """The call ``(args, kwargs)`` with the named leaves replaced by ``values``."""
    bound = bind_inputs(signature, args, kwargs)
    flat, spec = pytree.tree_flatten_with_path(bound)
    leaves = []
    for path, leaf in flat:
        name = ".".join(_key_name(k) for k in path)
        leaves.append(values.get(name, leaf))
    return rebuild_call(signature, pytree.tree_unflatten(leaves, spec))


def fresh_identifier(name: str, taken: set[str]) -> str:
    """``name`` as a Python identifier not in ``taken`` (which it is added to)."""
    base = re.sub(r"\W", "_", name)
    if not base or base[0].isdigit():
        base = "_" + base
    out, i = base, 1
    while out in taken:
        out, i = f"{base}_{i}", i + 1
    taken.add(out)
    return out
