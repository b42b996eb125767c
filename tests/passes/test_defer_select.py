"""``distribute_index``: constant advanced indexing over a concatenation along an indexed dim.

Alone on small captured graphs (index vectors held in buffers, as DLRM holds its triangle), the
oracle is the captured graph itself, bit for bit: the rule only regroups copies. On the DLRM zoo
model, with every pass, the oracle is the original model on ragged batches in both call layouts,
and the report shows the request-request dots and the top MLP's request columns per request.
"""

from __future__ import annotations

import pytest
import torch
from models_for_tests import assert_outputs_match, eager
from torch import nn
from torch.utils import _pytree as pytree

import rocs_compiler as rocs
from models_zoo import ZOO
from rocs_compiler.analysis.driver import analyze, infer_node
from rocs_compiler.capture.trace import capture
from rocs_compiler.ir.graph_meta import ROLE
from rocs_compiler.ir.roles import Role
from rocs_compiler.passes import defer as defer_module
from rocs_compiler.passes.defer_select import select_rewrites
from rocs_compiler.passes.engine import rewrite_to_fixpoint
from rocs_compiler.passes.verify import verify_roles

aten = torch.ops.aten


class Selection(nn.Module):
    """``select(cat([view(u), view(c)], dim))`` with the index tensors held in buffers; with
    ``sources="uu"`` the concatenation is ``cat([view(u), view(u) * 2], dim)``."""

    def __init__(self, u_shape, c_shape, dim, select, sources="uc", **buffers):
        super().__init__()
        self.u_shape, self.c_shape, self.dim, self.select = u_shape, c_shape, dim, select
        self.sources = sources
        for name, value in buffers.items():
            self.register_buffer(name, value)

    def forward(self, u, c):
        views = {"u": u.view(-1, *self.u_shape), "c": c.view(-1, *self.c_shape)}
        pieces = [views[s] * (k + 1) for k, s in enumerate(self.sources)]
        return self.select(self, torch.cat(pieces, self.dim)) * 2 + c.sum()


def _rows(shape) -> int:
    return int(torch.tensor(shape).prod())


def _apply(model: Selection, unbatched: dict | None = None):
    """Capture ``model``, run ``distribute_index`` alone to its fixpoint; return the count, the
    graph and whether it still computes what it computed (bit for bit) on two batch sizes."""
    g = torch.Generator().manual_seed(0)

    def inputs(batch):
        out = {
            "u": torch.randn(batch, _rows(model.u_shape), generator=g),
            "c": torch.randn(batch, _rows(model.c_shape), generator=g),
        }
        return {**out, **(unbatched or {})}

    captured = capture(model.eval(), (), inputs(3), ["u"], unbatched_inputs=list(unbatched or {}))
    gm, symbol = captured.graph_module, captured.batch_symbol
    request = {captured.placeholder_of[n] for n in captured.request_inputs}
    batches = [inputs(rows) for rows in (1, 5)]

    def run(batch):
        with torch.no_grad():
            return pytree.tree_leaves(gm(*[batch[n] for n in captured.input_names]))

    expected = [run(batch) for batch in batches]
    counts = rewrite_to_fixpoint(gm, select_rewrites(), lambda n: infer_node(n, request, symbol))
    kept = {n: n.meta[ROLE] for n in gm.graph.nodes}
    assert analyze(gm, request, symbol).roles == kept, "incremental roles != a fresh analysis"
    verify_roles(gm)
    for batch, want in zip(batches, expected):
        for got, w in zip(run(batch), want):
            torch.testing.assert_close(got, w, rtol=0, atol=0)
    return counts["distribute_index"], gm


def _selections(gm) -> dict[Role, list[tuple[int, ...]]]:
    """The shapes (without the batch) of the ``index`` nodes, by role."""
    out: dict[Role, list[tuple[int, ...]]] = {}
    for node in gm.graph.nodes:
        if node.target == aten.index.Tensor:
            shape = tuple(s for s in node.meta["val"].shape if isinstance(s, int))
            out.setdefault(node.meta[ROLE], []).append(shape)
    return out


