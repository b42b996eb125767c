"""Evaluating a training compile: ``cm.train()``, steps, ``cm.eval()``, validate, ``cm.train()``.

In eval mode a training compile runs its original compiled for inference in eval mode, compiled
once on first use (``runtime/modes/eval_mode.py``), reading the original's own weights: dropout off,
batch norm on the running statistics the training calls updated, the optimizer's steps seen.

Before: the first call after ``cm.eval()`` raised ``CompileError ... call cm.train() to train on;
evaluate with the original model``. Oracle: the original model itself in eval mode, eager, on the
replicated batch.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from training_testing import assert_gradients_match, check_gradients, gradients, loss_of

import rocs_compiler as rocs
from models_zoo import ZOO

TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}


class MatmulRows(TorchDispatchMode):
    """Records the row count of every matrix product's output."""

    def __init__(self):
        super().__init__()
        self.rows: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.rows.add(int(out.shape[0]))
        return out


def _sgd_steps(cm, model, batches, steps: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(steps):
        batch = batches[step % len(batches)]
        opt.zero_grad()
        out = cm(**batch.kwargs, candidate_to_request=batch.candidate_to_request)
        loss_of(out, seed=step).backward()
        opt.step()


# dcnv2: dropout in the deep tower; din: batch norm (Dice) in the head, its scores scaled up to
# differ between rows far beyond the tolerance (as built they differ by about 0.01).
@pytest.mark.parametrize("name, scale", [("dcnv2", 1.0), ("din", 30.0)])
def test_eval_between_training_steps_is_exact_and_shares_the_request_side(name, scale):
    entry = ZOO[name]
    torch.manual_seed(0)
    model = entry.build(seed=0).train()
    with torch.no_grad():
        [*_, last] = (m for m in model.modules() if isinstance(m, nn.Linear))
        last.weight.mul_(scale)
    example = entry.make_batch([2, 3], seed=1).replicated()
    cm = rocs.compile(
        model, list(entry.request_inputs), example_kwargs=example, training=True,
        options={"autotune": False},
    )  # fmt: skip
    batches = [
        entry.make_batch(c, seed=s, shuffle=True) for s, c in enumerate([[1, 3, 17], [4, 4]])
    ]
    held_out = entry.make_batch([1, 3, 17], seed=9, shuffle=True)  # R = 3, N = 21

    def evaluate() -> torch.Tensor:
        cm.eval()
        assert not model.training and not any(m.training for m in model.modules())
        replicated = held_out.replicated()
        with torch.no_grad():
            want = model(**replicated)
            assert float(want.std()) > 1e3 * TOLERANCE["atol"]
            shared = cm(**held_out.kwargs, candidate_to_request=held_out.candidate_to_request)
            torch.testing.assert_close(shared, want, **TOLERANCE)
            torch.testing.assert_close(cm(**replicated), want, **TOLERANCE)
            # The request side ran once per request: matrix products at R = 3 rows, which the
            # original model (every product at N = 21 rows or more) never computes.
            with MatmulRows() as products:
                cm(**held_out.kwargs, candidate_to_request=held_out.candidate_to_request)
            assert held_out.num_requests in products.rows, products.rows
        return want

    _sgd_steps(cm, model, batches, 3)
    first = evaluate()
    program = cm._eval_mode.program
    cm.train()
    _sgd_steps(cm, model, batches, 3)
    second = evaluate()
    assert cm._eval_mode.program is program  # compiled once, on first use
    assert float((second - first).abs().max()) > 1e2 * TOLERANCE["atol"]  # the weights moved
    cm.train()
    assert model.training
    check_gradients(model, cm, batches[0], f"{name} after eval")


class Ranker(nn.Module):
    """A two-tower ranker with batch norm and dropout after the towers meet."""

    def __init__(self):
        super().__init__()
        self.user = nn.Sequential(nn.Linear(6, 32), nn.ReLU())
        self.item = nn.Linear(6, 32)
        self.norm = nn.BatchNorm1d(32)
        self.head = nn.Sequential(nn.Dropout(0.5), nn.Linear(32, 1))

    def forward(self, u, c):
        return self.head(self.norm(self.user(u) * self.item(c))).squeeze(-1)


def _ranker_batch(seed: int):
    gen = torch.Generator().manual_seed(seed)
    index = torch.tensor([2, 0, 1, 1, 1, 2, 2, 2, 2, 0, 2])  # ragged, shuffled
    u = 3 * torch.randn(3, 6, generator=gen)
    return u, 3 * torch.randn(len(index), 6, generator=gen), index


def _ranker(**options):
    torch.manual_seed(0)
    model = Ranker()
    u, c, index = _ranker_batch(1)
    cm = rocs.compile(model, ["u"], example_inputs=(u[index], c), training=True, options=options)
    return model, cm


def test_a_parents_eval_reaches_the_eval_program_in_every_layout():
    model, cm = _ranker()
    parent = nn.Sequential(cm)
    u, c, index = _ranker_batch(2)
    cm(u, c, candidate_to_request=index).sum().backward()  # a training call first
    parent.eval()
    with torch.inference_mode():  # the eval program is compiled outside inference mode
        want = model(u[index], c)
        torch.testing.assert_close(cm(u, c, candidate_to_request=index), want, **TOLERANCE)
    with torch.no_grad():
        torch.testing.assert_close(cm(u[index], c), want, **TOLERANCE)
        got = cm.call_replicated(u[index], c, candidate_to_request=index)
        torch.testing.assert_close(got, want, **TOLERANCE)
    parent.train()
    torch.manual_seed(5)
    got = cm(u, c, candidate_to_request=index)
    torch.manual_seed(5)
    torch.testing.assert_close(got, model(u[index], c), **TOLERANCE)  # dropout on again


def test_a_grad_mode_call_in_eval_mode_gets_eagers_gradients():
    model, cm = _ranker()
    eager = copy.deepcopy(model).eval()
    cm.eval()
    u, c, index = _ranker_batch(3)
    _, want = gradients(eager, lambda: eager(u[index], c))
    _, got = gradients(model, lambda: cm(u, c, candidate_to_request=index))
    assert_gradients_match(got, want, "shared layout in eval mode")
    _, got = gradients(model, lambda: cm(u[index], c))
    assert_gradients_match(got, want, "drop-in in eval mode")


def test_a_training_compile_moved_to_float64_evaluates_in_float64():
    model, cm = _ranker()
    cm = cm.to(torch.float64)
    u, c, index = _ranker_batch(6)
    u, c = u.double(), c.double()
    cm(u, c, candidate_to_request=index).sum().backward()
    cm.eval()
    with torch.no_grad():
        got = cm(u, c, candidate_to_request=index)
        want = model(u[index].float(), c.float())
    assert got.dtype == torch.float64
    torch.testing.assert_close(got.float(), want, **TOLERANCE)
    with pytest.raises(rocs.InputError, match=r"torch.no_grad\(\) only"):
        cm(u, c, candidate_to_request=index)  # its eager model is a moved copy


def test_the_eval_programs_choices_are_reported():
    _, cm = _ranker()
    cm.eval()
    u, c, index = _ranker_batch(4)
    with torch.no_grad():
        for _ in range(14):  # through the program choice's trials
            cm(u, c, candidate_to_request=index)
    layouts = {key[0] for key in cm.program_choices()}
    assert "eval-shared" in layouts, cm.program_choices()


def test_a_submodule_switched_alone_is_refused_naming_the_whole_model():
    model, cm = _ranker()
    model.norm.eval()  # batch norm alone on its running statistics
    u, c, index = _ranker_batch(5)
    with pytest.raises(rocs.CompileError, match=r"switch the whole model, cm.eval\(\)"):
        cm(u, c, candidate_to_request=index)
