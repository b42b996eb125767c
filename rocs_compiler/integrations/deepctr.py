"""DeepCTR-Torch helpers: request names from the feature columns a DeepCTR user already has.

A DeepCTR-Torch model takes ``forward(X)``, every feature packed into column ranges of ``X``
(``model.feature_index[name] == (start, stop)``). The request side is the user's features; this
helper turns their names, or their feature columns, into ``rocs.compile``'s column-range names::

    from rocs_compiler.integrations import deepctr as rocs_deepctr

    request = rocs_deepctr.request_columns(model, ["user_id", "gender", "hist_item_id"])
    compiled = rocs.compile(model, request, example_kwargs={"X": x})

A behaviour history (``VarLenSparseFeat``) brings its length column (``length_name``) along: the
length belongs to the same user. deepctr_torch is not imported.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

__all__ = ["request_columns"]


def request_columns(model: nn.Module, features: Iterable[Any], argument: str = "X") -> list[str]:
    """``"X[:, start:stop]"`` for each of ``features`` (names, or DeepCTR feature columns such as
    ``SparseFeat``, ``DenseFeat`` and ``VarLenSparseFeat``), in the order of ``X``'s columns.

    Raises ``ValueError`` naming the model's features when one is not among them.
    """
    index = getattr(model, "feature_index", None)
    if not isinstance(index, dict):
        raise ValueError(
            f"{type(model).__name__} has no feature_index: request_columns takes a DeepCTR-Torch "
            "model (its feature_index maps each feature to its columns of X)"
        )
    names = []
    for feature in features:
        name = feature if isinstance(feature, str) else getattr(feature, "name", None)
        if name not in index:
            raise ValueError(
                f"{name!r} is not a feature of {type(model).__name__}; its features are: "
                f"{', '.join(index)}"
            )
        names.append(name)
        length = getattr(feature, "length_name", None)
        if length is not None and length in index:
            names.append(length)
    spans = sorted({tuple(index[name]) for name in names})
    return [f"{argument}[:, {start}:{stop}]" for start, stop in spans]
