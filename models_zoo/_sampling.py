"""Random feature draws for example batches (shared layout, deterministic per generator)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .batch import Batch, request_index


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def ids(g: torch.Generator, rows: int, vocab: int) -> torch.Tensor:
    """int64 [rows], ids in [1, vocab): 0 is kept for padding."""
    return torch.randint(1, vocab, (rows,), generator=g)


def id_columns(g: torch.Generator, rows: int, vocabs: Sequence[int]) -> torch.Tensor:
    """int64 [rows, len(vocabs)], column j drawn from table j."""
    return torch.stack([ids(g, rows, v) for v in vocabs], dim=1)


def dense(g: torch.Generator, rows: int, dim: int) -> torch.Tensor:
    """float32 [rows, dim], standard normal (dense features arrive normalized)."""
    return torch.randn(rows, dim, generator=g)


def lengths(g: torch.Generator, rows: int, max_len: int) -> torch.Tensor:
    """int64 [rows], history lengths in [1, max_len]."""
    return torch.randint(1, max_len + 1, (rows,), generator=g)


def history(g: torch.Generator, rows: int, max_len: int, vocab: int, lens=None) -> torch.Tensor:
    """int64 [rows, max_len], ids in [1, vocab) for the first `lens[r]` positions, then 0."""
    if lens is None:
        lens = lengths(g, rows, max_len)
    seq = torch.randint(1, vocab, (rows, max_len), generator=g)
    return seq.masked_fill(torch.arange(max_len) >= lens[:, None], 0)


def make(
    counts: Sequence[int],
    g: torch.Generator,
    shuffle: bool,
    kwargs: dict,
    request_inputs: tuple[str, ...],
) -> Batch:
    """Wrap drawn features in a Batch, drawing the candidate order from `g` last."""
    return Batch(kwargs, request_index(counts, shuffle=shuffle, generator=g), request_inputs)


def sizes(counts: Sequence[int]) -> tuple[int, int]:
    """(R, N) for per-request candidate counts."""
    counts = list(counts)
    if not counts or any(c < 0 for c in counts):
        raise ValueError(f"counts must be a non-empty sequence of non-negative ints: {counts!r}")
    return len(counts), sum(counts)