def _columns(m, x):
    return x[:, m.cols]


def test_one_index_vector_splits_into_runs_of_the_pieces():
    # u = columns 0-2, c = 3-6: runs c[2, 0], u[0, 1], c[3], u[2], c[0]
    model = Selection((3,), (4,), 1, _columns, cols=torch.tensor([5, 3, 0, 1, 6, 2, 3]))
    fired, gm = _apply(model)
    assert fired == 1
    assert _selections(gm) == {Role.REQUEST: [(2,), (1,)], Role.CANDIDATE: [(2,), (1,), (1,)]}


def test_two_index_vectors_split_on_the_concatenated_dim_and_follow_the_other():
    # x [B, 5, 4]: rows 0-1 from u, 2-4 from c; pairs (I[t], J[t])
    model = Selection(
        (2, 4), (3, 4), 1, lambda m, x: x[:, m.i, m.j],
        i=torch.tensor([0, 3, 1, 1, 4, 2]), j=torch.tensor([2, 0, 3, 1, 1, 3]),
    )  # fmt: skip
    fired, gm = _apply(model)
    assert fired == 1
    assert _selections(gm) == {Role.REQUEST: [(1,), (2,)], Role.CANDIDATE: [(1,), (2,)]}


def test_the_index_along_a_kept_dim_broadcasts_and_blocks_split_in_two_steps():
    """A 2-D block layout (``cat`` along dim 1 of ``cat``s along dim 2, as the pairwise
    interaction's split leaves it): the outer cat mixes no roles, but its first row block holds
    a request block, which the second step reaches. ``j`` of length 1 broadcasts."""

    def blocks(m, x):
        right = torch.cat([x, x * 3], 2)  # [B, 5, 8]: request block at rows 0-1, columns 0-3
        return right[:, m.i, m.j]

    model = Selection((2, 4), (3, 4), 1, blocks, i=torch.tensor([1, 0, 2, 4]), j=torch.tensor([3]))
    fired, gm = _apply(model)
    assert fired >= 2
    assert _selections(gm)[Role.REQUEST] == [(2,)]


def test_indexed_dims_apart_put_the_selection_first():
    """``x[:, I, :, J]``: advanced indexing puts the selected dim first, ``[L, B, 3]``."""
    model = Selection(
        (2, 3, 4), (1, 3, 4), 1, lambda m, x: x[:, m.i, :, m.j],
        i=torch.tensor([0, 2, 1]), j=torch.tensor([3, 0, 1]),
    )  # fmt: skip
    fired, _ = _apply(model)
    assert fired == 1


