"""One description of ATen op families, used by the role rules, defer, in-place planning and
the pointwise program language; and the drifts that description fixed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import rocs_compiler as rocs
from rocs_compiler.analysis import op_groups, role_rules
from rocs_compiler.kernels.pointwise_program import PRIMITIVES

aten = torch.ops.aten

# Elementwise ops that the role rules always treated as row-wise but defer never distributed.
ONCE_MISSING_FROM_DEFER = {
    "sin": torch.sin, "cos": torch.cos, "log1p": torch.log1p, "expm1": torch.expm1,
    "floor": torch.floor, "erf": torch.erf, "hardswish": nn.functional.hardswish,
    "hardsigmoid": nn.functional.hardsigmoid, "selu": torch.selu,
    "log_sigmoid": nn.functional.logsigmoid, "nan_to_num": torch.nan_to_num,
}


def test_every_program_primitive_is_an_elementwise_op():
    for name, primitive in PRIMITIVES.items():
        if primitive.aten is not None:
            assert op_groups.is_elementwise(primitive.aten), name


def test_every_elementwise_op_has_the_elementwise_role_rule():
    for op in (aten.sin.default, aten.hardswish.default, aten.add.Tensor, aten.where.self):
        assert role_rules.lookup(op) is role_rules.elementwise_rule


def test_random_and_mutating_ops_are_not_elementwise():
    assert not op_groups.is_elementwise(aten.bernoulli.p)
    assert not op_groups.is_elementwise(aten.rand_like.default)
    assert not op_groups.is_elementwise(aten.add_.Tensor)
    assert not op_groups.is_elementwise(aten.prelu.default)  # weight aligned with dim 1


def test_inplace_variants_follow_the_family():
    assert op_groups.inplace_variant(aten.sin.default) == aten.sin_.default
    assert op_groups.inplace_variant(aten.add.Tensor) == aten.add_.Tensor
    assert op_groups.inplace_variant(aten.linear.default) is None
    assert op_groups.inplace_variant(aten.where.self) is None


class ElementwiseOfMixedConcat(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.user = nn.Linear(4, 4)
        self.head = nn.Linear(8, 1)

    def forward(self, u, c):
        return self.head(self.fn(torch.cat([self.user(u), c], -1))).squeeze(-1)


def _ragged(dim: int = 4):
    index = torch.tensor([1, 0, 0, 2, 1, 1])
    return torch.randn(3, dim), torch.randn(6, dim), index


@pytest.mark.parametrize("name", sorted(ONCE_MISSING_FROM_DEFER))
def test_elementwise_ops_distribute_over_a_mixed_concat(name):
    torch.manual_seed(0)
    model = ElementwiseOfMixedConcat(ONCE_MISSING_FROM_DEFER[name]).eval()
    u, c, index = _ragged()
    cm = rocs.compile(model, ["u"], example_kwargs={"u": u[index], "c": c})
    report = cm.report()
    assert report.pass_counts["distribute_pointwise"] >= 1
    # The user tower and the op on its lanes run once per request.
    request_ops = {n.op for n in report.nodes if n.role == "REQUEST"}
    assert any(name.replace("_", "") in op.replace("_", "") for op in request_ops), request_ops
    with torch.no_grad():
        want = model(u[index], c)
        torch.testing.assert_close(cm(u=u, c=c, candidate_to_request=index), want, equal_nan=True)
        torch.testing.assert_close(cm(u=u[index], c=c), want, equal_nan=True)


class PReLUOverChannels(nn.Module):
    """prelu over [B, C, L] with one slope per channel, channels concatenated."""

    def __init__(self):
        super().__init__()
        self.user = nn.Linear(4, 8)
        self.prelu = nn.PReLU(4)

    def forward(self, u, c):
        x = torch.cat([self.user(u).view(-1, 2, 4), c.view(-1, 2, 4)], 1)  # [B, 4, 4]
        return self.prelu(x).sum((1, 2))


class PReLUOverFeatures(nn.Module):
    def __init__(self):
        super().__init__()
        self.user = nn.Linear(4, 4)
        self.prelu = nn.PReLU(8)

    def forward(self, u, c):
        return self.prelu(torch.cat([self.user(u), c], 1)).sum(1)


@pytest.mark.parametrize("model_cls, cand_dim", [(PReLUOverChannels, 8), (PReLUOverFeatures, 4)])
def test_prelu_distributes_with_its_slopes_split_per_channel(model_cls, cand_dim):
    torch.manual_seed(0)
    model = model_cls().eval()
    with torch.no_grad():
        model.prelu.weight.uniform_(-1, 1)
    u, c, index = _ragged()
    c = torch.randn(6, cand_dim)
    cm = rocs.compile(model, ["u"], example_kwargs={"u": u[index], "c": c})
    assert cm.report().pass_counts["distribute_prelu"] == 1
    with torch.no_grad():
        want = model(u[index], c)
        torch.testing.assert_close(cm(u=u, c=c, candidate_to_request=index), want, equal_nan=True)
