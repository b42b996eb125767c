"""Every normalize, defer and ikbo rewrite, alone, on a tiny captured graph.

Each rewrite has a sample: a model of a few ops over a request input ``u`` and a candidate input
``c``. The sample is captured as real ATen (``rocs_compiler.capture``), the one rewrite is applied
to its fixpoint through the engine, and the oracle is the captured graph itself: on random inputs
the rewritten graph computes what it computed before (bit for bit where the identity only moves
computation, at float32 tolerance where it re-associates a sum or splits a matrix product). The
oracle knows nothing about the rewrite; the test also checks that the rewrite fired, that every
node has a role, and that the roles the engine kept current node by node are those a fresh
analysis gives. An ikbo rewrite runs on the sample's shared graph (after *share*, request inputs
at R rows, a ragged ``candidate_to_request``), which is then its oracle. A rewrite without a
sample fails ``test_every_rewrite_has_a_sample``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

import rocs_compiler as rocs
from rocs_compiler.analysis.driver import analyze, infer_node
from rocs_compiler.capture.trace import capture
from rocs_compiler.errors import CompileError
from rocs_compiler.ir.graph_meta import ROLE
from rocs_compiler.passes.defer import defer_rewrites
from rocs_compiler.passes.engine import Rewrite, rewrite_to_fixpoint
from rocs_compiler.passes.ikbo import ikbo, ikbo_rewrites
from rocs_compiler.passes.normalize import normalize_rewrites
from rocs_compiler.passes.share import share
from rocs_compiler.passes.verify import verify_roles, verify_shared

# The ikbo rewrites run on a shared graph; their names, with the generated pointwise kernels.
IKBO = {rw.name for rw in ikbo_rewrites(None, pointwise=True)}


def all_rewrites():
    return normalize_rewrites() + defer_rewrites()


class Net(nn.Module):
    """``forward(u, c) = body(self, u, c)``; ``parts`` are submodules or weights."""

    def __init__(self, body: Callable, **parts):
        super().__init__()
        self.body = body
        for name, part in parts.items():
            if isinstance(part, nn.Module):
                self.add_module(name, part)
            else:
                self.register_parameter(name, nn.Parameter(part, requires_grad=False))

    def forward(self, u, c):
        return self.body(self, u, c)


@dataclass(frozen=True)
class Sample:
    body: Callable  # body(model, u, c)
    shapes: tuple[tuple[int, ...], tuple[int, ...]]  # one row of u, one row of c
    parts: Callable[[], dict] = dict  # the model's submodules and weights, built fresh
    # False where the identity re-associates a sum or hands a matrix product operands of other
    # shapes (which BLAS may block differently): compared at float32 tolerance.
    exact: bool = True
    ids: str = ""  # the inputs ("u", "c") that are int64 ids below 10

    def build(self) -> nn.Module:
        return Net(self.body, **self.parts())


VEC = ((3,), (4,))  # u [B, 3], c [B, 4], concatenated along the last dim
SEQ = ((2, 4), (3, 4))  # u [B, 2, 4], c [B, 3, 4], concatenated along dim 1


def on_vec(f):
    return lambda m, u, c: f(m, torch.cat([u, c], -1))


def on_seq(f):
    return lambda m, u, c: f(m, torch.cat([u, c], 1))


def weight(*shape):
    """Parts: one weight ``w`` of ``shape``."""
    return lambda: {"w": torch.randn(*shape)}


def _unbind(m, u, c):
    first, second = u.unbind(1)
    return first - second * c


def _regroup(m, u, c):
    """TorchRec's ``KeyedTensor.regroup``: column blocks [u | c] of 3 and 4 reordered."""
    x = torch.cat([u, c], -1)
    return torch.ops.fbgemm.permute_pooled_embs(x, m.offsets, m.perm, m.inv_offsets, m.perm) * 2


def _regroup_parts():
    long = torch.long
    return {
        "offsets": torch.tensor([0, 3, 7], dtype=long),
        "inv_offsets": torch.tensor([0, 4, 7], dtype=long),
        "perm": torch.tensor([1, 0], dtype=long),
    }


def _einsum(m, x):
    return torch.einsum("bkd,mk->bmd", x, m.w)


