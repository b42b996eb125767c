"""Training compiles of models whose request features are not whole arguments: DeepCTR models
(column ranges of one packed ``X``) and TorchRec models (keys of a ``KeyedJaggedTensor``, with
and without inverse indices). Every parameter's gradient equals eager's on a ragged batch
(requests with 1, 3 and 17 impressions), in every call layout the format takes."""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree

import rocs_compiler as rocs


def _gradients(model, run) -> dict:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    out = run()
    leaves = [t for t in pytree.tree_leaves(out) if t.is_floating_point()]
    sum(((t.float() - 0.5) ** 2).mean() for t in leaves).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _assert_match(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), what
    for name, g in want.items():
        atol = 1e-5 * max(1.0, float(g.abs().max()))
        torch.testing.assert_close(
            got[name], g, rtol=1e-4, atol=atol, msg=lambda m, name=name: f"{what} {name}: {m}"
        )


@pytest.mark.parametrize("name", ["deepfm", "din"])
def test_deepctr_column_ranges(name):
    pytest.importorskip("deepctr_torch")
    from models_zoo.deepctr_models import build, draw, request_ranges

    model, user, _ = build(name)
    model.train()
    example, _ = draw(model, user, [2, 1, 3], seed=0)
    cm = rocs.compile(
        model, request_ranges(model, user), example_kwargs={"X": example}, training=True
    )
    x, index = draw(model, user, [1, 3, 17], seed=1)
    want = _gradients(model, lambda: model(x))
    _assert_match(_gradients(model, lambda: cm(X=x, candidate_to_request=index)), want, "shared")
    _assert_match(_gradients(model, lambda: cm(X=x)), want, "drop-in")


@pytest.mark.parametrize("name", ["dlrm", "dlrm_transformer"])
def test_torchrec_kjt_keys(name):
    pytest.importorskip("torchrec")
    from models_zoo import torchrec_models as zoo

    model, request, _ = zoo.build(name)
    model.train()
    example = zoo.draw([2, 1, 3], seed=0)
    cm = rocs.compile(model, request, example_inputs=(example.dense, example.kjt), training=True)
    batch = zoo.draw([1, 3, 17], seed=1, histories=[2, 0, 5])
    want = _gradients(model, lambda: model(batch.dense, batch.kjt))
    calls = {
        "shared": lambda: cm(batch.dense, batch.shared, candidate_to_request=batch.index),
        "shared, inverse indices": lambda: cm(batch.dense, batch.shared),
        "drop-in": lambda: cm(batch.dense, batch.kjt),
    }
    for layout, call in calls.items():
        _assert_match(_gradients(model, call), want, layout)
