"""Which parameters get a gradient in a training compile: exactly eager's.

Frozen layers (``torch.no_grad()`` blocks, ``.detach()``) get none; heads the loss does not use
keep ``grad is None`` in every program and every timed trial of the program choice, so an
optimizer with weight decay leaves them alone.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import rocs_compiler as rocs

D = 8
INDEX = torch.tensor([1, 0, 0, 1, 1, 2])  # ragged, shuffled: 2, 3 and 1 impressions
NUM_REQUESTS = 3


class _Frozen(nn.Module):
    """A request encoder frozen by ``torch.no_grad()`` or ``.detach()``, a trained request layer
    beside it, and a candidate tower."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.frozen = nn.Linear(D, D)
        self.trained = nn.Linear(D, D)
        self.emb = nn.Embedding(10, D)
        self.item = nn.Linear(D, D)
        self.head = nn.Linear(3 * D, 1)

    def forward(self, user, ids, item):
        if self.how == "no_grad":
            with torch.no_grad():
                context = torch.relu(self.frozen(user)) + self.emb(ids)
        else:
            context = (torch.relu(self.frozen(user)) + self.emb(ids)).detach()
        mixed = torch.sigmoid(context + self.item(item))
        return self.head(torch.cat([context, self.trained(user), mixed], -1))


def _batch(seed: int):
    gen = torch.Generator().manual_seed(seed)
    user = torch.randn(NUM_REQUESTS, D, generator=gen)
    ids = torch.randint(0, 10, (NUM_REQUESTS,), generator=gen)
    item = torch.randn(len(INDEX), D, generator=gen)
    return user, ids, item


def _grads(model: nn.Module, loss: torch.Tensor) -> dict:
    model.zero_grad(set_to_none=True)
    loss.backward()
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def _assert_same(got: dict, want: dict, what: str) -> None:
    for name, g in want.items():
        assert (got[name] is None) == (g is None), (what, name, got[name] is None, g is None)
        if g is not None:
            torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-5, msg=f"{what} {name}")


@pytest.mark.parametrize("how", ["no_grad", "detach"])
def test_frozen_request_layers_get_no_gradient(how):
    model = _Frozen(how).train()
    user, ids, item = _batch(0)
    cm = rocs.compile(
        model, ["user", "ids"], example_kwargs=dict(user=user[INDEX], ids=ids[INDEX], item=item),
        training=True, options={"autotune": False},
    )  # fmt: skip
    want = _grads(model, model(user[INDEX], ids[INDEX], item).square().sum())
    assert want["frozen.weight"] is None and want["emb.weight"] is None
    shared = cm(user=user, ids=ids, item=item, candidate_to_request=INDEX)
    _assert_same(_grads(model, shared.square().sum()), want, f"{how} shared")
    dropin = cm(user=user[INDEX], ids=ids[INDEX], item=item)
    _assert_same(_grads(model, dropin.square().sum()), want, f"{how} drop-in")


class _GradInsideNoGrad(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, 1)

    def forward(self, user, item):
        with torch.no_grad():
            with torch.enable_grad():
                h = self.a(user)
        return self.b(h * item)


def test_grad_enabled_inside_no_grad_is_followed():
    model = _GradInsideNoGrad().train()
    user, _, item = _batch(0)
    cm = rocs.compile(
        model, ["user"], example_kwargs=dict(user=user[INDEX], item=item), training=True,
        options={"autotune": False},
    )  # fmt: skip
    want = _grads(model, model(user[INDEX], item).square().sum())
    assert want["a.weight"] is not None
    got = _grads(model, cm(user=user, item=item, candidate_to_request=INDEX).square().sum())
    _assert_same(got, want, "enable_grad inside no_grad")


class _TwoHeads(nn.Module):
    """A shared bottom under two task heads; the loss below uses ``ctr`` only."""

    def __init__(self):
        super().__init__()
        self.user = nn.Linear(D, D)
        self.item = nn.Linear(D, D)
        self.ctr = nn.Linear(2 * D, 1)
        self.cvr = nn.Linear(2 * D, 1)

    def forward(self, user, item):
        h = torch.cat([torch.relu(self.user(user)), self.item(item)], -1)
        return {"ctr": self.ctr(h), "cvr": torch.sigmoid(self.cvr(h))}


def test_an_unused_head_keeps_no_gradient_in_every_trial():
    """The default program choice: every trial of both programs (the training program and the
    original model, timed to the end of their backward) leaves the unused head's ``grad`` None,
    and AdamW with weight decay does not move it, in the shared and the drop-in layout."""
    model = _TwoHeads().train()
    user, _, item = _batch(0)
    cm = rocs.compile(
        model, ["user"], example_kwargs=dict(user=user[INDEX], item=item), training=True
    )
    before = [p.detach().clone() for p in model.cvr.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(44):  # 2 x 10 trials and more in each of the two buckets
        optimizer.zero_grad(set_to_none=True)
        if step % 2:
            out = cm(user=user, item=item, candidate_to_request=INDEX)
        else:
            out = cm(user=user[INDEX], item=item)
        out["ctr"].square().sum().backward()
        assert model.cvr.weight.grad is None and model.cvr.bias.grad is None, step
        assert model.ctr.weight.grad is not None, step
        optimizer.step()
    assert {k[0] for k in cm.program_choices()} == {"train-shared", "train-dropin"}
    for p, b in zip(model.cvr.parameters(), before):
        assert torch.equal(p.detach(), b)



@pytest.mark.parametrize(
    "register",
    [
        lambda m: m.register_full_backward_hook(lambda mod, gi, go: tuple(g * 3 for g in gi)),
        lambda m: m.register_full_backward_pre_hook(lambda mod, go: tuple(g * 3 for g in go)),
    ],
    ids=["full_backward_hook", "full_backward_pre_hook"],
)
def test_a_module_backward_hook_is_refused_naming_the_module(register):
    model = _TwoHeads().train()
    register(model.ctr)
    user, _, item = _batch(0)
    with pytest.raises(rocs.CompileError, match="module 'ctr' \\(Linear\\) has a backward hook"):
        rocs.compile(
            model, ["user"], example_kwargs=dict(user=user[INDEX], item=item), training=True
        )


def test_a_parameter_hook_is_followed():
    """A tensor hook on a parameter scales its gradient in the compiled backward as in eager."""
    model = _TwoHeads().train()
    model.user.weight.register_hook(lambda g: g * 3)
    user, _, item = _batch(0)
    cm = rocs.compile(
        model, ["user"], example_kwargs=dict(user=user[INDEX], item=item), training=True,
        options={"autotune": False},
    )  # fmt: skip
    want = _grads(model, model(user[INDEX], item)["ctr"].square().sum())
    got = _grads(model, cm(user=user, item=item, candidate_to_request=INDEX)["ctr"].square().sum())
    _assert_same(got, want, "parameter hook")
