"""TorchRec's unpooled lookups (``EmbeddingCollection``) over padded, per-row features.

``EmbeddingCollection`` returns each key's embeddings as a ``JaggedTensor`` (one row of ``D`` per
id); sequence models read it back as dense rows with ``to_padded_dense(desired_length,
padding_value)``. Over :class:`~.kjt_padded.PaddedKJT` the collection returns
:class:`PaddedEmbeddings` instead: the embeddings of the padded ids ``[B, W, D]`` with the rows'
lengths, and ``to_padded_dense`` is computed from them row by row.

Identity, for row i of ``n_i`` ids ``x_ij`` padded to width ``W`` and ``L = desired_length``::

    to_padded_dense(L, p)[i, j] = E[x_ij] if j < min(n_i, L) else p
                                = cat([where(j < n_i, E[ids_ij], p), p...], 1)[i, j]  (j < L)

the second line padding every row with ``L`` more columns of ``p`` and keeping the first ``L``:
no branch on ``W``, a size that changes between calls. A reading without ``desired_length``
pads to the batch's longest row, ``max_i n_i``: a call pads every key's rows to exactly that
width (``kjt.py``; in the shared layout the request rows' longest is the replicated rows'), so
it is the rows at ``W``, with ``p`` past each row's length. Where every row is empty TorchRec
gives no columns and the program one (its widths start at 1): that call is refused, naming the
key. A reading through the flat ``values()`` is refused: it is not a function of one row.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import CompileError
from .kjt_padded import PaddedKey, PaddedKJT


class PaddedEmbeddings:
    """One key's unpooled embeddings, ``[B, W, D]`` (rows past a row's length are not its own),
    in place of TorchRec's ``JaggedTensor``."""

    def __init__(self, embeddings: torch.Tensor, key: PaddedKey):
        self._embeddings = embeddings
        self._key = key

    def lengths(self) -> torch.Tensor:
        return self._key.lengths

    def to_padded_dense(self, desired_length=None, padding_value: float = 0.0) -> torch.Tensor:
        """``JaggedTensor.to_padded_dense``: ``[B, desired_length, D]``."""
        emb, lengths = self._embeddings, self._key.lengths
        positions = torch.arange(self._key.ids.shape[1], device=lengths.device)
        valid = (positions < lengths.unsqueeze(1)).unsqueeze(2)
        fill = torch.full((), padding_value, dtype=emb.dtype, device=emb.device)
        rows = torch.where(valid, emb, fill)
        if desired_length is None:  # the batch's longest row: the width the call padded to
            self._key.mark_read_whole()
            return rows
        padded = torch.nn.functional.pad(rows, (0, 0, 0, desired_length), value=padding_value)
        return padded[:, :desired_length]

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise CompileError(
            f"the model reads an EmbeddingCollection's JaggedTensor through .{name}(); rocs "
            "compiles reads of its rows: to_padded_dense(desired_length=None or a length) and "
            "lengths()"
        )


class PaddedEmbeddingCollection(nn.Module):
    """An ``EmbeddingCollection`` that takes :class:`PaddedKJT`: ``{name: PaddedEmbeddings}``
    under the original's embedding names."""

    def __init__(self, collection: nn.Module):
        super().__init__()
        self.collection = collection
        if collection.need_indices():
            raise CompileError(
                "EmbeddingCollection(need_indices=True) hands the model the flat ids; rocs "
                "compiles collections without it"
            )
        for name, table in collection.embeddings.items():
            if table.padding_idx is not None or table.max_norm is not None:
                raise CompileError(
                    f"Embedding {name!r} has padding_idx or max_norm set; rocs looks up "
                    "TorchRec's own tables, which set neither"
                )

    def forward(self, features):
        if not isinstance(features, PaddedKJT):
            return self.collection(features)
        collection = self.collection
        out = {}
        tables = zip(
            collection.embedding_configs(),
            collection.embedding_names_by_table(),
            collection.embeddings.values(),
        )
        for config, names, table in tables:
            for feature, name in zip(config.feature_names, names):
                key = features.key(feature)
                rows = torch.nn.functional.embedding(key.ids, table.weight).float()
                out[name] = PaddedEmbeddings(rows, key)
        return out
