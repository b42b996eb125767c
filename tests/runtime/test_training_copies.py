"""A training compile takes slice assignments on request values and deep-copies.

``h[:, 0] = x`` is functionalized to ``aten.copy``, which has no derivative formula; the training
program runs it as a differentiable copy. ``copy.deepcopy(cm)`` is ``rocs.compile`` of a deep copy
of the model: its own weights, the same outputs and gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import rocs_compiler as rocs

D = 8
INDEX = torch.tensor([2, 0, 1, 0, 1, 2, 2, 2])


class _SliceAssigned(nn.Module):
    """A request value whose first column is overwritten by another request layer's output."""

    def __init__(self):
        super().__init__()
        self.enc, self.gate = nn.Linear(D, D), nn.Linear(D, 1)
        self.item, self.head = nn.Linear(D, D), nn.Linear(2 * D, 1)

    def forward(self, user, item):
        h = self.enc(user)
        h[:, 0] = self.gate(user)[:, 0]
        return self.head(torch.cat([torch.relu(h), self.item(item)], -1))


def _data(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(3, D, generator=gen), torch.randn(len(INDEX), D, generator=gen)


def _grads(model: nn.Module, out: torch.Tensor) -> dict:
    model.zero_grad(set_to_none=True)
    out.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def _compile(model, user, item, **kw):
    return rocs.compile(
        model, ["user"], example_kwargs=dict(user=user[INDEX], item=item), training=True, **kw
    )


def test_a_slice_assignment_on_a_request_value_trains():
    model = _SliceAssigned().train()
    user, item = _data()
    cm = _compile(model, user, item, options={"autotune": False})
    want = _grads(model, model(user[INDEX], item))
    assert want["enc.weight"][0].abs().sum() == 0  # the overwritten column gets no gradient
    shared = cm(user=user, item=item, candidate_to_request=INDEX)
    for out in (shared, cm(user=user[INDEX], item=item)):
        got = _grads(model, out)
        for name, g in want.items():
            torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("training", [False, True])
def test_deepcopy_is_compiling_a_deep_copy(training):
    model = _SliceAssigned().train(training)
    user, item = _data()
    cm = _compile(model, user, item) if training else rocs.compile(
        model, ["user"], example_kwargs=dict(user=user[INDEX], item=item)
    )
    holder = nn.ModuleDict({"model": model})
    holder.cm = cm
    copied = copy.deepcopy(holder)
    twin = copied.cm
    assert isinstance(twin, type(cm)) and twin is not cm
    assert twin._original is copied["model"]  # one copy of the model, shared with the parent
    assert all(p is not q for p, q in zip(copied["model"].parameters(), model.parameters()))
    with torch.no_grad():
        for p in copied["model"].parameters():
            p.mul_(0.5)
    with torch.no_grad():
        want = copied["model"](user[INDEX], item)
        torch.testing.assert_close(twin(user=user, item=item, candidate_to_request=INDEX), want)
        assert not torch.allclose(cm(user=user, item=item, candidate_to_request=INDEX), want)
    if training:
        got = _grads(copied["model"], twin(user=user, item=item, candidate_to_request=INDEX))
        expected = _grads(copied["model"], copied["model"](user[INDEX], item))
        for name, g in expected.items():
            torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-5, msg=name)
