"""The model zoo: registry contract, batch layouts, determinism, eager forward and export."""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree

import models_zoo
from models_zoo import ZOO, Batch, get_entry, names, request_index
from models_zoo.batch import get_leaf

ORDER = [
    "dlrm", "dcnv2", "finalmlp", "wukong", "din", "bst", "two_tower", "mmoe", "hstu",
    "target_attention",
]


def _leaf_paths(tree, prefix=""):
    """Dotted names of all tensor leaves in nested dicts."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _leaf_paths(value, f"{prefix}{key}.")
    else:
        yield prefix[:-1]


def _rows(out) -> set[int]:
    return {leaf.shape[0] for leaf in pytree.tree_leaves(out)}


def _finite(out) -> bool:
    return all(bool(torch.isfinite(leaf).all()) for leaf in pytree.tree_leaves(out))


@pytest.fixture(scope="module", params=ORDER)
def entry(request):
    return get_entry(request.param)


@pytest.fixture(scope="module")
def model(entry):
    return entry.build()


def test_registry_order_and_lookup():
    assert names() == ORDER
    assert list(ZOO) == ORDER
    assert models_zoo.Batch is Batch
    with pytest.raises(KeyError, match="dlrm"):
        get_entry("no_such_model")


def test_request_index():
    assert request_index([2, 1, 3]).tolist() == [0, 0, 1, 2, 2, 2]
    assert request_index([0, 2]).tolist() == [1, 1]
    g = torch.Generator().manual_seed(0)
    shuffled = request_index([2, 1, 3], shuffle=True, generator=g)
    assert sorted(shuffled.tolist()) == [0, 0, 1, 2, 2, 2]
    assert shuffled.dtype == torch.int64
    with pytest.raises(ValueError):
        request_index([])
    with pytest.raises(ValueError):
        request_index([1, -1])


def test_build_is_deterministic(entry, model):
    assert not model.training
    assert all(not m.training for m in model.modules())
    a, b = model.state_dict(), entry.build(seed=0).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = entry.build(seed=1).state_dict()
    assert any(not torch.equal(a[k], c[k]) for k in a if a[k].is_floating_point())


def test_batch_layout(entry):
    counts = [3, 1, 5]
    batch = entry.make_batch(counts)
    assert batch.request_inputs == entry.request_inputs
    assert batch.num_requests == 3 and batch.num_candidates == 9
    assert batch.candidate_to_request.dtype == torch.int64
    assert batch.candidate_to_request.tolist() == request_index(counts).tolist()
    paths = list(_leaf_paths(batch.kwargs))
    assert set(entry.request_inputs) < set(paths), "every model has candidate inputs too"
    for path in paths:
        rows = 3 if path in entry.request_inputs else 9
        assert get_leaf(batch.kwargs, path).shape[0] == rows, path

    again = entry.make_batch(counts)
    for path in paths:
        assert torch.equal(get_leaf(batch.kwargs, path), get_leaf(again.kwargs, path))

    rep = batch.replicated()
    for path in paths:
        leaf, shared = get_leaf(rep, path), get_leaf(batch.kwargs, path)
        assert leaf.shape[0] == 9, path
        if path in entry.request_inputs:
            assert torch.equal(leaf, shared[batch.candidate_to_request])
        else:
            assert leaf is shared
    assert all(get_leaf(batch.kwargs, p).shape[0] == 3 for p in entry.request_inputs)

    shuffled = entry.make_batch(counts, shuffle=True, seed=3)
    assert sorted(shuffled.candidate_to_request.tolist()) == [0, 0, 0, 1, 2, 2, 2, 2, 2]


@torch.no_grad()
@pytest.mark.parametrize("counts", [[3, 1, 5], [1]], ids=["ragged", "one_row"])
def test_forward(entry, model, counts):
    batch = entry.make_batch(counts, shuffle=True)
    out = model(**batch.replicated())
    assert _rows(out) == {sum(counts)}
    assert _finite(out)


@torch.no_grad()
def test_forward_is_row_wise(entry, model):
    """Each row's output depends on that row only (no batch statistics, no cross-row ops)."""
    kwargs = entry.make_batch([3, 1, 5], seed=5).replicated()
    full = model(**kwargs)
    rows = torch.tensor([6, 0])
    part = model(**pytree.tree_map(lambda t: t[rows], kwargs))
    for a, b in zip(pytree.tree_leaves(full), pytree.tree_leaves(part)):
        torch.testing.assert_close(a[rows], b, rtol=1e-5, atol=1e-5)


def test_export_dynamic_batch(entry, model):
    kwargs = entry.make_batch([3, 4], seed=2).replicated()
    n = 7
    batch = torch.export.Dim("batch")
    dynamic_shapes = pytree.tree_map(
        lambda t: {0: batch} if t.dim() > 0 and t.shape[0] == n else None, kwargs
    )
    ep = torch.export.export(model, (), kwargs, dynamic_shapes=dynamic_shapes, strict=False)
    with torch.no_grad():
        other = entry.make_batch([2, 9, 1], seed=4).replicated()
        expected, got = model(**other), ep.module()(**other)
    for a, b in zip(pytree.tree_leaves(expected), pytree.tree_leaves(got)):
        torch.testing.assert_close(a, b)