REFUSED = {  # (index buffer, pieces of the concatenation)
    "negative entry": (torch.tensor([0, -1]), "uc"),
    "2-D index": (torch.tensor([[0, 1], [4, 5]]), "uc"),
    "mask": (torch.tensor([1, 0, 0, 1, 0, 1, 1]).bool(), "uc"),
    "candidate pieces only": (torch.tensor([4, 3, 6]), "uc"),
    "request-only source": (torch.tensor([2, 0, 4]), "uu"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused(case):
    cols, sources = REFUSED[case]
    shapes = ((3,), (3,) if sources == "uu" else (4,))
    fired, _ = _apply(Selection(*shapes, 1, _columns, sources, cols=cols))
    assert fired == 0, case


def test_an_index_that_is_an_input_is_refused():
    """A constant-role input (unbatched) varies between calls: its runs cannot be read."""
    model = Selection((3,), (4,), 1, lambda m, x: x)

    class Indexed(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, u, c, cols):
            return self.inner(u, c)[:, cols]

    wrapper = Indexed()
    wrapper.u_shape, wrapper.c_shape = model.u_shape, model.c_shape
    fired, _ = _apply(wrapper, unbatched={"cols": torch.tensor([0, 4])})
    assert fired == 0


# --------------------------------------------------------------------------------------------
# DLRM: Z[:, li, lj] over the pairwise interaction's blocks


def _dlrm():
    entry = ZOO["dlrm"]
    model = entry.build(seed=0).eval()
    example = entry.make_batch([2, 3], seed=100).replicated()
    return entry, model, rocs.compile(model, list(entry.request_inputs), example_kwargs=example)


def test_dlrm_request_dots_and_top_request_columns_run_per_request(monkeypatch):
    entry, model, cm = _dlrm()
    outputs = []
    for counts, seed in (([3, 1, 7, 2], 5), ([1], 6), ([4, 9], 7)):
        batch = entry.make_batch(counts, seed=seed, shuffle=True)
        want = eager(model, batch.replicated())
        outputs.append(want)
        got = cm(**batch.kwargs, candidate_to_request=batch.candidate_to_request)
        assert_outputs_match(got, want, f"dlrm {counts} shared layout")
        assert_outputs_match(cm(**batch.replicated()), want, f"dlrm {counts} drop-in")
    assert torch.cat(outputs).std() > 100 * 1e-5  # the scores spread far beyond the tolerance

    report = cm.report(candidates=64)
    assert report.pass_counts["distribute_index"] == 2, report.pass_counts
    by = {(n.role, n.op, n.shape): n for n in report.nodes}
    # the 10 request-request dots: computed and selected per request, read by no candidate node
    for op, shape in (("aten.bmm.default", "[B, 5, 5]"), ("aten.index.Tensor", "[B, 10]")):
        assert not by[("REQUEST", op, shape)].broadcast, (op, shape)
    # top[0]: the dense output and the 10 dots per request, the other 18 dots per candidate
    top0 = {n.role: n for n in report.nodes if n.module == "top.0" and "linear" in n.op}
    assert top0["REQUEST"].flops == 2 * 256 * (32 + 10)
    assert top0["CANDIDATE"].flops == 2 * 256 * 18

    # Without the rule the triangle reads the re-assembled matrix: per candidate, the top
    # linear reads 10 more columns and the request rows' dots with the items are computed twice.
    monkeypatch.setattr(defer_module, "select_rewrites", lambda: [])
    _, _, before = _dlrm()
    saved = before.report(candidates=64).candidate_flops - report.candidate_flops
    assert saved == 2 * 256 * 10 + 2 * 5 * 3 * 32, saved


def test_dlrm_follows_a_triangle_written_within_its_blocks_and_fails_across_them():
    """The runs are read at compile time; the index buffers stay read by the graph, so a write
    that keeps each pair in its block is followed, and one that moves a pair to another block
    makes the call fail rather than answer wrong (either program may run a call)."""
    entry, model, cm = _dlrm()
    batch = entry.make_batch([3, 5], seed=8, shuffle=True)
    with torch.no_grad():
        model.li[:10] = model.li[:10].flip(0).clone()  # the request-request pairs reordered
        model.lj[:10] = model.lj[:10].flip(0).clone()
    want = eager(model, batch.replicated())
    for _ in range(13):  # a program choice alternates two programs for the first ~12 calls
        got = cm(**batch.kwargs, candidate_to_request=batch.candidate_to_request)
        assert_outputs_match(got, want, "dlrm, triangle reordered")
    with torch.no_grad():
        model.li[0], model.lj[0] = 6, 5  # a request-request pair becomes an item-item pair
    want = eager(model, batch.replicated())
    failed = 0
    for _ in range(13):
        try:
            got = cm(**batch.kwargs, candidate_to_request=batch.candidate_to_request)
        except (RuntimeError, IndexError):
            failed += 1
            continue
        assert_outputs_match(got, want, "dlrm, a pair moved")
    assert failed
