"""Shared calls through the torch.compile door's settled path (``backend/settled_shared.py``):
a variant whose shared program always runs is called without the compiled model's call path,
exact on ragged batches, following weight and scalar updates, and handing every call it cannot
vouch for (one request per candidate, grad mode) back to the call path, which checks it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

import rocs_compiler as rocs
from rocs_compiler.backend import settled_shared
from rocs_compiler.formats.leaves import GRAPH_OUTPUT
from rocs_compiler.runtime.call import path
from models_zoo import request_index

TOLERANCE = 1e-4


class _Ranker(nn.Module):
    """A user tower and a history at request rows, an item tower, a mixing matrix computed from a
    parameter alone (a constant rocs folds once per weight version), and a float scale read in
    forward (traced as a constant dynamo guards: a changed one compiles anew)."""

    def __init__(self):
        super().__init__()
        self.user = nn.Sequential(nn.Linear(12, 64), nn.ReLU(), nn.Linear(64, 16))
        self.items = nn.Embedding(500, 16)
        self.head = nn.Sequential(nn.Linear(48, 64), nn.ReLU(), nn.Linear(64, 1))
        self.mix = nn.Parameter(torch.randn(16, 16) / 4)
        self.scale = 3.0

    def forward(self, user_dense, history, item_id):
        user = self.user(user_dense) @ torch.tanh(self.mix)
        hist = self.items(history).mean(1)
        item = self.items(item_id)
        return self.scale * self.head(torch.cat([user, hist * user, item * user], -1)).squeeze(-1)


def _batch(counts, seed):
    g = torch.Generator().manual_seed(seed)
    index = request_index(counts)
    index = index[torch.randperm(len(index), generator=g)]
    shared = {
        "user_dense": torch.randn(len(counts), 12, generator=g),
        "history": torch.randint(0, 500, (len(counts), 20), generator=g),
        "item_id": torch.randint(0, 500, (len(index),), generator=g),
    }
    replicated = {**shared, "user_dense": shared["user_dense"][index],
                  "history": shared["history"][index]}  # fmt: skip
    return shared, replicated, index


@pytest.fixture
def door():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Ranker().eval()
    backend = rocs.backend(["user_dense", "history"])
    yield model, backend, torch.compile(model, backend=backend, dynamic=True)
    torch._dynamo.reset()


@pytest.fixture
def settled_calls(monkeypatch):
    """Counts the calls the settled path ran and those that reached the call path."""
    counts = {"settled": 0, "call_path": 0}
    run_settled, forward = settled_shared.SettledShared.__call__, path._forward

    def counted_settled(self, *args):
        out = run_settled(self, *args)
        counts["settled"] += out is not None
        return out

    def counted_forward(*args, **kwargs):
        counts["call_path"] += 1
        return forward(*args, **kwargs)

    monkeypatch.setattr(settled_shared.SettledShared, "__call__", counted_settled)
    monkeypatch.setattr(path, "_forward", counted_forward)
    return counts


def _check(model, compiled, counts, seed):
    shared, replicated, index = _batch(counts, seed)
    want = model(**replicated)
    got = rocs.shared_call(compiled, **shared, candidate_to_request=index)
    torch.testing.assert_close(got, want, rtol=TOLERANCE, atol=TOLERANCE)
    assert want.std() > 100 * TOLERANCE, "outputs too flat to tell a wrong answer"


def test_shared_calls_skip_the_call_path_and_stay_exact(door, settled_calls):
    model, backend, compiled = door
    with torch.no_grad():
        _check(model, compiled, [3, 1, 5], seed=1)
        first = dict(settled_calls)
        for seed, counts in enumerate([[7], [2, 9, 1, 4], [1, 2], [30, 2, 11], [5, 5, 5]]):
            _check(model, compiled, counts, seed=10 + seed)
    (variant,) = [v for s in backend.subgraphs for v in s.variants.values()]
    assert variant.settled is not None
    assert settled_calls["settled"] - first["settled"] == 5
    assert settled_calls["call_path"] == first["call_path"], "a settled call took the call path"


def test_settled_calls_follow_weight_updates_and_new_scalars(door, settled_calls):
    model, _, compiled = door
    with torch.no_grad():
        _check(model, compiled, [3, 4], seed=2)
        model.user[0].weight.mul_(1.5)  # in place: a new version of the same tensor
        _check(model, compiled, [3, 4], seed=3)
        model.mix.mul_(-2.0)  # read through a constant folded from it
        _check(model, compiled, [3, 4], seed=3)
        model.head[2].weight = nn.Parameter(torch.randn_like(model.head[2].weight))  # a new tensor
        _check(model, compiled, [2, 6, 1], seed=4)
        model.scale = -0.5
        _check(model, compiled, [2, 6, 1], seed=5)
        _check(model, compiled, [4, 1], seed=6)
    assert settled_calls["settled"] >= 1


def test_calls_the_settled_path_cannot_vouch_for_take_the_call_path(door, settled_calls):
    model, _, compiled = door
    with torch.no_grad():
        for seed in range(2):
            _check(model, compiled, [3, 2, 4], seed=seed)
        # One request per candidate: accepted when the index is a permutation.
        _check(model, compiled, [1, 1, 1, 1], seed=7)
        shared, _, index = _batch([1, 1, 1, 1], seed=8)
        with pytest.raises(rocs.InputError, match="groups candidates into fewer requests"):
            rocs.shared_call(compiled, **shared, candidate_to_request=torch.tensor([0, 0, 1, 2]))
        shared, _, index = _batch([2, 3], seed=9)
        bad = index.clone()
        bad[1] = 2
        with pytest.raises(rocs.InputError, match=r"\[0, 2\)"):
            rocs.shared_call(compiled, **shared, candidate_to_request=bad)
    calls = settled_calls["call_path"]
    shared, replicated, index = _batch([2, 3], seed=11)
    out = rocs.shared_call(compiled, **shared, candidate_to_request=index)  # grad mode
    assert settled_calls["call_path"] == calls + 1
    torch.testing.assert_close(out, model(**replicated), rtol=TOLERANCE, atol=TOLERANCE)


def test_inputs_of_any_layout_stay_exact_without_inductors_input_asserts(door, settled_calls):
    """The lowered graph's Inductor code does not assert its inputs' sizes and strides
    (``backend/lowering.py``): strided views, views at an offset and transposed copies reach it
    with the strides it was compiled for, or compile anew."""
    model, _, compiled = door
    with torch.no_grad():
        _check(model, compiled, [3, 1, 5], seed=20)
        for seed, counts in enumerate([[2, 4], [6, 1, 3], [1, 1, 2, 5]]):
            shared, replicated, index = _batch(counts, seed=21 + seed)
            wide = torch.randn(len(counts), 24)
            wide[:, ::2] = shared["user_dense"]
            long = torch.randint(0, 500, (len(counts) + 1, 20))
            long[1:] = shared["history"]
            spaced = torch.randint(0, 500, (2 * len(index),))
            spaced[::2] = shared["item_id"]
            views = {
                "user_dense": wide[:, ::2],  # every other column
                "history": long[1:],  # contiguous, one row into its storage
                "item_id": spaced[::2],  # a row stride of 2
            }
            assert not views["user_dense"].is_contiguous() and views["history"].storage_offset()
            got = rocs.shared_call(compiled, **views, candidate_to_request=index)
            torch.testing.assert_close(got, model(**replicated), rtol=TOLERANCE, atol=TOLERANCE)
    assert settled_calls["settled"] >= 3


def test_a_flat_list_of_graph_outputs_is_returned_as_the_graph_returns_it(door, settled_calls):
    model, backend, compiled = door
    with torch.no_grad():
        _check(model, compiled, [5, 1, 9], seed=3)
        _check(model, compiled, [2, 8], seed=4)
    assert settled_calls["settled"] >= 1
    settled = [v.settled for s in backend.subgraphs for v in s.variants.values() if v.settled]
    assert settled and all(s._flat_outputs for s in settled)  # dynamo's graphs return a tuple

    def contract(outputs, constants):
        return SimpleNamespace(out_spec=pytree.tree_flatten(outputs)[1], out_constants=constants)

    x = torch.zeros(1)
    assert settled_shared._flat(contract([x, x], [GRAPH_OUTPUT] * 2))
    assert settled_shared._flat(contract((x,), [GRAPH_OUTPUT]))
    assert not settled_shared._flat(contract([x, x], [GRAPH_OUTPUT, 3]))  # a constant output
    assert not settled_shared._flat(contract([[x], x], [GRAPH_OUTPUT] * 2))  # a nested list
    assert not settled_shared._flat(contract({"a": x}, [GRAPH_OUTPUT]))  # a dict
    assert not settled_shared._flat(contract(x, [GRAPH_OUTPUT]))  # a single tensor
