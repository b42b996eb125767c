"""Hostile models: each once gave a silent wrong answer or an unclear error. Every case is a
differential test against eager on a ragged batch, in both call layouts."""

from __future__ import annotations

import torch
from torch import nn

import rocs_compiler as rocs

INDEX = torch.tensor([0, 0, 1, 2, 2, 2, 1])  # 3 requests with 2, 2 and 3 candidates, shuffled


def module(forward, **children) -> nn.Module:
    """A module whose forward is ``forward(self, u, c)``, with the given children."""
    model = type("Hostile", (nn.Module,), {"forward": forward})()
    for name, child in children.items():
        setattr(model, name, child)
    return model.eval()


def assert_exact(model: nn.Module, u: torch.Tensor, c: torch.Tensor, **compile_kwargs):
    """Compile on a small replicated example; compare both layouts with eager on INDEX."""
    example = {"u": u[[0, 0, 1]], "c": c[:3]}
    cm = rocs.compile(model, ["u"], example_kwargs=example, **compile_kwargs)
    with torch.no_grad():
        want = model(u[INDEX], c)
        torch.testing.assert_close(cm(u=u, c=c, candidate_to_request=INDEX), want)
        torch.testing.assert_close(cm(u=u[INDEX], c=c), want)
    return cm


def test_matmul_of_a_concatenation_with_a_vector():
    """matmul(cat(request, candidate, dim=-2), vector) drops the vector dim: the distributed
    pieces concatenate along the output's last dim, not its batch dim."""

    def forward(s, u, c):
        x = torch.cat([s.a(u).view(-1, 2, 4), c.repeat(1, 2).view(-1, 2, 4)], 1)
        return torch.matmul(x, s.v)

    torch.manual_seed(0)
    model = module(forward, a=nn.Linear(4, 8), v=nn.Parameter(torch.randn(4)))
    cm = assert_exact(model, torch.randn(3, 4), torch.randn(7, 4))
    assert cm.report().pass_counts["distribute_matmul"] == 1


def test_python_numbers_computed_from_the_batch_size_follow_the_batch():
    def forward(s, u, c):
        return (u * c).sum(-1), c.shape[0] / 2, 1.5, c.shape[0] * 2

    model = module(forward)
    u, c = torch.randn(3, 4), torch.randn(7, 4)
    cm = rocs.compile(model, ["u"], example_kwargs={"u": u[[0, 0, 1]], "c": c[:3]})
    with torch.no_grad():
        want = model(u[INDEX], c)
        for got in (cm(u=u, c=c, candidate_to_request=INDEX), cm(u=u[INDEX], c=c)):
            torch.testing.assert_close(got[0], want[0])
            assert got[1:] == want[1:] == (3.5, 1.5, 14)
        program = rocs.export(cm)
        exported = program.module()(u=u, c=c, candidate_to_request=INDEX)
        assert exported[1:] == want[1:]
