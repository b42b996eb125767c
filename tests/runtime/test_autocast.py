"""Calls under ``torch.autocast`` compute eager's autocast numerics (``runtime/modes/autocast.py``).

The fused linear's CPU kernel used to meet a bfloat16 request partial (autocast's ``linear``)
and float32 weights: "mat1 and mat2 must have the same dtype". A call under autocast now runs
the original compiled under that autocast. Oracle: the original model under the same autocast;
the bfloat16 contract of docs/contract.md (within one ulp of eager, equal almost everywhere).
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_numerics import HEADS, _batch, module, ulp

import rocs_compiler as rocs

CALLS = 13  # past the program choice's trials, so both programs run
BF16 = torch.bfloat16


def _within_bf16_contract(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype == BF16
    assert bool(((got.float() - want.float()).abs() <= ulp(want)).all())
    assert (got != want).float().mean().item() <= 0.01


def _model(name: str, train: bool = False):
    torch.manual_seed(0)
    forward, children = HEADS[name]
    model = module(forward, **children())
    return model.train() if train else model


def _compile(model, **options):
    u, c, index = _batch(torch.float32)
    example = {"u": u[index[:4]], "c": c[:4]}
    return rocs.compile(model, ["u"], example_kwargs=example, options=options)


@pytest.mark.parametrize("name", ["split_linear", "split_matmul"])
def test_calls_under_autocast_are_eager_under_autocast_in_every_layout(name):
    model = _model(name)
    cm = _compile(model)
    u, c, index = _batch(torch.float32)
    with torch.no_grad():
        assert float(model(u[index], c).std()) > 0.1  # rows differ far more than bf16's ulp
        for _ in range(CALLS):
            with torch.autocast("cpu", dtype=BF16):
                want = model(u[index], c)
                for got in (
                    cm(u=u, c=c, candidate_to_request=index),
                    cm(u=u[index], c=c),
                    cm.call_replicated(u=u[index], c=c, candidate_to_request=index),
                ):
                    _within_bf16_contract(got, want)
        # Outside autocast: the float32 program, as compiled.
        torch.testing.assert_close(cm(u=u, c=c, candidate_to_request=index), model(u[index], c))
    with torch.autocast("cpu", dtype=BF16):
        under = cm._autocast.program()  # the compile under autocast still shares
    assert under.report().pass_counts[name] == 1


def test_a_training_compile_under_autocast_has_eager_gradients():
    model = _model("split_linear", train=True)
    reference = copy.deepcopy(model)
    cm = _compile(model, training=True)
    u, c, index = _batch(torch.float32)
    for _ in range(3):  # the program choice's trials run either program: each must match
        with torch.autocast("cpu", dtype=BF16):
            got = cm(u=u, c=c, candidate_to_request=index)
            want = reference(u[index], c)
        _within_bf16_contract(got, want)
        (got.float() ** 2).mean().backward()
        (want.float() ** 2).mean().backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=1e-3, msg=name)
            p.grad = q.grad = None
