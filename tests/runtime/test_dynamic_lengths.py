"""A history length that changes between calls (the first step of "histories of any length"): an
example whose history dims are marked dynamic (``torch._dynamo.mark_dynamic``) compiles into one
graph that serves every length, exact against the original model in both layouts on ragged
batches, for inference and training compiles; sizes the graph ties together are checked at call
time and refused naming the inputs (``runtime/call/input_checks.py``)."""

from __future__ import annotations

import pytest
import torch

import rocs_compiler as rocs
from models_zoo import din
from rocs_compiler.errors import InputError

from dynamic_histories import (
    assert_eagers_gradients,
    at_length,
    din_model,
    marked_example,
    replicated,
)

LENGTHS = (1, 2, 3, 5, 8, 13, 21, 34, 50, 77, 128)  # DIN reads any length: no table caps it


@pytest.fixture(scope="module")
def compiled():
    model = din_model()
    return model, rocs.compile(model, list(din.REQUEST_INPUTS), example_kwargs=marked_example())


@pytest.mark.parametrize("layout", ["shared", "dropin"])
def test_one_compile_serves_every_history_length(compiled, layout):
    model, cm = compiled
    runners = set()
    with torch.no_grad():
        for i, length in enumerate(LENGTHS):
            batch = din.make_batch([3, 1, 5, 2][: 1 + i % 4], seed=i, shuffle=True)
            kwargs = at_length(batch, length, seed=i)
            index = batch.candidate_to_request
            as_replicated = replicated(kwargs, index)
            want = model(**as_replicated)
            got = cm(**kwargs, candidate_to_request=index) if layout == "shared" else cm(**as_replicated)
            assert want.std() > 1e-2 or want.numel() < 2
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"length {length}")
            runners.add((id(cm._runner), id(cm._plain._runner)))
    # One program for every length: neither the shared nor the plain program was built again
    # after the first call that ran it (None, until a lane first runs, then the one program).
    assert len({shared for shared, _ in runners} - {id(None)}) <= 1
    assert len({plain for _, plain in runners} - {id(None)}) <= 1
    assert runners != {(id(None), id(None))}


def test_histories_that_disagree_on_their_length_are_refused_naming_both(compiled):
    _, cm = compiled
    batch = din.make_batch([2, 3], seed=1)
    kwargs = at_length(batch, 6, seed=1)
    kwargs["hist_cat_ids"] = kwargs["hist_cat_ids"][:, :4]
    with torch.no_grad(), pytest.raises(InputError, match=r"'hist_item_ids' dim 1: 6.*'hist_cat_ids' dim 1: 4"):
        cm(**kwargs, candidate_to_request=batch.candidate_to_request)
    with torch.no_grad(), pytest.raises(InputError, match="hist_cat_ids"):
        cm(**replicated(kwargs, batch.candidate_to_request))


def test_a_dim_the_example_did_not_mark_is_fixed_by_the_model_or_compiled_again():
    """A width the model fixes is refused naming the input; the compile keeps serving its marked
    lengths (another size past the batch dim: ``test_new_sizes.py``)."""
    model = din_model()
    cm = rocs.compile(model, list(din.REQUEST_INPUTS), example_kwargs=marked_example())
    batch = din.make_batch([2, 3], seed=2)
    kwargs = at_length(batch, 6, seed=2)
    index = batch.candidate_to_request
    kwargs["item_id"] = torch.stack([kwargs["item_id"]] * 2, 1)
    with torch.no_grad(), pytest.raises(InputError, match=r"'item_id' has shape \(5, 2\)"):
        cm(**kwargs, candidate_to_request=index)
    kwargs = at_length(batch, 9, seed=2)
    with torch.no_grad():
        torch.testing.assert_close(cm(**kwargs, candidate_to_request=index), model(**replicated(kwargs, index)))
    assert cm._growth is not None and not cm._growth._fixed  # no compile again: no new size


@pytest.mark.parametrize("marked", [True, False], ids=["marked", "unmarked"])
@pytest.mark.parametrize("layout", ["shared", "dropin"])
def test_a_training_compile_gives_eagers_gradients_at_every_length(layout, marked):
    """Unmarked, the first call (length 2) compiles the model again with its length dynamic
    (``runtime/modes/new_sizes.py``); every later length runs that training program."""
    model = din_model()
    example = marked_example() if marked else din.make_batch([4, 3]).replicated()
    cm = rocs.compile(model, list(din.REQUEST_INPUTS), example_kwargs=example, training=True)
    twin = din_model()
    for i, length in enumerate((2, 9, 50, 70)):
        batch = din.make_batch([4, 1, 3], seed=10 + i, shuffle=True)
        kwargs = at_length(batch, length, seed=10 + i)
        index = batch.candidate_to_request
        as_replicated = replicated(kwargs, index)
        model.zero_grad(), twin.zero_grad()
        want = twin(**as_replicated)
        got = cm(**kwargs, candidate_to_request=index) if layout == "shared" else cm(**as_replicated)
        assert_eagers_gradients(model, twin, got, want, f"at {length}")
        moved = [p for p in twin.parameters() if p.grad is not None and p.grad.abs().max() > 1e-4]
        assert len(moved) > 4, "the gradients barely move"


def test_a_length_the_model_fixes_is_refused_at_compile_time_with_the_line_that_fixes_it():
    """BST adds its positional table whole (L + 1 rows) and its head reads the flattened
    positions, a width fixed at L + 1 (the zoo's models that take any length up to a cap:
    ``test_zoo_history_lengths.py``)."""
    from models_zoo import bst

    example = bst.make_batch([4, 3]).replicated()
    torch._dynamo.mark_dynamic(example["hist_item_ids"], 1)
    fixed = r"(?s)self\.position.*specialized it to be a constant \(20\)"
    with pytest.raises(rocs.CompileError, match=fixed):
        rocs.compile(bst.build().eval(), list(bst.REQUEST_INPUTS), example_kwargs=example)


