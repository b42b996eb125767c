"""Training compiles of models whose request features are not whole arguments: DeepCTR models
(column ranges of one packed ``X``) and TorchRec models (keys of a ``KeyedJaggedTensor``, with
and without inverse indices). Every parameter's gradient equals eager's on ragged batches
(requests with 1, 3 and 17 impressions; one request; every impression its own request), in
every call layout the format takes, and 50 optimizer steps through the shared layout track
eager's losses and end at eager's weights."""

from __future__ import annotations

import functools

import pytest
import torch
from optimizer_runs import optimizer_runs
from torch.utils import _pytree as pytree

import rocs_compiler as rocs

# requests with 1, 3 and 17 impressions; one request; every impression its own request
BATCHES = {"ragged": [1, 3, 17], "one_request": [6], "one_each": [1, 1, 1, 1]}


def _loss(out) -> torch.Tensor:
    leaves = [t for t in pytree.tree_leaves(out) if t.is_floating_point()]
    return sum(((t.float() - 0.5) ** 2).mean() for t in leaves)


def _gradients(model, run) -> dict:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    _loss(run()).backward()
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


def _fifty_steps(model, steps: list) -> None:
    """50 SGD steps with momentum, eagerly and then through the compiled model from the same
    weights (``steps``: (eager call, compiled call) per batch, cycled): the losses track eager's
    and both runs end at the same weights."""
    eager, compiled = optimizer_runs(model, steps, lambda out, _: _loss(out))
    for step, (a, b) in enumerate(zip(eager, compiled)):
        assert abs(a - b) <= 2e-3 * max(1.0, abs(a)), f"step {step}: eager {a}, compiled {b}"
    assert min(eager[-3:]) < max(eager[:3])  # the run trains at all


@functools.cache
def _deepctr(name: str):
    from models_zoo.deepctr_models import build, draw, request_ranges

    model, user, _ = build(name)
    model.train()
    example, _ = draw(model, user, [2, 1, 3], seed=0)
    cm = rocs.compile(
        model, request_ranges(model, user), example_kwargs={"X": example}, training=True
    )
    return model, cm, lambda counts, seed: draw(model, user, counts, seed=seed)


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("name", ["deepfm", "din"])
def test_deepctr_column_ranges(name, batch):
    pytest.importorskip("deepctr_torch")
    model, cm, draw = _deepctr(name)
    x, index = draw(BATCHES[batch], 1)
    want = _gradients(model, lambda: model(x))
    _assert_match(_gradients(model, lambda: cm(X=x, candidate_to_request=index)), want, "shared")
    _assert_match(_gradients(model, lambda: cm(X=x)), want, "drop-in")


@pytest.mark.parametrize("name", ["deepfm", pytest.param("din", marks=pytest.mark.slow)])
def test_deepctr_fifty_steps_track_eager(name):
    pytest.importorskip("deepctr_torch")
    model, cm, draw = _deepctr(name)
    batches = [draw(counts, seed) for seed, counts in enumerate([[1, 3, 17], [4, 4], [2, 1, 5]])]
    _fifty_steps(
        model,
        [
            (lambda x=x: model(x), lambda x=x, i=i: cm(X=x, candidate_to_request=i))
            for x, i in batches
        ],
    )


@functools.cache
def _torchrec(name: str):
    from models_zoo import torchrec_models as zoo

    model, request, _ = zoo.build(name)
    model.train()
    example = zoo.draw([2, 1, 3], seed=0)
    cm = rocs.compile(model, request, example_inputs=(example.dense, example.kjt), training=True)
    return model, cm, zoo.draw


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("name", ["dlrm", "dlrm_transformer"])
def test_torchrec_kjt_keys(name, batch):
    pytest.importorskip("torchrec")
    model, cm, draw = _torchrec(name)
    counts = BATCHES[batch]
    batch = draw(counts, seed=1, histories=[(2, 0, 5)[r % 3] for r in range(len(counts))])
    want = _gradients(model, lambda: model(batch.dense, batch.kjt))
    calls = {
        "shared": lambda: cm(batch.dense, batch.shared, candidate_to_request=batch.index),
        "shared, inverse indices": lambda: cm(batch.dense, batch.shared),
        "drop-in": lambda: cm(batch.dense, batch.kjt),
    }
    for layout, call in calls.items():
        _assert_match(_gradients(model, call), want, layout)


@pytest.mark.parametrize("name", ["dlrm", pytest.param("dlrm_transformer", marks=pytest.mark.slow)])
def test_torchrec_fifty_steps_track_eager(name):
    pytest.importorskip("torchrec")
    model, cm, draw = _torchrec(name)
    batches = [draw(c, seed=s) for s, c in enumerate([[1, 3, 17], [4, 4], [2, 1, 5]])]
    _fifty_steps(
        model,
        [
            (
                lambda b=b: model(b.dense, b.kjt),
                lambda b=b: cm(b.dense, b.shared, candidate_to_request=b.index),
            )
            for b in batches
        ],
    )
