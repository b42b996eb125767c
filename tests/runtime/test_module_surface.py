"""The compiled model is its original model as an ``nn.Module`` (``runtime/follow/module_state.py``).

Before: ``cm.parameters()`` was empty (an optimizer over a wrapper's parameters trained only the
wrapper's own layers, ``DDP(cm)`` refused to start), the program's weight aliases were
registered buffers (DDP broadcast them every step), ``cm.eval()`` and a parent's ``.eval()``
were ignored (dropout stayed on), and ``cm.to(torch.float64)`` of a training compile trained a
moved copy: ``backward()`` never reached the original's parameters. Oracle: the original model
itself, eager.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import rocs_compiler as rocs
from rocs_compiler.errors import CompileError


class Ranker(nn.Module):
    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.user = nn.Linear(6, 16)
        self.item = nn.Linear(6, 16)
        self.head = nn.Sequential(nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, 1))
        self.register_buffer("scale", torch.full((16,), 0.5))

    def forward(self, u, c):
        return self.head((self.user(u) + self.item(c)) * self.scale)


def _batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    index = torch.tensor([0, 1, 1, 1, 2, 2, 0, 2, 2, 2, 2, 2])
    u = torch.randn(3, 6, generator=gen)
    return u[index], torch.randn(len(index), 6, generator=gen)


def _compile(model, training=True, **options):
    u, c = _batch(1)
    return rocs.compile(model, ["u"], example_inputs=(u, c), training=training, options=options)


@pytest.mark.parametrize("training", [True, False], ids=["training", "inference"])
def test_parameters_are_the_originals_under_the_originals_names(training):
    torch.manual_seed(0)
    model = Ranker() if training else Ranker().eval()
    cm = _compile(model, training)
    assert [(n, id(p)) for n, p in cm.named_parameters()] == [
        (n, id(p)) for n, p in model.named_parameters()
    ]
    # The program's aliases are no buffers of the compiled model: only the original's are.
    assert [(n, id(b)) for n, b in cm.named_buffers()] == [
        (n, id(b)) for n, b in model.named_buffers()
    ]
    assert list(cm.state_dict()) == list(model.state_dict())
    assert [n for n, _ in cm.named_modules()][1:] == [n for n, _ in model.named_modules()][1:]
    # A state dict saved from the original loads into the compiled model, and back.
    state = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    cm.load_state_dict(state)
    torch.testing.assert_close(model.user.weight, state["user.weight"])


def test_an_optimizer_over_a_wrappers_parameters_trains_the_compiled_model():
    torch.manual_seed(0)
    model = Ranker()
    reference = copy.deepcopy(model)

    class Wrapper(nn.Module):
        def __init__(self, ranker):
            super().__init__()
            self.ranker = ranker
            self.bias = nn.Parameter(torch.zeros(1))

        def forward(self, u, c):
            return self.ranker(u, c) + self.bias

    wrapped, eager = Wrapper(_compile(model)), Wrapper(reference)
    assert len(list(wrapped.parameters())) == len(list(eager.parameters()))
    runs = []
    for net in (wrapped, eager):
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for step in range(3):
            u, c = _batch(step)
            opt.zero_grad()
            ((net(u, c) - 1.0) ** 2).mean().backward()
            opt.step()
        runs.append(dict(net.named_parameters()))
    for name, p in runs[1].items():
        torch.testing.assert_close(runs[0][name], p, rtol=1e-5, atol=1e-6, msg=name)


def test_eval_of_the_compiled_model_or_its_parent_reaches_the_original():
    torch.manual_seed(0)
    model = Ranker(dropout=0.5)
    cm = _compile(model)
    parent = nn.Sequential(cm)
    parent.eval()
    assert not model.training and not cm.training and not model.head[1].training
    u, c = _batch()
    # A training compile in eval mode runs its eval-mode program: dropout off
    # (tests/runtime/test_training_eval.py).
    with torch.no_grad():
        torch.testing.assert_close(cm(u, c), model(u, c))
    cm.train()
    assert model.training and model.head[1].training
    torch.manual_seed(3)
    got = cm(u, c)
    torch.manual_seed(3)
    torch.testing.assert_close(got, model(u, c))
    # An inference compile switched to training mode is refused the same way.
    infer = _compile(Ranker(dropout=0.5).eval(), training=False)
    with pytest.raises(CompileError, match=r"call model.eval\(\) or cm.eval\(\)"):
        infer.train()(u, c)


def test_a_training_compile_moved_to_float64_trains_the_originals_parameters():
    torch.manual_seed(0)
    model = Ranker()
    cm = _compile(model).to(torch.float64)
    eager = copy.deepcopy(model).to(torch.float64)
    assert model.user.weight.dtype == torch.float32  # the original keeps its dtype
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_eager = torch.optim.SGD(eager.parameters(), lr=0.1)
    for step in range(3):
        u, c = (t.double() for t in _batch(step))
        for net, o in ((cm, opt), (eager, opt_eager)):
            o.zero_grad()
            ((net(u, c) - 1.0) ** 2).mean().backward()
        for name, p in eager.named_parameters():
            got = dict(model.named_parameters())[name].grad
            assert got is not None, f"step {step}: no gradient reached {name}"
            torch.testing.assert_close(got, p.grad.float(), rtol=1e-4, atol=1e-6)
        opt.step()
        opt_eager.step()
    # Every step computed with the original's updated weights.
    for name, p in eager.named_parameters():
        torch.testing.assert_close(dict(model.named_parameters())[name], p.float())
