"""Differential tests: every zoo model, compiled, equals the original model on ragged batches.

The oracle is the original eager model on replicated inputs; it knows nothing about roles or
passes. Each model is compiled once per option set (module-scoped fixture) from a small example
batch and then called on batches of other shapes, in both calling conventions.
"""

from __future__ import annotations

import pytest
import torch
from models_for_tests import (
    OPTION_IDS,
    OPTION_SETS,
    OPTIONS,
    ZOO_EXAMPLE_COUNTS,
    ZOO_NAMES,
    assert_outputs_match,
    eager,
    key,
    with_index,
    zoo_compiled,
    zoo_model,
    zoo_pipeline,
)
from torch.utils import _pytree as pytree

from models_zoo import ZOO, Batch
from rocs_compiler.ir.roles import Role

# (counts per request, shuffle the candidate order)
BATCHES = {
    "ragged_shuffled": ([3, 1, 5], True),
    "one_request_one_candidate": ([1], False),
    "one_request_six_candidates": ([6], False),
    "ragged5_shuffled": ([2, 2, 1, 4, 1], True),
    "larger_than_example": ([9, 4, 11, 1, 7, 3], True),
}
assert sum(BATCHES["larger_than_example"][0]) > sum(ZOO_EXAMPLE_COUNTS)


@pytest.fixture(
    scope="module",
    params=[(n, i) for n in ZOO_NAMES for i in range(len(OPTION_SETS))],
    ids=[f"{n}-{OPTION_IDS[i]}" for n in ZOO_NAMES for i in range(len(OPTION_SETS))],
)
def compiled(request):
    name, i = request.param
    return ZOO[name], zoo_model(name), zoo_compiled(name, key(OPTION_SETS[i]))


def _batch(entry, name: str, seed: int = 7) -> Batch:
    counts, shuffle = BATCHES[name]
    return entry.make_batch(counts, seed=seed, shuffle=shuffle)


@pytest.mark.parametrize("batch_name", list(BATCHES))
def test_shared_layout(compiled, batch_name):
    entry, model, cm = compiled
    batch = _batch(entry, batch_name)
    expected = eager(model, batch.replicated())
    got = cm(**batch.kwargs, candidate_to_request=batch.candidate_to_request)
    assert_outputs_match(got, expected, f"{entry.name} {batch_name} shared layout")


@pytest.mark.parametrize("batch_name", list(BATCHES))
def test_dropin_layout(compiled, batch_name):
    entry, model, cm = compiled
    batch = _batch(entry, batch_name)
    replicated = batch.replicated()
    expected = eager(model, replicated)
    got = cm(**replicated)
    assert_outputs_match(got, expected, f"{entry.name} {batch_name} drop-in")


def test_call_replicated_with_a_known_grouping(compiled):
    entry, model, cm = compiled
    batch = _batch(entry, "ragged_shuffled")
    expected = eager(model, batch.replicated())
    got = cm.call_replicated(**batch.replicated(), candidate_to_request=batch.candidate_to_request)
    assert_outputs_match(got, expected, f"{entry.name} call_replicated")


def test_repeated_user_not_contiguous(compiled):
    """Requests 0 and 1 come back later in the batch: drop-in forms separate requests."""
    entry, model, cm = compiled
    base = entry.make_batch([3, 3, 2], seed=11)
    index = torch.tensor([0, 0, 1, 1, 0, 2, 0, 1])
    batch = with_index(base, index)
    expected = eager(model, batch.replicated())
    assert_outputs_match(cm(**batch.replicated()), expected, f"{entry.name} drop-in, repeats")
    got = cm(**batch.kwargs, candidate_to_request=index)
    assert_outputs_match(got, expected, f"{entry.name} shared layout, repeats")


def test_output_structure(compiled):
    entry, model, cm = compiled
    batch = _batch(entry, "ragged_shuffled")
    expected = eager(model, batch.replicated())
    for got in (
        cm(**batch.kwargs, candidate_to_request=batch.candidate_to_request),
        cm(**batch.replicated()),
    ):
        assert type(got) is type(expected)
        assert pytree.tree_structure(got) == pytree.tree_structure(expected)
        if isinstance(expected, dict):
            assert list(got) == list(expected), "dict keys (and their order) are preserved"
        if isinstance(expected, (tuple, list)):
            assert len(got) == len(expected)


def _tensors(out) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _request_only_outputs(name: str) -> list[int]:
    """Positions (among the tensor output leaves) of outputs that are REQUEST in the analysis."""
    result = zoo_pipeline(name, key(OPTIONS))
    output = next(n for n in result.logical_graph.graph.nodes if n.op == "output")
    leaves = pytree.tree_leaves(output.args[0])
    return [i for i, n in enumerate(leaves) if n.meta["rocs_role"] == Role.REQUEST]


def test_some_zoo_model_has_a_request_only_output():
    """Keeps the next test from being vacuous: two_tower returns the user embedding."""
    assert _request_only_outputs("two_tower"), "two_tower's user_emb should be request-only"


def test_request_only_outputs_have_candidate_rows(compiled):
    entry, model, cm = compiled
    positions = _request_only_outputs(entry.name)
    batch = _batch(entry, "ragged_shuffled")  # R = 3, N = 9
    expected = _tensors(eager(model, batch.replicated()))
    got = _tensors(cm(**batch.kwargs, candidate_to_request=batch.candidate_to_request))
    for i in positions:
        assert got[i].shape[0] == batch.num_candidates
        assert torch.allclose(got[i], expected[i], rtol=1e-4, atol=1e-5)
