"""A history length the example did not have (``runtime/modes/new_sizes.py``): a model compiled
from an example with nothing marked dynamic compiles itself again, once, at the first call with
another length, that length dynamic; every later length runs that program, exact against the
original model in both layouts on ragged batches, up to the cap a positional table sets (training
compiles: ``test_dynamic_lengths.py``, marked and unmarked). A size the model fixes is refused naming the input and the line that
fixes it, once compiled and never again."""

from __future__ import annotations

import copy

import pytest
import torch

import rocs_compiler as rocs
from models_zoo import bst, din
from rocs_compiler.errors import InputError

from dynamic_histories import (
    CAPPED,
    at_length,
    din_model,
    histories_at_length,
    replicated,
)


def unmarked_din(model, **options):
    example = din.make_batch([4, 3]).replicated()  # histories of 50, nothing marked
    return rocs.compile(model, list(din.REQUEST_INPUTS), example_kwargs=example, **options)


class Graphs:
    """The graph module a compiled model runs after each call: how many programs it went
    through."""

    def __init__(self, cm):
        self.cm, self.seen = cm, [id(cm.graph_module)]

    def note(self):
        if self.seen[-1] != id(self.cm.graph_module):
            self.seen.append(id(self.cm.graph_module))


@pytest.mark.parametrize("layout", ["shared", "dropin", "replicated"])
def test_din_compiled_unmarked_serves_every_length_after_one_compile_again(layout):
    model = din_model()
    cm = unmarked_din(model)
    graphs = Graphs(cm)
    with torch.no_grad():
        for i, length in enumerate((50, 30, 1, 2, 77, 50, 128, 13)):
            batch = din.make_batch([3, 1, 5, 2][: 1 + i % 4], seed=i, shuffle=True)
            kwargs = at_length(batch, length, seed=i)
            index = batch.candidate_to_request
            as_replicated = replicated(kwargs, index)
            want = model(**as_replicated)
            if layout == "shared":
                got = cm(**kwargs, candidate_to_request=index)
            elif layout == "dropin":
                got = cm(**as_replicated)
            else:
                got = cm.call_replicated(**as_replicated, candidate_to_request=index)
            assert want.std() > 1e-2 or want.numel() < 2
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"length {length}")
            graphs.note()
    assert len(graphs.seen) == 2  # the example's program, then the one of every length
    report = cm.report(candidates=64, requests=2, lengths={"hist_item_ids": 40})
    assert report.lengths == {"hist_item_ids": 40} and any(n.grows for n in report.nodes)


@pytest.mark.parametrize("name", sorted(CAPPED))
def test_a_capped_model_compiled_unmarked_serves_every_length_up_to_its_cap(name):
    zoo = CAPPED[name]
    model = zoo.model()
    example = zoo.module.make_batch([4, 3]).replicated()
    cm = rocs.compile(model, list(zoo.module.REQUEST_INPUTS), example_kwargs=example)
    graphs = Graphs(cm)
    with torch.no_grad():
        for i, length in enumerate(zoo.lengths()):
            kwargs, index, as_replicated = zoo.call(length, seed=i)
            want = model(**as_replicated)
            got = cm(**kwargs, candidate_to_request=index) if i % 2 else cm(**as_replicated)
            assert want.std() > 1e-1 or want.numel() < 2
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"length {length}")
            graphs.note()
        assert len(graphs.seen) == 2
        kwargs, index, _ = zoo.call(zoo.cap + 1, seed=3)
        with pytest.raises(InputError, match=rf"size {zoo.cap + 1} at dim 1.*at most {zoo.cap}"):
            cm(**kwargs, candidate_to_request=index)


def test_a_length_the_model_fixes_is_refused_with_the_line_once_compiled_and_then_at_once():
    """BST adds its positional table whole: another length fails to compile, naming the line."""
    model = bst.build().eval()
    cm = rocs.compile(
        model, list(bst.REQUEST_INPUTS), example_kwargs=bst.make_batch([4, 3]).replicated()
    )
    batch = bst.make_batch([2, 3])
    kwargs = dict(batch.kwargs, hist_item_ids=batch.kwargs["hist_item_ids"][:, :10])
    fixed = r"'hist_item_ids' has shape \(2, 10\).*(?s:.*)bst\.py:\d+: x = .*self\.position"
    with torch.no_grad(), pytest.raises(InputError, match=fixed):
        cm(**kwargs, candidate_to_request=batch.candidate_to_request)

    def no_compile(dims):
        raise AssertionError(f"compiled again for {dims}")

    cm._growth._compile_marked = no_compile
    with torch.no_grad(), pytest.raises(InputError, match=fixed):
        cm(**kwargs, candidate_to_request=batch.candidate_to_request)
    with torch.no_grad():  # the example's length still runs the compiled program
        index = batch.candidate_to_request
        want = model(**replicated(batch.kwargs, index, bst.REQUEST_INPUTS))
        torch.testing.assert_close(cm(**batch.kwargs, candidate_to_request=index), want)


def test_one_of_two_tied_lengths_is_refused_and_both_changed_together_grow():
    """DIN sums each position's item and category embeddings: its two histories have one
    length. A call changing one of them fails to compile (the other is still 50); one changing
    both compiles, as the refusal was for that one dim."""
    model = din_model()
    cm = unmarked_din(model)
    batch = din.make_batch([2, 3], seed=4)
    index = batch.candidate_to_request
    one = dict(batch.kwargs, hist_cat_ids=batch.kwargs["hist_cat_ids"][:, :20])
    with torch.no_grad(), pytest.raises(InputError, match=r"dim 1 of 'hist_cat_ids' dynamic"):
        cm(**one, candidate_to_request=index)
    both = at_length(batch, 20, seed=4)
    with torch.no_grad():
        want = model(**replicated(both, index))
        torch.testing.assert_close(cm(**both, candidate_to_request=index), want)
        with pytest.raises(InputError, match=r"'hist_item_ids' dim 1: 20.*'hist_cat_ids' dim 1: 9"):
            cm(**dict(both, hist_cat_ids=both["hist_cat_ids"][:, :9]), candidate_to_request=index)


