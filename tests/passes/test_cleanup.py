"""cleanup on compiled graphs: full slices vanish, partial ones stay, results unchanged."""

from __future__ import annotations

import torch
from models_for_tests import Case, Spec, check_both_conventions
from torch import nn

import rocs_compiler as rocs
from rocs_compiler.kernels.request_groups import call_groups, group_by_request


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


def test_grouping_is_reused_within_one_call_and_never_across_calls():
    idx = torch.tensor([1, 0, 1, 2, 0])
    with call_groups(idx):
        first = group_by_request(idx, 3)
        assert group_by_request(idx, 3) is first  # every op of one call shares the grouping
        assert group_by_request(idx.clone(), 3) is not first  # another tensor: grouped anew
    assert group_by_request(idx, 3) is not first  # outside the call nothing is kept
    idx[0] = 2
    with call_groups(idx):
        regrouped = group_by_request(idx, 3)
    rows = {int(r): g.candidates[i].tolist() for g in regrouped for i, r in enumerate(g.requests)}
    assert rows == {0: [1, 4], 1: [2], 2: [0, 3]}


def test_calls_on_two_threads_never_see_each_others_grouping():
    import threading

    seen = {}

    def call(name, idx, num_requests):
        with call_groups(idx):
            barrier.wait()
            seen[name] = group_by_request(idx, num_requests)

    barrier = threading.Barrier(2)
    a, b = torch.tensor([0, 0, 1]), torch.tensor([1, 0, 0, 0])
    threads = [threading.Thread(target=call, args=(n, i, 2)) for n, i in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(g.count for g in seen["a"]) == [1, 2]
    assert sorted(g.count for g in seen["b"]) == [1, 3]


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


def _blas_ignores_the_weight_layout(model: ColumnVectorMix, rows: int) -> bool:
    """Whether this machine's GEMM gives the same bits for a weight operand stored row-major (as
    eager passes ``V[i]``) and column-major (the transpose of the folded contiguous ``V[i].t()``
    that the compiled graph passes). MKL on AVX-512 does; on AVX2 it sums in another order."""
    x = torch.randn(rows, model.V.shape[1])
    w = model.V[0].detach()
    return torch.equal(x @ w, x @ w.t().contiguous().t())


def test_weight_first_matmuls_run_as_the_originals_folded_mm():
    """matmul(W, x [B, d, 1]) folds into one mm in eager (W requires grad); the compiled graph
    spells that mm out instead of a batched matmul: the same products, summed alike up to the
    GEMM kernel's order, which may depend on the folded weight's layout (docs/contract.md)."""
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
    exact = {"rtol": 0, "atol": 0} if _blas_ignores_the_weight_layout(model, 7) else {}
    with torch.no_grad():
        want = model(u[index], c)
        torch.testing.assert_close(cm(u=u[index], c=c), want, **exact)
        torch.testing.assert_close(cm(u=u, c=c, candidate_to_request=index), want, **exact)


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


class Triangle(nn.Module):
    """DLRM's interaction: stacked request and candidate features, their pairwise dot products,
    the strict lower triangle read with constant index vectors (``Z[:, li, lj]``)."""

    def __init__(self, request_fields: int = 3, candidate_fields: int = 2, d: int = 8):
        super().__init__()
        fields = request_fields + candidate_fields
        li, lj = torch.tril_indices(fields, fields, offset=-1)
        self.register_buffer("li", li)
        self.register_buffer("lj", lj)
        self.register_buffer("pick", torch.tensor([2, 0, 1, 1]))
        self.user = nn.Linear(4, request_fields * d)
        self.item = nn.Linear(4, candidate_fields * d)
        self.d = d

    def forward(self, user, item):
        u = self.user(user).view(user.shape[0], -1, self.d)
        c = self.item(item).view(item.shape[0], -1, self.d)
        t = torch.cat([u, c], 1)
        z = torch.bmm(t, t.transpose(1, 2))
        return torch.cat([z[:, self.li, self.lj], t[:, self.pick].flatten(1)], 1)


TRIANGLE = Case("triangle", Triangle, ("user",), (("user", Spec((4,))), ("item", Spec((4,)))))


def _targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_constant_indexing_runs_as_index_select_and_stays_exact():
    aten = torch.ops.aten
    model = TRIANGLE.build()
    for options in ({}, {"defer": False, "ikbo": False}):
        cm = TRIANGLE.compile(model, options=options)
        for gm in (cm.graph_module, cm._plain.graph_module):
            assert aten.index.Tensor not in _targets(gm), options
        for counts in ([2, 3], [1], [4, 1, 2]):
            batch = TRIANGLE.batch(counts, seed=5, shuffle=True)
            check_both_conventions(cm, model, batch, str(counts))


def test_constant_indexing_follows_an_updated_index_buffer():
    model = TRIANGLE.build()
    cm = TRIANGLE.compile(model)
    batch = TRIANGLE.batch([2, 3], seed=2)
    with torch.no_grad():
        model.lj.copy_(torch.zeros_like(model.lj))  # every pair now reads column 0
        check_both_conventions(cm, model, batch, "after the buffer changed")


def test_negative_and_out_of_range_constant_indices_behave_as_indexing():
    """Negative entries wrap as in eager; an index buffer later changed out of range fails the
    call as eager does (``index_select``'s RuntimeError on the CPU where eager raises an
    IndexError), never reading a neighbouring element; a boolean mask keeps advanced indexing."""
    import pytest

    aten = torch.ops.aten

    class Picks(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("rows", torch.tensor([-1, 0, 2]))
            self.register_buffer("cols", torch.tensor([0, -3, 1]))
            self.register_buffer("mask", torch.tensor([True, False, True]))

        def forward(self, user, item):
            x = user.unsqueeze(2) * item.unsqueeze(1)  # [B, 3, 3]
            return torch.cat([x[:, self.rows, self.cols], x[:, self.mask, 0]], 1)

    case = Case("picks", Picks, ("user",), (("user", Spec((3,))), ("item", Spec((3,)))))
    model = case.build()
    cm = case.compile(model)
    assert _targets(cm.graph_module).count(aten.index.Tensor) == 1  # the mask's
    batch = case.batch([2, 1], seed=1)
    check_both_conventions(cm, model, batch, "picks")
    with torch.no_grad():
        model.cols.copy_(torch.tensor([0, 3, 1]))  # 3 is past the end of dim 2
        with pytest.raises(IndexError):
            model(**batch.replicated())
        with pytest.raises((IndexError, RuntimeError), match="out of"):
            cm(**batch.replicated())
        with pytest.raises((IndexError, RuntimeError), match="out of"):
            cm(**batch.kwargs, candidate_to_request=batch.candidate_to_request)


def test_a_transpose_of_a_transpose_is_its_source():
    from rocs_compiler.passes.cleanup import drop_double_transposes

    def f(x):
        a = x.transpose(1, 2).transpose(-1, -2)  # a pair (dims in either spelling): x itself
        b = x.transpose(0, 1).transpose(1, 2)  # not a pair
        return a * b.transpose(0, 2), x.transpose(0, 2).transpose(2, 0)  # an output: kept

    gm = torch.fx.experimental.proxy_tensor.make_fx(f)(torch.randn(3, 3, 3))
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            node.meta["val"] = torch.empty(3, 3, 3)
    x = torch.randn(3, 3, 3)
    want = f(x)
    assert drop_double_transposes(gm) == 1
    gm.recompile()
    got = gm(x)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


class SequenceFirstProjection(nn.Module):
    """A projection over a history laid out sequence-first (``[L, R, D]``, as
    ``nn.MultiheadAttention`` without ``batch_first`` takes it), a projection over a transpose
    whose leading dim is 1 (a view of the same rows), and a candidate tower."""

    def __init__(self):
        super().__init__()
        self.history_proj = nn.Linear(6, 12)
        self.item_proj = nn.Linear(6, 12)
        self.item = nn.Linear(5, 12)

    def forward(self, history, query, item):
        keys = self.history_proj(history.transpose(0, 1))  # [L, B, 12]
        queries = self.item_proj(query[:, None, :].transpose(0, 1))  # [1, B, 12]: a view
        scores = (keys * queries).sum(-1).transpose(0, 1)  # [B, L]
        return (scores.softmax(-1)[..., None] * keys.transpose(0, 1)).sum(1) * self.item(item)


def test_a_linear_over_a_sequence_first_transpose_reads_a_contiguous_copy():
    """The copy eager's linear makes inside is spelled out, so that a compiler runs one mm over
    the folded rows, never a bmm against the expanded weight; a transpose that is a view of the
    same rows (a leading dim of 1) is left as it is. Exact in both layouts."""
    torch.manual_seed(0)
    model = SequenceFirstProjection().eval()
    history, query, item = torch.randn(3, 9, 6), torch.randn(3, 6), torch.randn(8, 5)
    index = torch.tensor([0, 1, 1, 2, 2, 2, 0, 1])
    example = {"history": history[[0, 0, 1]], "query": query[[0, 0, 1]], "item": item[:3]}
    cm = rocs.compile(model, ["history", "query"], example_kwargs=example)
    linears = [
        n for n in cm.graph_module.graph.nodes if n.target == torch.ops.aten.linear.default
    ]
    inputs = {n.args[0].target for n in linears if n.args[0].meta["val"].dim() == 3}
    assert torch.ops.aten.clone.default in inputs, "the sequence-first projection reads a view"
    copies = [n for n in linears if n.args[0].target == torch.ops.aten.clone.default]
    assert len(copies) == 1, "a view of the same rows was copied"
    with torch.no_grad():
        want = model(history[index], query[index], item)
        assert want.std() > 1e-2
        torch.testing.assert_close(
            cm(history=history, query=query, item=item, candidate_to_request=index), want
        )
        torch.testing.assert_close(
            cm(history=history[index], query=query[index], item=item), want
        )
    program = rocs.export(cm, portable=True).run_decompositions()
    targets = {n.target for n in program.graph.nodes}
    assert torch.ops.aten.bmm.default not in targets
