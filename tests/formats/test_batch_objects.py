"""Models taking a batch object: a ``NamedTuple`` or a dataclass (nested too), whose fields are
named like dict keys (``"batch.user"``)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import pytest
import torch
from torch import nn

import rocs_compiler as rocs

INDEX = torch.tensor([0, 0, 1, 2, 2, 2, 1])


class TupleBatch(NamedTuple):
    user: torch.Tensor
    item: torch.Tensor


@dataclasses.dataclass
class UserFeatures:
    dense: torch.Tensor


@dataclasses.dataclass
class ClassBatch:
    user: UserFeatures
    item: torch.Tensor


class Ranker(nn.Module):
    def __init__(self):
        super().__init__()
        self.user = nn.Linear(4, 8)
        self.head = nn.Linear(12, 1)

    def forward(self, batch):
        user = batch.user.dense if isinstance(batch.user, UserFeatures) else batch.user
        return self.head(torch.cat([self.user(user).relu(), batch.item], -1)).squeeze(-1)


@pytest.mark.parametrize(
    "make, request_name",
    [
        (lambda u, c: TupleBatch(u, c), "batch.user"),
        (lambda u, c: ClassBatch(UserFeatures(u), c), "batch.user"),  # covers batch.user.dense
    ],
    ids=["namedtuple", "nested-dataclass"],
)
def test_batch_object_fields_are_named_like_keys(make, request_name):
    torch.manual_seed(0)
    model = Ranker().eval()
    u, c = torch.randn(3, 4), torch.randn(7, 4)
    example = {"batch": make(u[[0, 0, 1]], c[:3])}
    compiled = rocs.compile(model, [request_name], example_kwargs=example)
    with torch.no_grad():
        want = model(make(u[INDEX], c))
        torch.testing.assert_close(compiled(make(u[INDEX], c)), want)
        torch.testing.assert_close(compiled(make(u, c), candidate_to_request=INDEX), want)
    report = compiled.report(candidates=64)
    assert report.request_flops == 2 * 4 * 8 + 2 * 8 * 1  # the user tower and its head share


def test_an_unknown_field_lists_the_names():
    model = Ranker().eval()
    u, c = torch.randn(3, 4), torch.randn(3, 4)
    with pytest.raises(rocs.InputError, match="batch.user.dense"):
        example = {"batch": ClassBatch(UserFeatures(u), c)}
        rocs.compile(model, ["batch.users"], example_kwargs=example)
