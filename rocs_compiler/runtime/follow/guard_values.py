"""How the guards compare a value read at compile time with the value read now.

Plain data (numbers, strings, dtypes, enums, and tuples, lists, dicts and sets of them) is
compared by type and value (``2`` is not ``2.0``); any other object by identity, except that a
dataclass equal field by field, or a ``functools.partial`` of the same function and equal
arguments, reads as the graph read it when the guards resolve the model again
(``runtime/follow/guards.py``).
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import math
from typing import Any

import torch

from ...capture.reads import ABSENT
from ...errors import CompileError

MISSING = type("MISSING", (), {"__repr__": lambda self: "MISSING"})()
_PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, enum.Enum)


def snapshot(value: Any) -> Any:
    """What a read value is compared with later: plain data as a copy, anything else itself."""
    if isinstance(value, (list, dict, set)) and is_plain(value):
        return copy.deepcopy(value)
    return value


def is_plain(value: Any) -> bool:
    """True for plain data: compared by type and value, never by identity."""
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, (tuple, list, set, frozenset)):
        return all(map(is_plain, value))
    if isinstance(value, dict):
        return all(map(is_plain, value.keys())) and all(map(is_plain, value.values()))
    return False


def same_value(a: Any, b: Any) -> bool:
    """Equal as the graph saw it: the same object, or plain data of one type and value."""
    if a is b:
        return True
    if type(a) is not type(b) or not is_plain(a) or not is_plain(b):
        return False
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(map(same_value, a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_value(v, b[k]) for k, v in a.items())
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return bool(a == b)


def same_data(a: Any, b: Any) -> bool:
    """:func:`same_value`, or objects of one type whose dataclass fields (items, for lists and
    dicts; function and arguments, for a ``functools.partial``) are so: a config built again
    with equal values reads as the graph read it (a replaced TorchRec collection's table
    configs). Such an object is then compared by identity per call, as every object that is not
    plain data."""
    if same_value(a, b):
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(same_data, a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_data(v, b[k]) for k, v in a.items())
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return all(
            same_data(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)
        )
    if isinstance(a, functools.partial):  # a config's initializer, made per config
        return a.func is b.func and same_data((a.args, a.keywords), (b.args, b.keywords))
    return False


def show(value: Any) -> str:
    """A value for a message: plain data with its type, anything else its short ``repr``."""
    if value is MISSING or value is ABSENT:
        return "nothing"
    text = repr(value)
    text = text if len(text) <= 40 else text[:37] + "..."
    return f"{type(value).__name__} {text}" if is_plain(value) else text


def refuse(what: str) -> CompileError:
    """The error for a change the compiled graph cannot follow, naming it."""
    return CompileError(f"{what}; the compiled graph depends on it: compile the model again")