def test_the_cost_model_counts_a_marked_length_at_the_examples_value(compiled):
    """FLOPs per request and per candidate are counted at two batch sizes; a length marked
    dynamic keeps the example's value there (it was counted at the batch sizes, 2 and 4, which
    made the program choice's prior and the report wrong by a factor of five on DIN)."""
    model, cm = compiled
    example = din.make_batch([4, 3]).replicated()  # the marked example's sizes, nothing marked
    static = rocs.compile(model, list(din.REQUEST_INPUTS), example_kwargs=example)
    assert cm._unit_flops_of() == static._unit_flops_of()
    dynamic, fixed = cm.report(candidates=64, requests=2), static.report(candidates=64, requests=2)
    assert dynamic.request_flops == fixed.request_flops > 0
    assert dynamic.candidate_flops == fixed.candidate_flops > 0


def test_the_report_counts_flops_per_request_at_a_given_history_length(compiled):
    """DIN's request side (its attention unit over the history) grows linearly with the length;
    its candidate side too (the unit scores each candidate against every position)."""
    _, cm = compiled
    at = {length: cm.report(candidates=64, requests=2, lengths={"hist_item_ids": length})
          for length in (10, 20, 40)}  # fmt: skip
    for side in ("request_flops", "candidate_flops"):
        step = getattr(at[20], side) - getattr(at[10], side)
        assert step > 0
        assert getattr(at[40], side) - getattr(at[20], side) == pytest.approx(2 * step)
    assert at[40].lengths == {"hist_item_ids": 40}
    grows = {n.name for n in at[40].nodes if n.grows}
    assert grows and grows < {n.name for n in at[40].nodes if n.flops > 0}
    assert "history lengths    : hist_item_ids=40" in at[40].summary()
    assert "grows with length" in at[40].to_html() and at[40].to_dict()["lengths"] == {
        "hist_item_ids": 40
    }
    with pytest.raises(ValueError, match="'item_id' has no dynamic length"):
        cm.report(lengths={"item_id": 3})
    with pytest.raises(ValueError, match="have one length"):
        cm.report(lengths={"hist_item_ids": 3, "hist_cat_ids": 4})


def test_a_bag_whose_reshape_merges_the_batch_with_a_dynamic_length_runs_per_candidate():
    """two_tower pools its history with ``embedding_bag`` over ids flattened to ``[B * L]``: with
    the length marked dynamic, the batch axis of that reshape cannot be read (the rule crashed on
    the unknown product and failed the compile). The node now runs per candidate, named in the
    report, and the model is exact at every length in both layouts."""
    from models_zoo import get_entry

    entry = get_entry("two_tower")
    model = entry.build().eval()
    example = entry.make_batch([4, 3]).replicated()
    torch._dynamo.mark_dynamic(example["hist_item_ids"], 1)
    cm = rocs.compile(model, list(entry.request_inputs), example_kwargs=example)
    fallbacks = {f.node: f.reason for f in cm.report().fallbacks}
    assert fallbacks.get("reshape") == "reshape mixes the batch with a dynamic size", fallbacks
    with torch.no_grad():
        for length, counts in ((1, [4, 1]), (10, [3, 1, 5]), (80, [2, 2])):
            batch = entry.make_batch(counts, seed=length, shuffle=True)
            generator = torch.Generator().manual_seed(length)
            kwargs = dict(batch.kwargs)
            shape = (len(counts), length)
            kwargs["hist_item_ids"] = torch.randint(0, 1000, shape, generator=generator)
            index = batch.candidate_to_request
            dropin = {n: v[index] if n in entry.request_inputs else v for n, v in kwargs.items()}
            want = model(**dropin)
            assert (want["score"] - want["score"][0]).abs().max() > 0.1, "scores barely vary"
            for got in (cm(**kwargs, candidate_to_request=index), cm(**dropin)):
                for key in want:
                    torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-5)


def test_the_report_counts_flops_over_a_distribution_of_history_lengths(compiled):
    """Each request's length given: FLOPs per request and per candidate are the mean over the
    requests of the counts at each one's length (DIN's both grow linearly: the mean length's)."""
    _, cm = compiled
    spread = [30] * 63 + [2048]
    mean = sum(spread) / len(spread)
    at = cm.report(candidates=8, requests=64, lengths={"hist_item_ids": spread})
    low = cm.report(candidates=8, requests=64, lengths={"hist_item_ids": 30})
    high = cm.report(candidates=8, requests=64, lengths={"hist_item_ids": 2048})
    for side in ("request_flops", "candidate_flops"):
        want = (63 * getattr(low, side) + getattr(high, side)) / 64
        assert getattr(at, side) == pytest.approx(want)
        assert getattr(low, side) < getattr(at, side) < getattr(high, side)
    assert f"mean {mean:.1f} over 64 requests (max 2048)" in at.summary()
    assert at.to_dict()["lengths"] == {"hist_item_ids": spread}
    tied = cm.report(lengths={"hist_item_ids": spread, "hist_cat_ids": torch.tensor(spread)})
    assert tied.request_flops == pytest.approx(at.request_flops)
    with pytest.raises(ValueError, match="one length per request"):
        cm.report(lengths={"hist_item_ids": [1, 2], "hist_cat_ids": [1, 2, 3]})
    with pytest.raises(ValueError, match="non-negative"):
        cm.report(lengths={"hist_item_ids": [3, -1]})