def _merged_head_attention(m, u, c):
    """What ``nn.MultiheadAttention`` computes when it returns weights: heads merged into the
    batch (``[B*H, L, d]``, H=2, d=2), a candidate query over the request's 3 keys."""
    q = c.reshape(-1, 1, 2)  # [B*2, 1, 2]
    k = u.reshape(-1, 3, 2)  # [B*2, 3, 2]
    weights = torch.softmax(torch.bmm(q, k.transpose(1, 2)), -1)
    return torch.bmm(weights, (k * 2))


def _attention(m, u, c):
    q = c.view(-1, 1, 2, 2)
    k = u.view(-1, 1, 3, 2)
    return F.scaled_dot_product_attention(q, k, k + 1)


SAMPLES: dict[str, Sample] = {
    # normalize
    "stack_to_cat": Sample(lambda m, u, c: torch.stack([u, c], 1), ((4,), (4,))),
    "group_role_runs": Sample(lambda m, u, c: torch.cat([u, u * 2, c, c + 1], -1), VEC),
    "slice_of_cat": Sample(on_vec(lambda m, x: x[..., :3] * 2), VEC),
    "select_of_cat": Sample(on_vec(lambda m, x: x.select(1, 4) * 2), VEC),
    # u = columns 0-2, c = 3-6: runs c[1, 3] (selected), u whole, c[2, 0] (selected), c[1:3]
    "index_of_cat": Sample(on_vec(lambda m, x: x[:, [4, 6, 0, 1, 2, 5, 3, 4, 5]] * 2), VEC),
    "flatten_mixed_cat": Sample(lambda m, u, c: torch.cat([torch.cat([u, c], -1), c * 2], -1), VEC),
    "split_of_cat": Sample(on_vec(lambda m, x: x.split([2, 5], -1)[1] * 2), VEC),
    "narrow_of_cat": Sample(on_vec(lambda m, x: x.narrow(1, 3, 4) * 2), VEC),
    "cat_of_one": Sample(lambda m, u, c: torch.cat([u * 2], -1).sum(-1) + c[:, 0], VEC),
    "permute_pooled_embs_of_cat": Sample(_regroup, VEC, _regroup_parts),
    "unbind_to_select": Sample(_unbind, ((2, 4), (4,))),
    "select_of_permute": Sample(
        lambda m, u, c: u.permute(0, 2, 1).select(1, 1) + c, ((3, 4), (3,))
    ),
    "embedding_bag_rows": Sample(
        lambda m, u, c: m.bag(u) * c, ((3,), (4,)),
        lambda: {"bag": nn.EmbeddingBag(10, 4, mode="sum")}, ids="u",
    ),
    # defer: contractions over the concatenated axis
    "split_linear": Sample(
        on_vec(lambda m, x: m.lin(x)), VEC, lambda: {"lin": nn.Linear(7, 3)}, exact=False
    ),
    "split_matmul": Sample(on_seq(lambda m, x: m.w @ x), SEQ, weight(2, 5), exact=False),
    "split_einsum": Sample(on_seq(_einsum), SEQ, weight(2, 5), exact=False),
    "split_sum": Sample(on_vec(lambda m, x: x.sum(-1)), VEC, exact=False),
    # defer: distribution over the concatenated axis
    "distribute_pointwise": Sample(on_vec(lambda m, x: torch.tanh(x) * m.w), VEC, weight(7)),
    "distribute_prelu": Sample(on_seq(lambda m, x: m.act(x)), SEQ, lambda: {"act": nn.PReLU(5)}),
    "distribute_linear": Sample(
        on_seq(lambda m, x: m.lin(x)), SEQ, lambda: {"lin": nn.Linear(4, 3)}, exact=False
    ),
    "distribute_norm": Sample(on_seq(lambda m, x: m.ln(x)), SEQ, lambda: {"ln": nn.LayerNorm(4)}),
    "distribute_softmax": Sample(on_seq(lambda m, x: torch.softmax(x, -1)), SEQ),
    "distribute_reduction": Sample(on_seq(lambda m, x: x.mean(-1)), SEQ),
    "distribute_permute": Sample(on_seq(lambda m, x: x.permute(0, 2, 1)), SEQ),
    "distribute_transpose": Sample(on_seq(lambda m, x: x.transpose(1, 2)), SEQ),
    "distribute_unsqueeze": Sample(on_vec(lambda m, x: x.unsqueeze(1)), VEC),
    "distribute_select": Sample(on_seq(lambda m, x: x.select(2, 0)), SEQ),
    "distribute_slice": Sample(on_seq(lambda m, x: x[..., 1:3]), SEQ),
    "distribute_reshape": Sample(on_seq(lambda m, x: x.flatten(1)), SEQ),
    "distribute_matmul": Sample(on_seq(lambda m, x: x @ m.w), SEQ, weight(4, 3), exact=False),
    "distribute_embedding": Sample(
        on_seq(lambda m, x: F.embedding(x, m.w)), ((2,), (3,)), weight(10, 4), ids="uc"
    ),
    # rows 0-1 = u, 2-4 = c; pairs (3, 1), (0, 3), (1, 0), (4, 2): runs c, u (two), c
    "distribute_index": Sample(on_seq(lambda m, x: x[:, [3, 0, 1, 4], [1, 3, 0, 2]] * 2), SEQ),
    # ikbo: broadcasts of request values fused into their candidate consumers
    "ikbo_linear": Sample(
        lambda m, u, c: m.lin(c) + m.user(u), VEC,
        lambda: {"lin": nn.Linear(4, 5), "user": nn.Linear(3, 5)}, exact=False,
    ),
    "ikbo_linear_compression": Sample(
        lambda m, u, c: torch.matmul(m.w, c.view(-1, 2, 2)) + u.view(-1, 3, 2), ((6,), (4,)),
        weight(3, 2), exact=False,
    ),
    "ikbo_attention": Sample(_attention, ((6,), (4,)), exact=False),
    "ikbo_merged_head_attention": Sample(_merged_head_attention, ((12,), (4,)), exact=False),
    "ikbo_interaction": Sample(
        lambda m, u, c: torch.bmm(c.view(-1, 2, 2), u.view(-1, 2, 3)), ((6,), (4,)), exact=False
    ),
    "ikbo_weight_matmul": Sample(
        lambda m, u, c: torch.matmul(c.view(-1, 2, 1, 2), m.w).flatten(1) * u, ((6,), (4,)),
        weight(2, 2, 3), exact=False,
    ),
    "ikbo_pointwise": Sample(lambda m, u, c: torch.tanh(c) * u + c, ((4,), (4,))),
}


