"""The program choice of training calls: per bucket, the training program or the original model.

Oracle: the original model trained eagerly on the replicated batch. Whichever program a bucket
runs (the trials alternate both; a decided bucket runs one), every parameter's gradient, every
dropout mask and every running statistic equals eager's; ``autotune=False`` keeps the training
program. Each test calls a bucket at least 21 times (through its trials, ``TRAINING_TRIALS = 10``
per program). Nothing here asserts on time: which program a bucket keeps is the machine's business.
"""

from __future__ import annotations

import copy
import functools
import time

import pytest
import torch
from torch import nn
from training_testing import assert_gradients_match, gradients

import rocs_compiler as rocs
from models_zoo import ZOO, Batch, request_index
from rocs_compiler.runtime.choice.program_choice import (
    PLAIN,
    SHARED,
    TRAINING_TRIALS,
    ProgramChoice,
    bucket,
)
from rocs_compiler.runtime.call import prior
from rocs_compiler.runtime.training.program import TrainingProgram

CALLS = 2 * TRAINING_TRIALS + 1  # through a bucket's trials and once decided


def _compile(model, request_inputs, make_batch, **options):
    example = make_batch([2, 3], seed=1).replicated()
    return rocs.compile(
        model, list(request_inputs), example_kwargs=example, training=True, options=options
    )


@functools.cache
def _dlrm(autotune: bool = True):
    entry = ZOO["dlrm"]
    model = entry.build(seed=0).train()
    return entry, model, _compile(model, entry.request_inputs, entry.make_batch, autotune=autotune)


def _calls(cm, batch: Batch, layout: str):
    if layout == "shared":
        return lambda: cm(**batch.kwargs, candidate_to_request=batch.candidate_to_request)
    replicated = batch.replicated()
    return lambda: cm(**replicated)


def _key(batch: Batch, layout: str) -> tuple:
    rows = batch.candidate_to_request.shape[0]
    return bucket(f"train-{'shared' if layout == 'shared' else 'dropin'}", rows, batch.num_requests)


@pytest.fixture
def program_runs(monkeypatch):
    """How many calls ran the training program (the others ran the original model)."""
    runs = []
    call = TrainingProgram.__call__

    def counted(self, *args):
        runs.append(self)
        return call(self, *args)

    monkeypatch.setattr(TrainingProgram, "__call__", counted)
    return runs


@pytest.mark.parametrize("layout", ["shared", "dropin"])
def test_gradients_equal_eager_on_every_call_through_the_trials(layout, program_runs):
    entry, model, cm = _dlrm()
    # Shuffled candidates in the shared layout; a drop-in call's requests are runs of equal rows.
    batch = entry.make_batch([1, 3, 17], seed=11, shuffle=layout == "shared")
    _, want = gradients(model, lambda: model(**batch.replicated()))
    call = _calls(cm, batch, layout)
    for i in range(CALLS):
        _, got = gradients(model, call)
        assert_gradients_match(got, want, f"{layout} call {i}")
    # The trials ran both programs, then the bucket was decided.
    assert 0 < len(program_runs) < CALLS
    assert cm.program_choices()[_key(batch, layout)] in (SHARED, PLAIN)


@pytest.mark.parametrize("program", [SHARED, PLAIN])
@pytest.mark.parametrize("layout", ["shared", "dropin"])
def test_each_program_decided_gives_eager_gradients(program, layout, program_runs, monkeypatch):
    entry, model, cm = _dlrm()
    batch = entry.make_batch([2, 1, 9, 4], seed=20, shuffle=layout == "shared")
    monkeypatch.setattr(cm._training, "choice", ProgramChoice())  # decisions of this test only
    cm._training.choice.settle(_key(batch, layout), program)
    _, want = gradients(model, lambda: model(**batch.replicated()))
    for i in range(3):
        _, got = gradients(model, _calls(cm, batch, layout))
        assert_gradients_match(got, want, f"{program} {layout} call {i}")
    assert len(program_runs) == (3 if program == SHARED else 0)


