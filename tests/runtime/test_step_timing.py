"""Training trials are timed to the end of their backward (``runtime/training/step_timing.py``).

A fake clock makes one program's forward fast and its backward slow: a choice that timed forwards
only would keep it; timed steps keep the other. The outputs and gradients through the clock are
the program's own.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from rocs_compiler.runtime.choice import program_choice

from rocs_compiler.runtime.training import step_timing
from rocs_compiler.runtime.choice.program_choice import PLAIN, SHARED, TRIALS, ProgramChoice
from rocs_compiler.runtime.training.step_timing import StepTrials

KEY = ("train-shared", 4, 2)


class _Clock:
    def __init__(self):
        self.value = 0.0

    def __call__(self):
        return self.value


@pytest.fixture
def clock(monkeypatch):
    fake = _Clock()
    monkeypatch.setattr(program_choice, "now", fake)
    monkeypatch.setattr(step_timing, "now", fake)
    return fake


def _program(clock, weight, forward_s, backward_s):
    """A program whose forward takes ``forward_s`` and whose backward ``backward_s``."""

    class Slow(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            clock.value += backward_s
            return g

    def run(x):
        clock.value += forward_s
        return {"score": Slow.apply(x * weight), "label": "kept"}

    return run


@pytest.mark.parametrize("slow_backward", [SHARED, PLAIN])
def test_a_program_with_a_fast_forward_and_a_slow_backward_loses(clock, slow_backward):
    weight = nn.Parameter(torch.ones(3))
    x = torch.randn(4, 3)
    slow = _program(clock, weight, forward_s=1.0, backward_s=10.0)
    fast = _program(clock, weight, forward_s=2.0, backward_s=1.0)
    shared, plain = (slow, fast) if slow_backward == SHARED else (fast, slow)
    trials = StepTrials(ProgramChoice())
    for _ in range(2 * TRIALS):
        out = trials.run(KEY, lambda: shared(x), lambda: plain(x), lambda: None)
        assert out["label"] == "kept"
        out["score"].sum().backward()
    other = PLAIN if slow_backward == SHARED else SHARED
    assert trials.choice.decisions() == {KEY: other}


def test_outputs_and_gradients_through_the_clock_are_the_programs(clock):
    weight = nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    x = torch.randn(4, 3)
    run = _program(clock, weight, 1.0, 1.0)
    trials = StepTrials(ProgramChoice())
    out = trials.run(KEY, lambda: run(x), lambda: run(x), lambda: None)
    torch.testing.assert_close(out["score"], x * weight.detach(), rtol=0, atol=0)
    (out["score"] * 2).sum().backward()
    torch.testing.assert_close(weight.grad, 2 * x.sum(0), rtol=0, atol=0)


def test_a_trial_without_backward_counts_its_forward_and_the_bucket_still_decides(clock):
    weight = nn.Parameter(torch.ones(3))
    x = torch.randn(4, 3)
    shared = _program(clock, weight, forward_s=1.0, backward_s=0.0)
    plain = _program(clock, weight, forward_s=3.0, backward_s=0.0)
    trials = StepTrials(ProgramChoice())
    for _ in range(2 * TRIALS + 1):  # never a backward: each trial is flushed by the next call
        trials.run(KEY, lambda: shared(x), lambda: plain(x), lambda: None)
    assert trials.choice.decisions() == {KEY: SHARED}


def test_a_settled_or_decided_bucket_runs_without_a_clock(clock):
    weight = nn.Parameter(torch.ones(3))
    x = torch.randn(4, 3)
    choice = ProgramChoice()
    trials = StepTrials(choice)
    out = trials.run(KEY, lambda: x * weight, lambda: None, lambda: SHARED)
    assert out.grad_fn is not None and "BackwardClock" not in type(out.grad_fn).__name__
    choice.settle(("train-shared", 5, 1), PLAIN)
    out = trials.run(("train-shared", 5, 1), lambda: None, lambda: x * weight, lambda: None)
    assert "BackwardClock" not in type(out.grad_fn).__name__


def test_the_clock_given_times_forward_and_backward(clock):
    """A trial is timed by the clock it is given (a CPU call's: its thread's CPU time), its
    backward included; the wall clock is not read."""
    given = _Clock()
    weight = nn.Parameter(torch.ones(3))
    x = torch.randn(4, 3)
    slow = _program(given, weight, forward_s=1.0, backward_s=10.0)
    fast = _program(given, weight, forward_s=2.0, backward_s=1.0)
    trials = StepTrials(ProgramChoice())
    for _ in range(2 * TRIALS):
        out = trials.run(KEY, lambda: slow(x), lambda: fast(x), lambda: None, clock=given)
        out["score"].sum().backward()
    assert trials.choice.decisions() == {KEY: PLAIN}
    assert clock.value == 0.0


def test_a_cpu_call_with_one_thread_is_timed_by_the_threads_cpu_time():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert program_choice.call_clock(on_cpu=True) is time.thread_time
        assert program_choice.call_clock(on_cpu=False) is program_choice.now  # a device's work
        torch.set_num_threads(2)  # other threads' work is not on the calling thread's clock
        assert program_choice.call_clock(on_cpu=True) is program_choice.now
    finally:
        torch.set_num_threads(threads)