def _inputs(sample: Sample, batch: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in zip("uc", sample.shapes):
        if name in sample.ids:
            out[name] = torch.randint(0, 10, (batch, *shape), generator=g)
        else:
            out[name] = torch.randn(batch, *shape, generator=g)
    return out


def _run(gm, captured, inputs):
    with torch.no_grad():
        return pytree.tree_leaves(gm(*[inputs[n] for n in captured.input_names]))


def test_every_rewrite_has_a_sample():
    assert {rw.name for rw in all_rewrites()} | IKBO == set(SAMPLES)


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_rewrite_identity(name):
    if name == "permute_pooled_embs_of_cat":
        pytest.importorskip("fbgemm_gpu", reason="TorchRec's regroup op comes with fbgemm")
    if name in IKBO:
        check_shared_identity(name, SAMPLES[name])
    else:
        check_identity(name, SAMPLES[name])


def test_a_reshape_dropping_size_one_dims_before_the_axis_distributes():
    """``[B, 1, 7] -> [B, 7]`` over a concatenation along the last dim (features pooled to one
    row each, then flattened)."""
    sample = Sample(
        lambda m, u, c: torch.cat([u.unsqueeze(1), c.unsqueeze(1)], -1).reshape(u.shape[0], 7),
        VEC,
    )
    check_identity("distribute_reshape", sample)


def test_a_reshape_splitting_the_axis_distributes():
    """``[B, F*D] -> [B, F, D]`` over a concatenation of whole features along the last dim
    (TorchRec's pooled embeddings, one ``KeyedTensor``, viewed as a feature sequence)."""
    sample = Sample(
        lambda m, u, c: torch.cat([u, c], -1).reshape(-1, 3, 2) * 2, ((2,), (4,))
    )
    check_identity("distribute_reshape", sample)


def check_identity(name: str, sample: Sample) -> None:
    """The rewrite fires on the sample, keeps roles as a fresh analysis finds them, and
    computes what the sample computed."""
    (rewrite,) = [rw for rw in all_rewrites() if rw.name == name]
    torch.manual_seed(0)
    model = sample.build().eval()
    captured = capture(model, (), _inputs(sample, 3, seed=1), ["u"])
    gm, symbol = captured.graph_module, captured.batch_symbol
    request = {captured.placeholder_of[n] for n in captured.request_inputs}
    batches = [_inputs(sample, rows, seed=rows) for rows in (1, 5)]
    expected = [_run(gm, captured, inputs) for inputs in batches]

    counts = rewrite_to_fixpoint(gm, [rewrite], lambda n: infer_node(n, request, symbol))

    assert counts[name] >= 1, f"{name} did not fire on its sample"
    assert all(ROLE in n.meta for n in gm.graph.nodes)
    kept = {n: n.meta[ROLE] for n in gm.graph.nodes}
    assert analyze(gm, request, symbol).roles == kept, "incremental roles != a fresh analysis"
    verify_roles(gm)
    for inputs, want in zip(batches, expected):
        got = _run(gm, captured, inputs)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            if sample.exact:
                torch.testing.assert_close(g, w, rtol=0, atol=0)
            else:
                torch.testing.assert_close(g, w)  # float32 defaults: rtol 1.3e-6, atol 1e-5


def check_shared_identity(name: str, sample: Sample) -> None:
    """The ikbo rewrite fires on the sample's shared graph, which stays a valid shared graph
    and computes what it computed before, on ragged batches in any order."""
    torch.manual_seed(0)
    model = sample.build().eval()
    captured = capture(model, (), _inputs(sample, 3, seed=1), ["u"])
    gm, symbol = captured.graph_module, captured.batch_symbol
    analyze(gm, {captured.placeholder_of[n] for n in captured.request_inputs}, symbol)
    shared = share(gm, symbol)
    batches = []
    for requests, index in ((1, [0, 0]), (3, [2, 0, 0, 1, 2]), (2, [1])):
        u = _inputs(sample, requests, seed=requests)["u"]
        c = _inputs(sample, len(index), seed=len(index) + 10)["c"]
        batches.append({"u": u, "c": c, "index": torch.tensor(index)})

    def run(inputs):
        args = [inputs[n] for n in captured.input_names] + [inputs["index"]]
        with torch.no_grad():
            return pytree.tree_leaves(shared(*args))

    expected = [run(inputs) for inputs in batches]
    _, counts = ikbo(shared, pointwise=True, only=frozenset({name}))

    assert counts[name] >= 1, f"{name} did not fire on its sample"
    verify_shared(shared)
    for inputs, want in zip(batches, expected):
        got = run(inputs)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            if sample.exact:
                torch.testing.assert_close(g, w, rtol=0, atol=0)
            else:
                torch.testing.assert_close(g, w)


def test_rewrites_that_never_settle_are_an_error():
    sample = SAMPLES["distribute_pointwise"]
    captured = capture(sample.build().eval(), (), _inputs(sample, 3, seed=1), ["u"])
    request = {captured.placeholder_of[n] for n in captured.request_inputs}
    tanh = torch.ops.aten.tanh
    again = Rewrite("again", frozenset({tanh}), lambda b, n: b.call(tanh.default, n.args[0]))
    with pytest.raises(CompileError, match="did not reach a fixpoint after 50 rewrites.*again 51x"):
        rewrite_to_fixpoint(
            captured.graph_module,
            [again],
            lambda n: infer_node(n, request, captured.batch_symbol),
            max_rewrites=50,
        )


def test_no_distribution_when_every_piece_would_read_a_candidate_operand():
    """``cat([u, c]) * s`` with ``s`` per candidate, and ``cat([u, c]) @ w`` with ``w`` per
    candidate (a cross layer, ``x0 * (x . w)``): every piece would be candidate-side, so the op
    stays whole (distributing would only add an op per piece and a concatenation)."""

    def body(m, u, c):
        x0 = torch.cat([u, c], -1).unsqueeze(-1)  # [B, 7, 1]
        s = (c.sum(-1, keepdim=True) * m.w).unsqueeze(-1)  # [B, 1, 1], per candidate
        return (torch.matmul(x0, s) + x0 * s).squeeze(-1)

    model = Net(body, w=torch.randn(1))
    u, c = torch.randn(3, 3), torch.randn(7, 4)
    index = torch.tensor([0, 0, 1, 2, 2, 2, 1])
    compiled = rocs.compile(model.eval(), ["u"], example_kwargs={"u": u[[0, 0, 1]], "c": c[:3]})
    counts = compiled.report().pass_counts
    assert counts["distribute_pointwise"] == counts["distribute_matmul"] == 0, counts
    with torch.no_grad():
        want = model(u[index], c)
        torch.testing.assert_close(compiled(u=u, c=c, candidate_to_request=index), want)


def test_the_candidate_rows_of_a_pairwise_interaction_read_the_request_stack_in_kernel():
    """``bmm(T, T^T)`` with ``T = cat([U, C], 1)``: the candidate rows ``C @ [U^T | C^T]`` split
    into ``C @ U^T`` (the in-kernel broadcast the request rows' ``U @ C^T`` already computes,
    transposed: one op for both) and ``C @ C^T``, so the request stack is never gathered to
    the candidates; a candidate operand with as many rows as the contracted dim stays whole."""

    def body(m, u, c):
        t = torch.cat([u.view(-1, 3, 8), c.view(-1, 2, 8)], 1)
        return torch.bmm(t, t.transpose(1, 2)).flatten(1)

    model = Net(body)
    u, c = torch.randn(3, 24), torch.randn(7, 16)
    index = torch.tensor([0, 0, 1, 2, 2, 2, 1])
    compiled = rocs.compile(model.eval(), ["u"], example_kwargs={"u": u[[0, 0, 1]], "c": c[:3]})
    targets = [n.target for n in compiled.graph_module.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.rocs.broadcast_interaction.default) == 1
    gathered = [
        n.args[0].meta["val"].shape[1:]
        for n in compiled.graph_module.graph.nodes
        if n.target == torch.ops.aten.index_select.default
    ]
    assert gathered == [(3, 3)], gathered  # only the request-request block U @ U^T
    with torch.no_grad():
        want = model(u[index], c)
        torch.testing.assert_close(compiled(u=u, c=c, candidate_to_request=index), want)
        torch.testing.assert_close(compiled(u=u[index], c=c), want)


def test_a_linear_over_history_positions_adds_the_request_half_in_the_gemm():
    """``linear(cat([h, c expanded], 2))`` over a history ``h [B, L, D]`` (DIN's activation
    unit): the request half ``h @ W_h^T`` runs once per request and ``broadcast_linear`` adds it
    to each candidate's rows, row ``n L + l`` reading request row ``idx[n] L + l``."""

    def body(m, u, c):
        h = u.view(-1, 5, 4)
        t = c.unsqueeze(1).expand(-1, 5, -1)
        return m.lin(torch.cat([h, t, h * t], 2)).sum((1, 2))

    model = Net(body, lin=nn.Linear(12, 6))
    u, c = torch.randn(4, 20), torch.randn(9, 4)
    index = torch.tensor([3, 0, 0, 1, 2, 2, 1, 3, 0])  # ragged, not grouped
    compiled = rocs.compile(model.eval(), ["u"], example_kwargs={"u": u[[0, 0, 1]], "c": c[:3]})
    linears = [
        n for n in compiled.graph_module.graph.nodes
        if n.target == torch.ops.rocs.broadcast_linear.default
    ]
    assert len(linears) == 1 and linears[0].args[3].meta["val"].shape[1:] == (6,)
    with torch.no_grad():
        want = model(u[index], c)
        torch.testing.assert_close(compiled(u=u, c=c, candidate_to_request=index), want)
        torch.testing.assert_close(compiled(u=u[index], c=c), want)
        one = torch.zeros(9, dtype=torch.long)  # one request: every row reads request rows 0..L-1
        torch.testing.assert_close(compiled(u=u[:1], c=c, candidate_to_request=one), model(u[one], c))
