"""The padded stand-in for a ``KeyedJaggedTensor`` inside a compiled model: every key as
rows ``ids [B, W]``, ``lengths [B]`` (and ``weights [B, W]``), which row-wise analysis can
split by request (``kjt.py`` builds them, ``kjt_pooling.py`` and ``kjt_sequences.py`` read
them)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import CompileError


@dataclass
class PaddedKey:
    """One key's rows: ids ``[B, W]`` (anything past a row's length), lengths ``[B]``, and
    weights ``[B, W]`` or None. A call pads them to the batch's longest row (``kjt.py``), so
    ``W`` is that row's length whenever one row holds an id. ``read_whole``: where the key's
    name goes when the model reads the rows at ``W`` (``kjt_sequences.py``)."""

    ids: torch.Tensor
    lengths: torch.Tensor
    weights: torch.Tensor | None = None
    name: str = ""
    read_whole: set[str] | None = field(default=None, repr=False, compare=False)

    def mark_read_whole(self) -> None:
        if self.read_whole is not None:
            self.read_whole.add(self.name)


class PaddedKJT:
    """Stands in for a ``KeyedJaggedTensor`` inside the compiled model: its keys as padded rows.

    Only the collections of :func:`with_padded_lookups` read it; any other use of the KJT in
    the model's forward is refused with the attribute it asked for.
    """

    def __init__(self, keys: dict[str, PaddedKey]):
        self._keys = keys

    def keys(self) -> list[str]:
        return list(self._keys)

    def key(self, name: str) -> PaddedKey:
        if name not in self._keys:
            raise CompileError(
                f"the model looks up the feature {name!r}, which its KeyedJaggedTensor input "
                f"does not have (its keys: {', '.join(self._keys)})"
            )
        return self._keys[name]

    def __getitem__(self, key):
        raise CompileError(
            f"the model reads its KeyedJaggedTensor input by key ([{key!r}]) outside an "
            "EmbeddingBagCollection; rocs compiles KeyedJaggedTensor inputs whose keys torchrec's "
            "EmbeddingBagCollection or EmbeddingCollection look up"
        )

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise CompileError(
            f"the model reads its KeyedJaggedTensor input other than through an "
            f"EmbeddingBagCollection (it asked for .{name}); rocs compiles KeyedJaggedTensor "
            "inputs whose keys torchrec's EmbeddingBagCollection or EmbeddingCollection look up"
        )
