"""cleanup on compiled graphs: full slices vanish, partial ones stay, results unchanged."""

from __future__ import annotations

import torch
from models_for_tests import Case, Spec, check_both_conventions
from torch import nn

import rocs_compiler as rocs
from rocs_compiler.kernels.request_groups import group_by_request


class Slices(nn.Module):
    def __init__(self):
        super().__init__()
        self.user_lin = nn.Linear(8, 8)

    def forward(self, user, item):
        u = self.user_lin(user)[:]  # a full slice over the batch dim
        whole = item[:, :100]  # past the end: all 8 columns
        part = item[:, 1:5]
        return (u * whole).sum(-1) + part.sum(-1)


SLICES = Case("slices", Slices, ("user",), (("user", Spec((8,))), ("item", Spec((8,)))))


def _slices(gm) -> list[tuple]:
    return [
        tuple(n.args[1:])
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target == torch.ops.aten.slice.Tensor
    ]


def test_full_slices_are_dropped_and_partial_ones_kept():
    model = SLICES.build()
    cm = SLICES.compile(model)
    assert _slices(cm.graph_module) == [(1, 1, 5)]
    for counts, shuffle in (([2, 3], True), ([1], False), ([4, 1, 2], True)):
        check_both_conventions(cm, model, SLICES.batch(counts, seed=3, shuffle=shuffle), str(counts))


def test_grouping_is_reused_for_one_index_and_redone_after_a_change():
    idx = torch.tensor([1, 0, 1, 2, 0])
    first = group_by_request(idx, 3)
    assert group_by_request(idx, 3) is first
    idx[0] = 2  # in place: the version counter moves on
    regrouped = group_by_request(idx, 3)
    assert regrouped is not first
    rows = {int(r): g.candidates[i].tolist() for g in regrouped for i, r in enumerate(g.requests)}
    assert rows == {0: [1, 4], 1: [2], 2: [0, 3]}
    assert group_by_request(idx.clone(), 3) is not regrouped


class ColumnVectorMix(torch.nn.Module):
    """DCN-mixture style: low-rank maps applied to x as a column vector, W @ x with x [B, d, 1]."""

    def __init__(self, d: int = 8, r: int = 4):
        super().__init__()
        self.V = torch.nn.Parameter(torch.randn(2, d, r))
        self.U = torch.nn.Parameter(torch.randn(2, d, r))

    def forward(self, u, c):
        x = torch.cat([u, c], 1).unsqueeze(2)
        for i in range(2):
            x = x + torch.matmul(self.U[i], torch.tanh(torch.matmul(self.V[i].t(), x)))
        return x.squeeze(2).sum(1)


def test_weight_first_matmuls_run_as_the_originals_folded_mm():
    """matmul(W, x [B, d, 1]) folds into one mm in eager (W requires grad); the compiled graph
    spells that mm out instead of a batched matmul, with the very same bits."""
    torch.manual_seed(0)
    model = ColumnVectorMix().eval()
    u, c = torch.randn(3, 4), torch.randn(7, 4)
    index = torch.tensor([0, 0, 1, 2, 2, 2, 1])
    cm = rocs.compile(
        model, ["u"], example_kwargs={"u": u[[0, 0, 1]], "c": c[:3]},
        options={"defer": False, "ikbo": False},
    )  # fmt: skip
    nodes = list(cm.graph_module.graph.nodes)
    assert not any(n.target == torch.ops.aten.matmul.default for n in nodes)
    assert sum(n.target == torch.ops.aten.mm.default for n in nodes) == 4
    with torch.no_grad():
        want = model(u[index], c)
        torch.testing.assert_close(cm(u=u[index], c=c), want, rtol=0, atol=0)
        torch.testing.assert_close(cm(u=u, c=c, candidate_to_request=index), want, rtol=0, atol=0)


def test_weight_first_matmuls_with_the_default_passes_are_exact():
    torch.manual_seed(0)
    model = ColumnVectorMix().eval()
    u, c = torch.randn(3, 4), torch.randn(7, 4)
    index = torch.tensor([0, 0, 1, 2, 2, 2, 1])
    cm = rocs.compile(model, ["u"], example_kwargs={"u": u[[0, 0, 1]], "c": c[:3]})
    with torch.no_grad():
        want = model(u[index], c)
        torch.testing.assert_close(cm(u=u, c=c, candidate_to_request=index), want)
        torch.testing.assert_close(cm(u=u[index], c=c), want)


class Dropouts(nn.Module):
    """Dropout in eval mode (a copy after functionalization) inside the graph and at its end."""

    def __init__(self):
        super().__init__()
        self.user_lin = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)

    def forward(self, user, item):
        hidden = self.drop(torch.relu(self.user_lin(user)) * item)
        return self.drop(hidden.sum(-1)), self.drop(item)


DROPOUTS = Case("dropouts", Dropouts, ("user",), (("user", Spec((8,))), ("item", Spec((8,)))))


def test_copies_inside_the_graph_are_dropped():
    model = DROPOUTS.build()
    cm = DROPOUTS.compile(model)
    clones = [n for n in cm.graph_module.graph.nodes if n.target == torch.ops.aten.clone.default]
    assert all(any(u.op == "output" for u in n.users) for n in clones), clones
    batch = DROPOUTS.batch([2, 3], seed=1, shuffle=True)
    check_both_conventions(cm, model, batch, "dropouts")


class InPlaceColumns(nn.Module):
    """Writes through views of temporaries: functionalized into ``select_scatter`` inside a
    ``slice_scatter`` over the whole batch dim (the ``x[:]`` the write went through)."""

    def __init__(self):
        super().__init__()
        self.user_lin, self.item_lin = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, user, item):
        u = self.user_lin(user)
        u[:, 0].mul_(2.0)
        i = self.item_lin(item)
        i[:, 1:3] += u[:, 3:5]
        return (u.relu() * i).sum(-1), i[:, 2]


IN_PLACE = Case("in_place_columns", InPlaceColumns, ("user",), SLICES.specs)


def test_full_scatters_are_dropped_and_partial_ones_kept():
    model = IN_PLACE.build()
    cm = IN_PLACE.compile(model)
    scatters = [
        (n.target, n.args[2:])
        for n in cm.graph_module.graph.nodes
        if n.op == "call_function" and "scatter" in str(n.target)
    ]
    aten = torch.ops.aten
    assert sorted(scatters, key=str) == [
        (aten.select_scatter.default, (1, 0)),
        (aten.slice_scatter.default, (1, 1, 3)),
    ]
    for counts, shuffle in (([2, 3], True), ([1], False), ([4, 1, 2], True)):
        batch = IN_PLACE.batch(counts, seed=5, shuffle=shuffle)
        check_both_conventions(cm, model, batch, str(counts))