def test_a_row_count_run_by_the_original_everywhere_skips_finding_requests(monkeypatch):
    """Drop-in calls whose row count's buckets all chose the original model call it as made:
    no pass over the rows to find requests (which only the training program needs), the
    gradients still eager's. Once a bucket of that row count shares, every call finds its
    requests again."""
    from rocs_compiler.runtime.call import grouping

    entry, model, cm = _dlrm()
    monkeypatch.setattr(cm._training, "choice", ProgramChoice())
    finds = []
    detect = grouping.detect_requests
    monkeypatch.setattr(grouping, "detect_requests", lambda *a: finds.append(1) or detect(*a))
    batch = entry.make_batch([3, 3, 2], seed=50)
    other = entry.make_batch([2, 2, 2, 2], seed=51)  # the same 8 rows, another bucket
    cm._training.choice.settle(_key(batch, "dropin"), PLAIN)
    _, want = gradients(model, lambda: model(**batch.replicated()))
    for i in range(3):
        _, got = gradients(model, _calls(cm, batch, "dropin"))
        assert_gradients_match(got, want, f"original everywhere, call {i}")
    assert not finds
    cm._training.choice.settle(_key(other, "dropin"), SHARED)
    _, got = gradients(model, _calls(cm, batch, "dropin"))
    assert_gradients_match(got, want, "a row count that also shares")
    assert finds
    replicated = batch.replicated()
    replicated["user_dense"] = replicated["user_dense"].requires_grad_()
    with pytest.raises(rocs.InputError, match="require grad in a replicated call"):
        cm(**replicated)


@pytest.mark.parametrize("layout", ["shared", "dropin"])
def test_guards_are_checked_where_the_training_program_runs(layout, monkeypatch):
    """The guards (``runtime/follow/guards.py``) protect the compiled program; a training call that
    runs the original model itself does not check them, one that runs the program does, and so
    does every inference call."""
    entry, model, cm = _dlrm()
    checks = []
    monkeypatch.setattr(cm._guards, "check", lambda: checks.append(1))
    monkeypatch.setattr(cm._training, "choice", ProgramChoice())
    batch = entry.make_batch([2, 2, 3], seed=70, shuffle=layout == "shared")
    other = entry.make_batch([1] * 7, seed=71)  # the same 7 rows, another bucket
    cm._training.choice.settle(_key(batch, layout), PLAIN)
    cm._training.choice.settle(_key(other, layout), SHARED)
    gradients(model, _calls(cm, batch, layout))
    assert not checks
    gradients(model, _calls(cm, other, layout))
    assert len(checks) == 1
    with torch.no_grad():
        _calls(cm, batch, layout)()
    assert len(checks) == 2


def test_a_training_bucket_is_timed_even_where_its_flops_would_settle_it(program_runs):
    """An inference bucket whose FLOP ideal is at least CLEAR_GAIN with CLEAR_SAVING to save is
    settled on sharing without trials; a training bucket is always timed (its program's fixed
    costs per op are not in the count)."""
    from rocs_compiler.runtime.choice.program_choice import CLEAR_GAIN, CLEAR_SAVING

    entry = ZOO["two_tower"]
    model = entry.build(seed=0).train()
    cm = _compile(model, entry.request_inputs, entry.make_batch)
    batch = entry.make_batch([64] * 16, seed=60)
    shared, plain = prior.flops(cm, batch.candidate_to_request.shape[0], batch.num_requests)
    assert plain >= CLEAR_GAIN * shared and plain - shared >= CLEAR_SAVING  # would settle
    for _ in range(2):
        gradients(model, _calls(cm, batch, "shared"))
        assert _key(batch, "shared") not in cm.program_choices()
    assert len(program_runs) == 1  # one trial of each program so far


@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_trials_are_timed_by_the_calling_threads_cpu_time(threads, monkeypatch):
    """With one torch thread a CPU trial's whole step runs on the calling thread: its CPU time
    leaves out time spent preempted by other processes; with more, wall time."""
    from rocs_compiler.runtime.choice import program_choice
    from rocs_compiler.runtime.training import step_timing

    clocks = []
    run = step_timing.StepTrials.run

    def recording(self, *args, clock=None, **kwargs):
        clocks.append(clock)
        return run(self, *args, clock=clock, **kwargs)

    monkeypatch.setattr(step_timing.StepTrials, "run", recording)
    entry, model, _ = _dlrm()
    cm = _compile(model, entry.request_inputs, entry.make_batch)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gradients(model, _calls(cm, entry.make_batch([2, 5], seed=3), "shared"))
    finally:
        torch.set_num_threads(before)
    assert clocks == [time.thread_time if threads == 1 else program_choice.now]


