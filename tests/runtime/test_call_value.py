"""One call, one value (``runtime/call/bound.py``): a call's index is range-checked once, whatever
lanes it passes through, and in one place of the runtime; a value out of range is still refused,
naming it, on every path."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import rocs_compiler as rocs
from rocs_compiler.kernels.index_contract import IndexRangeError
from rocs_compiler.runtime.call import bound
from rocs_compiler.runtime.choice.program_choice import PLAIN, SHARED, bucket

RUNTIME = Path(rocs.__file__).parent / "runtime"
FIELDS = (10, 5, 20, 30)  # two user fields, two item fields


class PackedLR(nn.Module):
    """A logistic regression over one packed ``x``: request columns 0:2, candidate columns 2:4."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Embedding(sum(FIELDS), 4)
        self.out = nn.Linear(4, 1)
        self.offsets = np.array((0, *np.cumsum(FIELDS)[:-1]), dtype=np.int64)

    def forward(self, x):
        ids = x + x.new_tensor(self.offsets).unsqueeze(0)
        return self.out(torch.relu(self.fc(ids).sum(1))).squeeze(1)


def _draw(counts, seed=0):
    g = torch.Generator().manual_seed(seed)
    index = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    user = torch.stack([torch.randint(0, v, (len(counts),), generator=g) for v in FIELDS[:2]], 1)
    item = torch.stack([torch.randint(0, v, (sum(counts),), generator=g) for v in FIELDS[2:]], 1)
    return torch.cat([user[index], item], 1), index


@pytest.fixture
def range_reads(monkeypatch):
    """How many times the runtime read an index's values for its range."""
    reads = []
    real = bound.index_bounds

    def counted(index):
        reads.append(index.shape[0])
        return real(index)

    monkeypatch.setattr(bound, "index_bounds", counted)
    return reads


@pytest.mark.parametrize("program", [SHARED, PLAIN])
def test_a_packed_call_reads_its_index_once_through_every_check(range_reads, program):
    """A packed input's request columns come with one row per candidate: the call's checks ask
    for the index's range as the settled lane looks up its bucket, as the format's program call
    finds its bucket, as the columns are reduced and as the shared layout is checked (four reads
    in a shared bucket before the call became one value); it is read once."""
    torch.manual_seed(0)
    model = PackedLR().eval()
    x, index = _draw([2, 3], seed=1)
    cm = rocs.compile(model, ["x[:, 0:2]"], example_kwargs={"x": x})
    counts = [4, 1, 3]
    x, index = _draw(counts, seed=2)
    cm._choice.settle(bucket("shared", sum(counts), len(counts)), program)
    with torch.no_grad():
        want = model(x)
        range_reads.clear()
        got = cm(x=x, candidate_to_request=index)
    assert len(range_reads) <= 1, range_reads
    assert want.std() > 1e-2  # outputs that vary across rows far more than the tolerance
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("program", [SHARED, PLAIN])
def test_an_index_out_of_range_is_refused_on_every_lane(program):
    torch.manual_seed(0)
    model = PackedLR().eval()
    x, _ = _draw([2, 3], seed=1)
    cm = rocs.compile(model, ["x[:, 0:2]"], example_kwargs={"x": x})
    counts = [2, 2]
    x, index = _draw(counts, seed=3)
    cm._choice.settle(bucket("shared", sum(counts), len(counts)), program)
    with torch.no_grad(), pytest.raises(IndexRangeError, match=r"got values in \[-1, 1\]"):
        cm(x=x, candidate_to_request=torch.tensor([0, 0, 1, -1]))


def test_a_call_keeps_the_range_it_found():
    call = bound.Call((), {}, torch.tensor([0, 2, 1]))
    assert call.requests_reached(3) == 3
    assert call.requests_reached(5) == 3  # a wider bound holds without reading again
    with pytest.raises(IndexRangeError, match=r"\[0, 2\).*\[0, 2\]"):
        call.requests_reached(2)
    assert bound.Call((), {}, torch.tensor([], dtype=torch.int64)).requests_reached(0) == 0
    with pytest.raises(IndexRangeError):
        bound.Call((), {}, torch.tensor([3])).requests_reached(3)


def test_the_runtime_reads_an_index_range_in_one_place():
    """Only ``bound.py`` reads an index's values for its range in ``runtime/``."""
    readers = set()
    for path in RUNTIME.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                if name in {"index_bounds", "check_index_range"}:
                    readers.add(path.relative_to(RUNTIME).as_posix())
                if name == "check_candidate_to_request" and len(node.args) > 2:
                    third = node.args[2]
                    if not (isinstance(third, ast.Constant) and third.value is None):
                        readers.add(path.relative_to(RUNTIME).as_posix())
    assert readers == {"call/bound.py"}
