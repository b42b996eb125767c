"""Dotted names of input leaves (``features.user_age``), as plain strings: what the CLI and the
doors read without importing torch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def covers(name: str, leaf: str) -> bool:
    """True when the input name ``name`` names the leaf ``leaf``: the leaf itself, or a dict,
    list or dataclass holding it (``features`` covers ``features.user_age``)."""
    return leaf == name or leaf.startswith(name + ".")


def nest(values: Mapping[tuple, Any]) -> dict:
    """Nested dicts from ``{(argument, key, ...): value}``."""
    out: dict = {}
    for path, value in values.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out