def test_the_choice_decides_per_bucket(program_runs, monkeypatch):
    entry, model, cm = _dlrm()
    monkeypatch.setattr(cm._training, "choice", ProgramChoice())
    small = entry.make_batch([1, 1, 1], seed=30)
    large = entry.make_batch([40, 24], seed=31)
    choice = cm._training.choice
    choice.settle(_key(small, "shared"), PLAIN)
    choice.settle(_key(large, "shared"), SHARED)
    for batch in (small, large):
        for _ in range(CALLS):
            gradients(model, _calls(cm, batch, "shared"))
    assert len(program_runs) == CALLS  # the large bucket's calls only
    decided = cm.program_choices()
    assert decided[_key(small, "shared")] == PLAIN and decided[_key(large, "shared")] == SHARED


def test_autotune_off_keeps_the_training_program(program_runs):
    entry, model, cm = _dlrm(autotune=False)
    batch = entry.make_batch([1, 3, 17], seed=40, shuffle=True)
    _, want = gradients(model, lambda: model(**batch.replicated()))
    for _ in range(CALLS):
        _, got = gradients(model, _calls(cm, batch, "shared"))
        assert_gradients_match(got, want, "autotune off")
    assert len(program_runs) == CALLS
    assert cm._training.choice is None and cm.program_choices() == {}


# -- randomness and batch statistics through the choice -----------------------------------------

D = 16


class _RequestSide(nn.Module):
    """A request tower with dropout or batch norm on its request-only values."""

    def __init__(self, kind: str):
        super().__init__()
        # No bias before batch norm: its gradient is zero up to rounding, which no bound fits.
        self.user = nn.Linear(D, D, bias=kind != "batch_norm")
        self.mix = {"dropout": nn.Dropout(0.5), "batch_norm": nn.BatchNorm1d(D)}[kind]
        self.item = nn.Linear(8, D)

    def forward(self, hist, c):
        return (self.mix(self.user(hist.mean(1))) * self.item(c)).sum(-1)


def _history_batch(counts, seed=0, shuffle=False) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    index = request_index(counts, shuffle=shuffle, generator=gen)
    hist = torch.randn(len(counts), 5, D, generator=gen)
    c = torch.randn(index.shape[0], 8, generator=gen)
    return Batch({"hist": hist, "c": c}, index, ("hist",))


@pytest.mark.parametrize("layout", ["shared", "dropin"])
@pytest.mark.parametrize("kind", ["dropout", "batch_norm"])
def test_dropout_masks_and_running_statistics_equal_eager_through_the_choice(kind, layout):
    """Each call seeded alike: eager's masks whichever program runs (the training program draws
    them in eager's order on eager's shapes); running statistics updated as eager's, call by
    call, through the trials."""
    torch.manual_seed(0)
    model = _RequestSide(kind).train()
    cm = _compile(model, ["hist"], _history_batch)
    eager_model = copy.deepcopy(model)
    batch = _history_batch([1, 3, 17], seed=50, shuffle=layout == "shared")
    call = _calls(cm, batch, layout)
    for i in range(CALLS):
        _, want = gradients(eager_model, lambda: eager_model(**batch.replicated()), seed=i)
        _, got = gradients(model, call, seed=i)
        assert_gradients_match(got, want, f"{kind} {layout} call {i}")
        for (name, a), b in zip(eager_model.named_buffers(), model.buffers()):
            torch.testing.assert_close(b, a, msg=lambda m, name=name, i=i: f"call {i} {name}: {m}")
    assert _key(batch, layout) in cm.program_choices()


@pytest.mark.parametrize("autotune", [True, False])
def test_no_grad_calls_update_running_statistics_as_eager(autotune):
    """A forward that writes buffers runs the training program (or the original model) without
    grad too: eager's train-mode forward updates the running statistics under no_grad."""
    torch.manual_seed(0)
    model = _RequestSide("batch_norm").train()
    cm = _compile(model, ["hist"], _history_batch, autotune=autotune)
    eager_model = copy.deepcopy(model)
    batch = _history_batch([1, 3, 17], seed=60, shuffle=True)
    with torch.no_grad():
        for i in range(CALLS):
            got = cm(**batch.kwargs, candidate_to_request=batch.candidate_to_request)
            want = eager_model(**batch.replicated())
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
            for (name, a), b in zip(eager_model.named_buffers(), model.buffers()):
                torch.testing.assert_close(
                    b, a, msg=lambda m, name=name, i=i: f"call {i} {name}: {m}"
                )
