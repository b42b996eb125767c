"""ikbo_weight_matmul: ``matmul(x [N, *B, m, k], W [*B, k, n])`` becomes one GEMM per B index."""

from __future__ import annotations

import pytest
import torch
from models_for_tests import Case, Spec, check_both_conventions
from torch import nn

H, K = 3, 5


class BilinearHeads(nn.Module):
    """FinalMLP-style per-head bilinear form between a user and an item vector."""

    def __init__(self, weight_batch: tuple[int, ...] = (H,), rows: int = 1, view_after: bool = False):
        super().__init__()
        self.rows = rows
        self.view_after = view_after
        self.user_lin = nn.Linear(4, H * K)
        self.w = nn.Parameter(torch.randn(*weight_batch, K, K))

    def forward(self, user, item):
        x = item.view(-1, H, self.rows, K)  # [N, H, m, K]
        y = self.user_lin(user).view(-1, H, K, 1)
        xw = torch.matmul(x, self.w)  # W broadcast over candidates
        if self.view_after:  # .view needs the rewritten (permuted) result made contiguous
            return (xw.view(xw.shape[0], -1) * y.view(y.shape[0], -1).repeat(1, self.rows)).sum(-1)
        return torch.matmul(xw, y).flatten(1).sum(-1)


def _case(**kw) -> Case:
    rows = kw.get("rows", 1)
    return Case(
        "bilinear_heads",
        lambda: BilinearHeads(**kw),
        ("user",),
        (("user", Spec((4,))), ("item", Spec((H * rows * K,)))),
    )


@pytest.mark.parametrize("rows, view_after", [(1, False), (2, False), (2, True)])
def test_broadcast_weight_matmul_is_rewritten_and_exact(rows, view_after):
    case = _case(rows=rows, view_after=view_after)
    model = case.build()
    cm = case.compile(model)
    assert cm.report().pass_counts["ikbo_weight_matmul"] == 1
    for node in cm.graph_module.graph.nodes:
        if node.target == torch.ops.aten.matmul.default:
            a, b = (x.meta["val"] for x in node.args)
            assert a.dim() == b.dim(), "a matmul still broadcasts a weight over candidates"
    for counts, shuffle in (([2, 3, 1], True), ([1], False), ([5], False)):
        check_both_conventions(cm, model, case.batch(counts, seed=1, shuffle=shuffle), str(counts))


def test_weight_with_size_one_batch_dims_is_left_alone():
    case = _case(weight_batch=(1,))
    model = case.build()
    cm = case.compile(model)
    assert cm.report().pass_counts["ikbo_weight_matmul"] == 0
    check_both_conventions(cm, model, case.batch([3, 2], seed=2, shuffle=True))
