"""The program choice's buckets count the history length (``runtime/choice/program_choice.py``,
``runtime/call/lengths.py``): a bucket decided at long histories decides nothing for short ones,
the FLOP prior is read at each call's length, a drop-in row class that kept the original model
keeps it at its own lengths only, and a model without a dynamic length keeps its buckets as they
were. Every call is checked exact against the original model."""

from __future__ import annotations

import pytest
import torch

import rocs_compiler as rocs
from models_zoo import din
from rocs_compiler.runtime.call import choosing, prior
from rocs_compiler.runtime.call.original_arm import ORIGINAL
from rocs_compiler.runtime.choice.program_choice import SHARED, TRIALS, bucket

from dynamic_histories import HISTORIES, at_length, din_model, marked_example, replicated

LONG, SHORT = 2048, 1


def _compiled(example=None, forwards: list | None = None):
    """(DIN, its compile from ``example``, the marked one by default); with ``forwards``, a
    forward pre-hook registered before compiling appends to it on each call of the original."""
    model = din_model()
    if forwards is not None:
        model.register_forward_pre_hook(lambda *_: forwards.append(1))
    cm = rocs.compile(model, list(din.REQUEST_INPUTS), example_kwargs=example or marked_example())
    if forwards is not None:
        forwards.clear()  # the compile's own calls
    return model, cm


def _full(batch, length: int, seed: int) -> dict:
    """The batch's shared-layout inputs with every history ``length`` long: no padding, which a
    call's requests could be cut to (``runtime/call/jagged.py``), so the call runs at ``length``."""
    kwargs = at_length(batch, length, seed)
    return {n: v.clamp(min=1) if n in HISTORIES else v for n, v in kwargs.items()}


def _call(model, cm, layout: str, batch, kwargs: dict):
    """``cm`` on the ``layout`` call of ``kwargs``, checked against the original model."""
    index = batch.candidate_to_request
    as_replicated = replicated(kwargs, index)
    with torch.no_grad():
        want = model(**as_replicated)
        if layout == "shared":
            got = cm(**kwargs, candidate_to_request=index)
        else:
            got = cm(**as_replicated)
    assert want.std() > 1e-2  # rows that differ far more than the tolerance
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["shared", "dropin"])
def test_calls_at_a_long_and_a_short_length_land_in_different_buckets(layout):
    model, cm = _compiled()
    batch = din.make_batch([2, 2], seed=0)
    rows, requests = batch.candidate_to_request.shape[0], batch.num_requests
    for length in (LONG, SHORT):
        for call in range(2 * TRIALS):  # the bucket's trials: it decides
            _call(model, cm, layout, batch, _full(batch, length, seed=call))
    assert len(cm.program_choices()) == 2
    assert set(cm.program_choices()) == {
        bucket(layout, rows, requests, (LONG.bit_length(),)),
        bucket(layout, rows, requests, (SHORT.bit_length(),)),
    }


def _ideal(cm, length: int, rows: int, requests: int) -> float:
    """Plain FLOPs over shared FLOPs at ``length``, by the report (the cost model's counts)."""
    counted = cm.report(candidates=1, requests=1, lengths={"hist_item_ids": length})
    per_request, per_candidate = counted.request_flops, counted.candidate_flops
    return rows * (per_request + per_candidate) / (requests * per_request + rows * per_candidate)


def test_the_flop_prior_is_read_at_each_calls_length(monkeypatch):
    """With the clear gain set between the FLOP ideals at the two lengths, the bucket of the
    length whose ideal reaches it is settled on the shared program without trials and the other
    is measured: the prior counted each call at its own length, not at the example's."""
    model, cm = _compiled()
    batch = din.make_batch([16], seed=1)
    rows, requests = batch.candidate_to_request.shape[0], batch.num_requests
    ideals = {length: _ideal(cm, length, rows, requests) for length in (LONG, SHORT)}
    clear, measured = sorted(ideals, key=ideals.get, reverse=True)
    assert ideals[clear] > ideals[measured] * 1.02  # far enough apart to tell
    monkeypatch.setattr(choosing, "CLEAR_GAIN", (ideals[clear] + ideals[measured]) / 2)
    monkeypatch.setattr(choosing, "CLEAR_SAVING", 0.0)
    calls = {length: _full(batch, length, seed=length) for length in (clear, measured)}
    for kwargs in calls.values():
        _call(model, cm, "shared", batch, kwargs)
    assert cm.program_choices() == {bucket("shared", rows, requests, (clear.bit_length(),)): SHARED}
    for length, kwargs in calls.items():  # what the prior counted: the report's at that length
        shared, plain = prior.flops(cm, rows, requests, (length.bit_length(),), kwargs)
        assert plain / shared == pytest.approx(ideals[length], rel=1e-6)


def test_a_dropin_row_class_keeps_the_original_at_its_own_lengths_only():
    forwards = []
    model, cm = _compiled(forwards=forwards)
    batch = din.make_batch([3, 2], seed=2)
    rows = batch.candidate_to_request.shape[0]
    cm._originals.settle(bucket("dropin", rows, 0, (LONG.bit_length(),)), ORIGINAL)
    long, short = (_full(batch, length, seed=length) for length in (LONG, SHORT))
    _call(model, cm, "dropin", batch, long)
    assert len(forwards) == 2  # the check's and the kept original's
    _call(model, cm, "dropin", batch, short)
    assert len(forwards) == 3  # the check's alone: the compiled model ran
    assert any(key[3:] == (SHORT.bit_length(),) for key in cm._choice._times)


def test_a_model_without_a_dynamic_length_keeps_its_buckets():
    model, cm = _compiled(din.make_batch([4, 3]).replicated())  # nothing marked
    batches = [din.make_batch(counts, seed=i) for i, counts in enumerate([[2, 2], [3, 1], [5, 3]])]
    for call in range(2 * TRIALS):
        for batch in batches:
            _call(model, cm, "shared", batch, dict(batch.kwargs))
    assert set(cm.program_choices()) == {bucket("shared", 4, 2), bucket("shared", 8, 2)}
    assert {len(key) for key in cm.program_choices()} == {3}
    assert cm._lengths is None  # nothing to read per call