def test_a_width_the_model_reads_part_of_grows_and_one_short_of_it_is_refused():
    """DIN reads three columns of ``user_profile``: a fourth is ignored, by eager too, and the
    grown graph reads at least three (its size's range starts at 3), so two are refused at the
    input check, not deep in a ``select``."""
    model = din_model()
    cm = unmarked_din(model)
    batch = din.make_batch([2, 3], seed=2)
    index = batch.candidate_to_request
    profile = batch.kwargs["user_profile"]
    wider = dict(batch.kwargs, user_profile=torch.cat([profile, profile[:, :1]], 1))
    with torch.no_grad():
        want = model(**replicated(wider, index))
        torch.testing.assert_close(cm(**wider, candidate_to_request=index), want)
        narrower = dict(batch.kwargs, user_profile=profile[:, :2])
        with pytest.raises(InputError, match=r"'user_profile' has size 2 at dim 1.*at least 3"):
            cm(**narrower, candidate_to_request=index)


def test_the_request_cache_serves_the_program_of_every_length():
    model = din_model()
    cache = rocs.RequestCache(max_bytes=1 << 24)
    example = din.make_batch([4, 3]).replicated()
    cm = rocs.compile(model, list(din.REQUEST_INPUTS), example_kwargs=example, request_cache=cache)
    batch = din.make_batch([3, 1, 5], seed=7, shuffle=True)
    index = batch.candidate_to_request
    with torch.no_grad():
        for length in (50, 50, 30, 30, 30, 64):
            kwargs = at_length(batch, length, seed=7)
            want = model(**replicated(kwargs, index))
            torch.testing.assert_close(cm(**kwargs, candidate_to_request=index), want)
    assert cm.cache_stats()["hits"] > 0


def test_a_copy_and_a_move_of_a_grown_model_serve_every_length_without_compiling_again():
    model = din_model()
    cm = unmarked_din(model)
    batch = din.make_batch([3, 2], seed=5, shuffle=True)
    index = batch.candidate_to_request
    with torch.no_grad():
        cm(**at_length(batch, 30, seed=5), candidate_to_request=index)  # grows
        copied, moved = copy.deepcopy(cm), copy.deepcopy(cm).double()
        for other in (copied, moved):
            graph = id(other.graph_module)
            kwargs = at_length(batch, 17, seed=6)
            eager = other._original if other is copied else model.double()
            if other is moved:
                kwargs = {n: v.double() if v.is_floating_point() else v for n, v in kwargs.items()}
            want = eager(**replicated(kwargs, index))
            torch.testing.assert_close(other(**kwargs, candidate_to_request=index), want)
            assert id(other.graph_module) == graph  # compiled with the length dynamic already


def test_unmarked_histories_of_any_length_in_a_drop_in_serving_loop():
    """The serving pattern: requests arrive with their own history lengths, padded per call."""
    model = din_model()
    cm = unmarked_din(model)
    generator = torch.Generator().manual_seed(0)
    vocabs = {"hist_item_ids": din.NUM_ITEMS, "hist_cat_ids": din.NUM_CATS}
    with torch.no_grad():
        for step in range(6):
            length = int(torch.randint(1, 200, (1,), generator=generator))
            batch = din.make_batch([int(c) for c in torch.randint(1, 6, (3,), generator=generator)], seed=step)
            kwargs = histories_at_length(batch.kwargs, vocabs, length, seed=step)
            as_replicated = replicated(kwargs, batch.candidate_to_request)
            torch.testing.assert_close(cm(**as_replicated), model(**as_replicated), rtol=1e-5, atol=1e-5)


def test_a_grown_model_exports_a_program_of_every_length():
    """Before its first call at another length the program fixes the example's length; after
    it, the exported program takes every length, exact (the door exports what the model runs)."""
    from rocs_compiler.export import input_signature

    model = din_model()
    cm = unmarked_din(model)
    assert input_signature(rocs.export(cm))["hist_item_ids"]["shape"][1] == 50
    batch = din.make_batch([3, 2], seed=8, shuffle=True)
    index = batch.candidate_to_request
    with torch.no_grad():
        cm(**at_length(batch, 20, seed=8), candidate_to_request=index)  # grows
        program = rocs.export(cm).module()
        for length in (1, 33, 90):
            kwargs = at_length(batch, length, seed=9 + length)
            want = model(**replicated(kwargs, index))
            got = program(**kwargs, candidate_to_request=index)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"length {length}")


def test_a_model_moved_to_another_dtype_refuses_a_new_length_saying_how_to_mark_it():
    """Compiled again from its moved copy, a grown program would follow the copy's weights, not
    the original's: a moved compiled model takes the sizes it had when moved."""
    model = din_model()
    cm = unmarked_din(model).double()
    batch = din.make_batch([3, 2], seed=6)
    index = batch.candidate_to_request
    with torch.no_grad():
        want = model.double()(**replicated(batch.kwargs, index))
        torch.testing.assert_close(cm(**batch.kwargs, candidate_to_request=index), want)
        with pytest.raises(InputError, match=r"'hist_item_ids' has shape \(2, 20\).*mark_dynamic"):
            cm(**at_length(batch, 20, seed=6), candidate_to_request=index)
