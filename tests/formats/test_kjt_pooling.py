"""Pooling padded rows (``rocs_compiler/formats/kjt_pooling.py``) equals ``nn.EmbeddingBag`` on the
jagged rows, and a padded width marked dynamic stays symbolic through capture.

The oracle is ``torch.nn.functional.embedding_bag`` with offsets (what TorchRec's
``EmbeddingBagCollection`` calls); it knows nothing about padding. No torchrec needed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import rocs_compiler as rocs
from rocs_compiler.formats.kjt_pooling import PaddedKey, pool


def _jagged(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths)
    values = torch.randint(0, 9, (int(lengths.sum()),), generator=g)
    weights = torch.rand(values.shape[0], generator=g)
    return values, lengths, weights


def _padded(values, lengths, fill):
    width = max(int(lengths.max()), 1)
    ids = torch.full((lengths.shape[0], width), fill, dtype=values.dtype)
    rows = torch.repeat_interleave(torch.arange(lengths.shape[0]), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    ids[rows, torch.arange(values.shape[0]) - starts[rows]] = values
    return ids


# EmbeddingBag takes per-sample weights in sum mode only.
@pytest.mark.parametrize(
    "mode, weighted", [("sum", False), ("mean", False), ("max", False), ("sum", True)]
)
def test_padded_pooling_equals_embedding_bag(mode, weighted):
    table = torch.randn(10, 4)
    table[9] = float("inf")  # the padding's id: never part of a bag, so never pooled
    values, lengths, weights = _jagged([2, 0, 3, 1, 0, 4], seed=0)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)])
    want = F.embedding_bag(
        values, table, offsets, mode=mode, include_last_offset=True,
        per_sample_weights=weights if weighted else None,
    )  # fmt: skip
    key = PaddedKey(
        _padded(values, lengths, 9), lengths, _padded(weights, lengths, 0.5) if weighted else None
    )
    torch.testing.assert_close(pool(table, key, mode, weighted), want)


def test_every_bag_empty():
    table = torch.randn(10, 4)
    key = PaddedKey(torch.zeros(3, 1, dtype=torch.long), torch.zeros(3, dtype=torch.long))
    for mode in ("sum", "mean", "max"):
        assert torch.equal(pool(table, key, mode, False), torch.zeros(3, 4))


class _History(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(10, 4))
        self.out = torch.nn.Linear(4, 1)

    def forward(self, ids, lengths, item):
        pooled = pool(self.table, PaddedKey(ids, lengths), "mean", False)
        return self.out(pooled * item)


def test_a_dim_marked_dynamic_stays_symbolic():
    """Capture honours ``torch._dynamo.mark_dynamic`` on an example input: the compiled model
    takes another width for that dim, and the pooling runs once per request."""
    model = _History().eval()
    ids = torch.randint(0, 10, (4, 3))
    torch._dynamo.mark_dynamic(ids, 1)
    example = {"ids": ids, "lengths": torch.tensor([3, 3, 1, 1]), "item": torch.randn(4, 4)}
    compiled = rocs.compile(model, ["ids", "lengths"], example_kwargs=example)
    ids, lengths = torch.randint(0, 10, (2, 6)), torch.tensor([6, 0])
    index = torch.tensor([0, 0, 1, 1, 1])
    item = torch.randn(5, 4)
    with torch.no_grad():
        want = model(ids[index], lengths[index], item)
        got = compiled(ids=ids, lengths=lengths, item=item, candidate_to_request=index)
    torch.testing.assert_close(got, want)
    report = compiled.report()
    assert not report.fallbacks
    assert [n.role for n in report.nodes if n.op == "aten.embedding.default"] == ["REQUEST"]
