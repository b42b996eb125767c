"""Fake kernels, FLOP formulas and the reference registry of the IKBO ops.

- ``torch.export`` traces every op with symbolic N and R, and the exported program runs
  at batch sizes other than the example's;
- ``torch.compile`` (CPU) keeps the ops opaque and matches eager;
- ``FlopCounterMode`` counts the useful work of every op;
- every op registered by ``rocs_compiler.kernels`` has its record in ``ROCS_OPS``.
"""

from __future__ import annotations

import torch
from ikbo_testing import make_index, randn
from torch.export import Dim
from torch.utils.flop_counter import FlopCounterMode

import rocs_compiler.kernels as cg
from rocs_compiler.kernels import reference_for


class AllOps(torch.nn.Module):
    """One module that calls each op, so one export covers all fake kernels."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(randn(6, 5, seed=0))
        self.b = torch.nn.Parameter(randn(6, seed=1))
        self.wc = torch.nn.Parameter(randn(4, 3, seed=2))

    def forward(self, c, u_term, ec, u_comp, q, k, v, mask, rs, cs, idx):
        lin = torch.ops.rocs.broadcast_linear(c, self.w, self.b, u_term, idx)
        comp = torch.ops.rocs.broadcast_linear_compression(ec, self.wc, u_comp, idx)
        att = torch.ops.rocs.broadcast_attention(q, k, v, idx, mask, None)
        inter = torch.ops.rocs.broadcast_interaction(rs, cs, idx)
        pw = torch.ops.rocs.broadcast_pointwise("mul(sigmoid(add(c0, r0)), c0)", [lin], [u_term], idx)
        return lin, comp, att, inter, pw


def _inputs(counts, seed=0):
    idx = make_index(counts, perm_seed=seed)
    n, r = idx.shape[0], len(counts)
    return (
        randn(n, 5, seed=seed), randn(r, 6, seed=seed + 1),
        randn(n, 3, 7, seed=seed + 2), randn(r, 4, 7, seed=seed + 3),
        randn(n, 2, 3, 8, seed=seed + 4), randn(r, 2, 9, 8, seed=seed + 5),
        randn(r, 2, 9, 8, seed=seed + 6), torch.rand(r, 9) > 0.2,
        randn(r, 4, 8, seed=seed + 7), randn(n, 3, 8, seed=seed + 8),
        idx,
    )  # fmt: skip


def _reference(model, args):
    c, u_term, ec, u_comp, q, k, v, mask, rs, cs, idx = args
    ops = {name: op.reference for name, op in cg.ROCS_OPS.items()}
    lin = ops["broadcast_linear"](c, model.w, model.b, u_term, idx)
    return (
        lin,
        ops["broadcast_linear_compression"](ec, model.wc, u_comp, idx),
        ops["broadcast_attention"](q, k, v, idx, mask, None),
        ops["broadcast_interaction"](rs, cs, idx),
        ops["broadcast_pointwise"]("mul(sigmoid(add(c0, r0)), c0)", [lin], [u_term], idx),
    )


def test_export_with_dynamic_candidates_and_requests():
    model = AllOps().eval()
    n_dim, r_dim = Dim("N", min=2), Dim("R", min=2)
    cand, req = {0: n_dim}, {0: r_dim}
    shapes = (cand, req, cand, req, cand, req, req, req, req, cand, cand)
    with torch.no_grad():
        ep = torch.export.export(model, _inputs([2, 3, 1]), dynamic_shapes=shapes)
    targets = {n.target for n in ep.graph.nodes if n.op == "call_function"}
    for name in cg.ROCS_OPS:
        if name not in ("embedding_bag_rows", "nested_padding"):  # no broadcast to fuse
            assert getattr(torch.ops.rocs, name).default in targets
    # Output sizes are symbolic in N, not the example's 6.
    out_sizes = [
        n.meta["val"].shape[0] for n in ep.graph.nodes if n.op == "output" for n in n.args[0]
    ]
    assert all(isinstance(s, torch.SymInt) for s in out_sizes)

    args = _inputs([4, 1, 2, 5, 1], seed=3)  # N = 13, R = 5
    with torch.no_grad():
        for out, ref in zip(ep.module()(*args), _reference(model, args), strict=True):
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_torch_compile_cpu():
    model = AllOps().eval()
    compiled = torch.compile(model, backend="inductor", dynamic=True, fullgraph=True)
    for counts in ([2, 3, 1], [1, 4, 2, 2]):
        args = _inputs(counts)
        with torch.no_grad():
            for out, ref in zip(compiled(*args), _reference(model, args), strict=True):
                torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_flop_formulas_count_useful_work():
    model = AllOps().eval()
    args = _inputs([2, 3, 1])
    n = args[-1].shape[0]
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(*args)
    flops = {str(op): count for op, count in counter.get_flop_counts()["Global"].items()}
    assert flops["rocs.broadcast_linear"] == 2 * n * 6 * 5
    assert flops["rocs.broadcast_linear_compression"] == 2 * n * 4 * 3 * 7
    assert flops["rocs.broadcast_attention"] == 4 * n * 2 * 3 * 9 * 8
    assert flops["rocs.broadcast_interaction"] == 2 * n * 3 * 4 * 8
    assert flops["rocs.broadcast_pointwise"] == 3 * n * 6
    # The fused ops count the same GEMM work as their references' matmuls.
    c, u_term, *_ = args
    with FlopCounterMode(display=False) as ref_counter, torch.no_grad():
        cg.ROCS_OPS["broadcast_linear"].reference(c, model.w, model.b, u_term, args[-1])
    assert ref_counter.get_total_flops() == flops["rocs.broadcast_linear"]


def test_every_rocs_op_is_registered_with_its_record():
    """One record per op: the registered custom op, its reference and its runner all come
    from ``ROCS_OPS``, and every op in the ``rocs`` namespace has a record."""
    registered = {
        name
        for name in dir(torch.ops.rocs)
        if isinstance(getattr(torch.ops.rocs, name, None), torch._ops.OpOverloadPacket)
    }
    assert registered == set(cg.ROCS_OPS)
    for name, op in cg.ROCS_OPS.items():
        assert op.overload is getattr(torch.ops.rocs, name).default
        assert reference_for(getattr(torch.ops.rocs, name).default) is op.reference
        assert reference_for(getattr(torch.ops.rocs, name)) is op.reference
        assert reference_for(f"rocs::{name}") is op.reference
    assert reference_for(torch.ops.aten.mm.default) is None
