"""In-place reuse of dying temporaries in the direct program (runtime/program/inplace.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rocs_compiler.runtime.program.direct import DirectProgram
from rocs_compiler.runtime.program.inplace import inplace_plan, select_scatter_into, slice_scatter_into

aten = torch.ops.aten


class Relu(nn.Module):
    def forward(self, x, w):
        return torch.relu(x @ w)


class ReluWithLiveView(nn.Module):
    def forward(self, x, w):
        y = x @ w
        flat = y.view(-1)  # outlives relu(y): writing relu into y would change it
        return torch.relu(y), flat * 2


class ReluOfOutput(nn.Module):
    def forward(self, x, w):
        y = x @ w
        return torch.relu(y), y


class ReluAfterEvalDropout(nn.Module):
    """Eval-mode ``aten.dropout`` returns its input itself: its result is not a fresh tensor."""

    def __init__(self):
        super().__init__()
        self.dropout = nn.Dropout(0.2)

    def forward(self, x, w):
        y = x @ w
        return torch.relu(self.dropout(y)), y


class AddBias(nn.Module):
    def forward(self, x, w, b):
        return b + x @ w  # the dying product is the second operand: add commutes


class ScaleAndShift(nn.Module):
    def forward(self, x, w):
        return (x @ w) * 0.5 - 1.5  # Python scalars as the other operand


class SubFromBias(nn.Module):
    def forward(self, x, w, b):
        return b - x @ w  # sub does not commute, and b is an input


class Broadcasting(nn.Module):
    def forward(self, x, w):
        s = x.sum(1, keepdim=True)  # [B, 1] broadcast into [B, M]: cannot hold the result
        return s + x @ w


class Promoting(nn.Module):
    def forward(self, x, w):
        return (x @ w).argmax(1) * 2.5  # int64 temporary, float result


class SinThenClamp(nn.Module):
    """Any elementwise op with an in-place variant reuses its dying operand."""

    def forward(self, x, w):
        return torch.clamp(torch.sin(x @ w), -0.5, 0.5)


class Where(nn.Module):
    def forward(self, x, w):
        y = x @ w
        return torch.where(y > 0, y, 0.1 * y)  # where has no in-place variant with its args


class ScatterIntoDyingTemporary(nn.Module):
    """``y[:, 0] *= 2`` after functionalization; the view read by ``mul`` runs before the write."""

    def forward(self, x, w):
        y = x @ w
        z = torch.select_scatter(y, y[:, 0] * 2, 1, 0)
        return torch.slice_scatter(z, z[:, 1:3] + 1, 1, 1, 3).relu()


class ScatterWithViewReadAfter(nn.Module):
    def forward(self, x, w):
        y = x @ w
        column = y[:, 1]  # read after the write: y must keep its values
        return torch.select_scatter(y, y[:, 0] * 2, 1, 1), column * 3


class ScatterOfOwnView(nn.Module):
    def forward(self, x, w):
        y = x @ w
        return torch.slice_scatter(y, y[:, 0:2], 1, 1, 3)  # overlapping source and target


def _export(model, *args):
    ep = torch.export.export(model, args)
    return ep, ep.graph_module


def _plan(gm):
    nodes = list(gm.graph.nodes)
    last_use = {}
    for node in nodes:
        for arg in node.all_input_nodes:
            last_use[arg] = node
    return {n.target: op for n, (op, _) in inplace_plan(nodes, last_use, set()).items()}


X, W, B = torch.randn(4, 3), torch.randn(3, 5), torch.randn(5)

CASES = [
    (Relu(), (X, W), {aten.relu.default: aten.relu_.default}),
    (ReluWithLiveView(), (X, W), {}),
    (ReluOfOutput(), (X, W), {}),
    (ReluAfterEvalDropout().eval(), (X, W), {}),
    (AddBias(), (X, W, B), {aten.add.Tensor: aten.add_.Tensor}),
    (ScaleAndShift(), (X, W), {aten.mul.Tensor: aten.mul_.Tensor, aten.sub.Tensor: aten.sub_.Tensor}),
    (SubFromBias(), (X, W, B), {}),
    (Broadcasting(), (X, W), {aten.add.Tensor: aten.add_.Tensor}),
    (Promoting(), (X, W), {}),
    (SinThenClamp(), (X, W), {aten.sin.default: aten.sin_.default, aten.clamp.default: aten.clamp_.default}),
    (Where(), (X, W), {}),  # y is read again by where; where has no in-place variant
    (
        ScatterIntoDyingTemporary(),
        (X, W),
        {
            aten.select_scatter.default: select_scatter_into,
            aten.slice_scatter.default: slice_scatter_into,
            aten.relu.default: aten.relu_.default,
        },
    ),
    (ScatterWithViewReadAfter(), (X, W), {}),
    (ScatterOfOwnView(), (X, W), {}),
]


@pytest.mark.parametrize("model, args, expected", CASES, ids=[type(c[0]).__name__ for c in CASES])
def test_plan_and_program_agree_with_the_model(model, args, expected):
    ep, gm = _export(model, *args)
    assert _plan(gm) == expected
    program = DirectProgram(gm)
    got = program(*args)
    want = model(*args)
    want = want if isinstance(want, tuple) else (want,)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_broadcasting_reuses_the_full_size_operand_only():
    ep, gm = _export(Broadcasting(), X, W)
    nodes = list(gm.graph.nodes)
    last_use = {a: n for n in nodes for a in n.all_input_nodes}
    (node, (op, args)), = inplace_plan(nodes, last_use, set()).items()
    assert args[0].target == aten.matmul.default  # the [B, M] product, not the [B, 1] sum
