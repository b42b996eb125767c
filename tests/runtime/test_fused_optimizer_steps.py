"""Fused optimizer steps reach an inference compile: folded constants and the request cache.

A fused step (``fused=True``) writes its parameters in one kernel that bumps no version counter;
the compiled model must still compute with the stepped weights, and a request cache must not
hand out rows computed with the old ones. Oracle: the eager original model after the same steps,
on a ragged batch (requests with 3, 1 and 5 candidates).
"""

from __future__ import annotations

import pytest
import torch
from models_for_tests import assert_outputs_match, eager
from torch import nn

import rocs_compiler as rocs
from rocs_compiler.ir.graph_meta import FOLD

torch.set_num_threads(1)

COUNTS = [3, 1, 5]
FUSED = {
    "SGD": lambda params: torch.optim.SGD(params, lr=0.5, momentum=0.9, fused=True),
    "Adam": lambda params: torch.optim.Adam(params, lr=0.2, fused=True),
    "AdamW": lambda params: torch.optim.AdamW(params, lr=0.2, weight_decay=0.1, fused=True),
    "Adagrad": lambda params: torch.optim.Adagrad(params, lr=0.5, fused=True),
}


class Head(nn.Module):
    """A Linear over cat(request, candidate) features: its weight's request columns are folded
    into a constant of their own (the defer pass's column slice)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.h = nn.Linear(8, 3)

    def forward(self, u, c):
        return self.h(torch.cat([torch.relu(self.a(u)), c], -1))


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    requests = torch.randn(len(COUNTS), 4, generator=g)
    index = torch.repeat_interleave(torch.arange(len(COUNTS)), torch.tensor(COUNTS))
    return requests, torch.randn(int(index.numel()), 4, generator=g), index


def _compiled(**kwargs):
    torch.manual_seed(0)
    model = Head().eval()
    u, c, index = _batch(0)
    cm = rocs.compile(model, request_inputs=["u"], example_kwargs=dict(u=u[index], c=c), **kwargs)
    return model, cm


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    u, c, index = _batch(seed)
    optimizer.zero_grad()
    model(u[index], c).square().mean().backward()
    optimizer.step()


def _assert_same(model, cm, what: str, seed: int = 1) -> None:
    u, c, index = _batch(seed)
    expected = eager(model, dict(u=u[index], c=c))
    with torch.no_grad():
        assert_outputs_match(cm(u=u[index], c=c), expected, f"{what}, drop-in")
        shared = cm(u=u, c=c, candidate_to_request=index)
    assert_outputs_match(shared, expected, f"{what}, shared layout")


@pytest.mark.parametrize("name", list(FUSED))
def test_a_fused_step_reaches_the_folded_weight_slices(name):
    model, cm = _compiled()
    gm = cm.graph_module
    assert any(n.op == "get_attr" and FOLD in n.meta for n in gm.graph.nodes), "nothing folded"
    _assert_same(model, cm, "compiled")
    u, c, index = _batch(1)
    before = eager(model, dict(u=u[index], c=c))
    versions = [p._version for p in model.parameters()]
    optimizer = FUSED[name](model.parameters())
    for step in range(2):
        _step(model, optimizer, seed=10 + step)
        _assert_same(model, cm, f"after fused {name} step {step}")
    assert (eager(model, dict(u=u[index], c=c)) - before).abs().max() > 0.05, "the steps moved"
    assert [p._version for p in model.parameters()] != versions


@pytest.mark.parametrize("name", ["Adam", "SGD"])
def test_a_fused_step_empties_the_request_cache(name):
    cache = rocs.RequestCache(1 << 20, autotune=False)
    model, cm = _compiled(options={"autotune": False}, request_cache=cache)
    u, c, index = _batch(1)
    with torch.no_grad():
        cm(u=u, c=c, candidate_to_request=index)
        cm(u=u, c=c, candidate_to_request=index)
    assert cm.cache_stats()["hits"] == len(COUNTS), "the second call hits"
    _step(model, FUSED[name](model.parameters()), seed=10)
    expected = eager(model, dict(u=u[index], c=c))
    with torch.no_grad():
        got = cm(u=u, c=c, candidate_to_request=index)
    assert_outputs_match(got, expected, f"cached requests after a fused {name} step")
    stats = cm.cache_stats()
    assert stats["invalidations"] == 1 and stats["hits"] == len(COUNTS)


def test_parameters_of_models_not_compiled_keep_their_versions():
    """The step hook bumps only tensors a compiled model reads."""
    _compiled()
    other = nn.Linear(4, 2)
    optimizer = torch.optim.Adam(other.parameters(), lr=0.1, fused=True)
    other(torch.randn(3, 4)).sum().backward()
    versions = [p._version for p in other.parameters()]
    optimizer.step()
    assert [p._version for p in other.parameters()] == versions
