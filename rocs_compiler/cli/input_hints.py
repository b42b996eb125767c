"""The ``--input`` example a missing-input error suggests, read from the model's ``forward``.

For a forward argument without a spec, the suggestion follows what the source shows:

- ``features["age"]`` (or ``.get("age")``): a dict argument, so ``features.age=...``;
- the value passed to an ``nn.Embedding`` attribute (``self.item(item_id)``, directly or through
  one local name): ids, ``int64[]<num_embeddings`` (``int64[8]<...``, a bag per row, for an
  ``nn.EmbeddingBag``; ``int64[]`` for ``F.embedding``);
- the value passed to an ``nn.Linear`` attribute: ``float32[in_features]``;
- otherwise ``float32[16]``, or ``int64[]`` when the name reads as ids (``item_id``, ``ids``).

The source is read, never run; anything it does not show falls back to the name.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from typing import Any, Optional

_ID_NAME = re.compile(r"(^|_)(ids?|idx|index|indices|token|tokens)($|_)|_id$", re.IGNORECASE)


def suggested_specs(model: Any, argument: str) -> list[str]:
    """``NAME=DTYPE[SHAPE]`` for ``argument``; for a dict argument one ``NAME.KEY=...`` per key
    the forward reads."""
    tree = _forward_tree(model)
    keys = _keys_read(tree, argument) if tree is not None else []
    specs = []
    for key in keys or [None]:
        name = argument if key is None else f"{argument}.{key}"
        fed = _module_fed(model, tree, argument, key) if tree is not None else None
        specs.append(f"{name}={fed or _by_name(key or argument)}")
    return specs


def _by_name(name: str) -> str:
    return "int64[]" if _ID_NAME.search(name) else "float32[16]"


def _forward_tree(model: Any) -> Optional[ast.AST]:
    try:
        source = inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        return None
    try:
        return ast.parse(textwrap.dedent(source))
    except SyntaxError:
        return None


def _keys_read(tree: ast.AST, argument: str) -> list[str]:
    """String keys read from ``argument`` in ``tree``: ``argument["k"]``, ``argument.get("k")``."""
    found = sorted(  # in source order (ast.walk goes breadth first)
        (node.lineno, node.col_offset, key)
        for node in ast.walk(tree)
        if (key := _key_of(node, argument)) is not None
    )
    return list(dict.fromkeys(key for _, _, key in found))


def _key_of(node: ast.AST, argument: str) -> Optional[str]:
    if isinstance(node, ast.Subscript) and _is_name(node.value, argument):
        index = node.slice
        if isinstance(index, ast.Constant) and isinstance(index.value, str):
            return index.value
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "get"
        and _is_name(node.func.value, argument)
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        return node.args[0].value
    return None


def _is_name(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _module_fed(model: Any, tree: ast.AST, argument: str, key: Optional[str]) -> Optional[str]:
    """The spec the first embedding or linear layer fed with the argument (or its key) needs."""
    from torch import nn

    def is_value(node: ast.AST) -> bool:
        if key is None:
            return _is_name(node, argument)
        return _key_of(node, argument) == key

    aliases = {
        target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and is_value(node.value)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        first = node.args[0]
        if not (is_value(first) or (isinstance(first, ast.Name) and first.id in aliases)):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == "embedding":  # F.embedding(ids, w)
            return "int64[]"
        if isinstance(func, ast.Attribute) and _is_name(func.value, "self"):
            layer = getattr(model, func.attr, None)
            if isinstance(layer, nn.EmbeddingBag):  # a bag of ids per row
                return f"int64[8]<{layer.num_embeddings}"
            if isinstance(layer, nn.Embedding):
                return f"int64[]<{layer.num_embeddings}"
            if isinstance(layer, nn.Linear):
                return f"float32[{layer.in_features}]"
    return None
