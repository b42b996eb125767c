"""IKBO ops on their CPU (torch) path against the materialized-broadcast references.

The oracle is ``rocs_compiler.kernels.ROCS_OPS[name].reference``: gather the request tensors with
``index_select``, then run the plain op. Shapes are drawn by hypothesis (non-divisible
sizes, R = 1, single-candidate and empty requests, equal counts, shuffled order).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from ikbo_testing import candidate_index, make_index, randn, random_mask

import rocs_compiler.kernels as cg
from rocs_compiler.kernels.request_groups import group_by_request

SETTINGS = settings(max_examples=25, deadline=None)
MATMUL_TOL = dict(rtol=1e-4, atol=1e-5)


@pytest.fixture(autouse=True)
def _torch_path(monkeypatch):
    monkeypatch.delenv("ROCS_TRITON_ON_CPU", raising=False)


@SETTINGS
@given(
    index=candidate_index(),
    k=st.integers(1, 40),
    m=st.integers(1, 24),
    has_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_broadcast_linear(index, k, m, has_bias, seed):
    num_requests, idx = index
    n = idx.shape[0]
    c, weight = randn(n, k, seed=seed), randn(m, k, seed=seed + 1)
    bias = randn(m, seed=seed + 2) if has_bias else None
    request_term = randn(num_requests, m, seed=seed + 3)
    out = torch.ops.rocs.broadcast_linear(c, weight, bias, request_term, idx)
    ref = cg.ROCS_OPS["broadcast_linear"].reference(c, weight, bias, request_term, idx)
    torch.testing.assert_close(out, ref, **MATMUL_TOL)


@SETTINGS
@given(
    index=candidate_index(),
    kc=st.integers(1, 12),
    m=st.integers(1, 10),
    d=st.integers(1, 9),
    seed=st.integers(0, 2**16),
)
def test_broadcast_linear_compression(index, kc, m, d, seed):
    num_requests, idx = index
    n = idx.shape[0]
    ec, weight = randn(n, kc, d, seed=seed), randn(m, kc, seed=seed + 1)
    request_term = randn(num_requests, m, d, seed=seed + 2)
    out = torch.ops.rocs.broadcast_linear_compression(ec, weight, request_term, idx)
    ref = cg.ROCS_OPS["broadcast_linear_compression"].reference(ec, weight, request_term, idx)
    torch.testing.assert_close(out, ref, **MATMUL_TOL)


@SETTINGS
@given(
    index=candidate_index(),
    h=st.integers(1, 3),
    lq=st.integers(1, 5),
    key_len=st.integers(1, 13),
    d=st.integers(1, 9),
    mask_kind=st.sampled_from(["none", "random", "one_request_fully_masked", "bias"]),
    scale=st.sampled_from([None, 0.37]),
    seed=st.integers(0, 2**16),
)
def test_broadcast_attention(index, h, lq, key_len, d, mask_kind, scale, seed):
    num_requests, idx = index
    n = idx.shape[0]
    q = randn(n, h, lq, d, seed=seed)
    k, v = (
        randn(num_requests, h, key_len, d, seed=seed + 1),
        randn(num_requests, h, key_len, d, seed=seed + 2),
    )
    mask = bias = None
    if mask_kind == "bias":  # a float mask per request and head: -inf on padded keys, else a bias
        keep = random_mask(num_requests, key_len, seed)[:, None, None, :]
        bias = randn(num_requests, h, 1, key_len, seed=seed + 3).masked_fill(~keep, float("-inf"))
    elif mask_kind != "none":
        fully = 0 if mask_kind == "one_request_fully_masked" else None
        mask = random_mask(num_requests, key_len, seed, fully_masked=fully)
    out = torch.ops.rocs.broadcast_attention(q, k, v, idx, mask, scale, bias)
    ref = cg.ROCS_OPS["broadcast_attention"].reference(q, k, v, idx, mask, scale, bias)
    torch.testing.assert_close(out, ref, **MATMUL_TOL)


@SETTINGS
@given(
    index=candidate_index(),
    fu=st.integers(1, 7),
    fc=st.integers(1, 7),
    d=st.integers(1, 20),
    seed=st.integers(0, 2**16),
)
def test_broadcast_interaction(index, fu, fc, d, seed):
    num_requests, idx = index
    n = idx.shape[0]
    request_stack, candidate_stack = (
        randn(num_requests, fu, d, seed=seed),
        randn(n, fc, d, seed=seed + 1),
    )
    out = torch.ops.rocs.broadcast_interaction(request_stack, candidate_stack, idx)
    ref = cg.ROCS_OPS["broadcast_interaction"].reference(request_stack, candidate_stack, idx)
    torch.testing.assert_close(out, ref, **MATMUL_TOL)


POINTWISE_PROGRAMS = [
    "mul(sigmoid(add(c0, r0)), r1)",
    "add(tanh(c0), gelu(silu(r0)))",
    "where(relu(sub(c0, 0.25)), maximum(r0, c1), minimum(neg(r1), -0.5))",
    "div(exp(neg(abs(c0))), sqrt(add(abs(r0), 1.5)))",
    "mul(rsqrt(add(mul(r0, r0), 1e-05)), log(add(abs(c1), 2.0)))",
    "sub(1.0, r0)",
]


@SETTINGS
@given(
    index=candidate_index(),
    program=st.sampled_from(POINTWISE_PROGRAMS),
    trailing=st.lists(st.integers(1, 5), min_size=0, max_size=2),
    seed=st.integers(0, 2**16),
)
def test_broadcast_pointwise(index, program, trailing, seed):
    num_requests, idx = index
    n = idx.shape[0]
    cands = [randn(n, *trailing, seed=seed + i) for i in range(2)]
    reqs = [randn(num_requests, *trailing, seed=seed + 10 + i) for i in range(2)]
    out = torch.ops.rocs.broadcast_pointwise(program, cands, reqs, idx)
    ref = cg.ROCS_OPS["broadcast_pointwise"].reference(program, cands, reqs, idx)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6, equal_nan=True)


def test_pointwise_chunks_match_single_pass(monkeypatch):
    from rocs_compiler.kernels import pointwise

    idx = make_index([3, 1, 5, 2], perm_seed=0)
    c0, r0 = randn(11, 4, 3, seed=0), randn(4, 4, 3, seed=1)
    program = "mul(sigmoid(add(c0, r0)), r0)"
    whole = torch.ops.rocs.broadcast_pointwise(program, [c0], [r0], idx)
    monkeypatch.setattr(pointwise, "CHUNK_BYTES", 4 * 4 * 3 * 2)  # two rows per chunk
    # Vectorized and scalar tails of torch kernels may differ by an ulp.
    torch.testing.assert_close(torch.ops.rocs.broadcast_pointwise(program, [c0], [r0], idx), whole)


def test_pointwise_independent_oracle():
    """Against hand-written eager code (not the program evaluator)."""
    idx = make_index([2, 1, 4], perm_seed=3)
    c0, c1 = randn(7, 5, seed=0), randn(7, 5, seed=1)
    r0, r1 = randn(3, 5, seed=2), randn(3, 5, seed=3)
    cases = {
        "mul(sigmoid(add(c0, r0)), r1)": torch.sigmoid(c0 + r0[idx]) * r1[idx],
        "add(tanh(c0), gelu(silu(r0)))": torch.tanh(c0) + F.gelu(F.silu(r0[idx])),
        "maximum(sub(c1, r1), 0.5)": torch.clamp_min(c1 - r1[idx], 0.5),
        "where(c0, r0, c1)": torch.where(c0 != 0, r0[idx], c1),
        "sigmoid(2.0)": torch.full((7, 5), torch.sigmoid(torch.tensor(2.0)).item()),
    }
    for program, expected in cases.items():
        out = torch.ops.rocs.broadcast_pointwise(program, [c0, c1], [r0, r1], idx)
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6, msg=program)


def test_r_equals_one_and_single_candidate():
    idx = torch.zeros(1, dtype=torch.int64)
    c, w, b, rt = randn(1, 3, seed=0), randn(2, 3, seed=1), randn(2, seed=2), randn(1, 2, seed=3)
    torch.testing.assert_close(
        torch.ops.rocs.broadcast_linear(c, w, b, rt, idx), F.linear(c, w, b) + rt, **MATMUL_TOL
    )
    q, k, v = randn(1, 1, 2, 4, seed=4), randn(1, 1, 3, 4, seed=5), randn(1, 1, 3, 4, seed=6)
    torch.testing.assert_close(
        torch.ops.rocs.broadcast_attention(q, k, v, idx), F.scaled_dot_product_attention(q, k, v), **MATMUL_TOL
    )


def test_fully_masked_request_gives_zeros():
    idx = make_index([2, 3], perm_seed=1)
    q = randn(5, 2, 3, 4, seed=0)
    k, v = randn(2, 2, 6, 4, seed=1), randn(2, 2, 6, 4, seed=2)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1] = False
    out = torch.ops.rocs.broadcast_attention(q, k, v, idx, mask)
    assert torch.equal(out[idx == 1], torch.zeros_like(out[idx == 1]))
    assert torch.isfinite(out).all()


def test_empty_batch():
    idx = torch.zeros(0, dtype=torch.int64)
    assert torch.ops.rocs.broadcast_linear(
        randn(0, 3, seed=0), randn(2, 3, seed=1), None, randn(2, 2, seed=2), idx
    ).shape == (0, 2)
    assert torch.ops.rocs.broadcast_interaction(randn(2, 3, 4, seed=0), randn(0, 5, 4, seed=1), idx).shape == (
        0,
        5,
        3,
    )
    assert torch.ops.rocs.broadcast_attention(
        randn(0, 1, 2, 4, seed=0), randn(2, 1, 3, 4, seed=1), randn(2, 1, 3, 4, seed=2), idx
    ).shape == (0, 1, 2, 4)
    assert torch.ops.rocs.broadcast_pointwise(
        "add(c0, r0)", [randn(0, 3, seed=0)], [randn(2, 3, seed=1)], idx
    ).shape == (0, 3)


def test_non_contiguous_and_float64_inputs():
    idx = make_index([2, 3, 1], perm_seed=2)
    c = randn(3, 6, seed=0).t()  # [6, 3], non-contiguous
    w, rt = randn(4, 3, seed=1).double(), randn(3, 4, seed=2).double()
    out = torch.ops.rocs.broadcast_linear(c.double(), w, None, rt, idx)
    torch.testing.assert_close(out, F.linear(c.double(), w) + rt[idx])
    cs = randn(6, 5, 4, seed=3).transpose(1, 2)  # [6, 4, 5]
    rs = randn(3, 2, 5, seed=4)
    torch.testing.assert_close(
        torch.ops.rocs.broadcast_interaction(rs, cs, idx), cs @ rs[idx].transpose(1, 2), **MATMUL_TOL
    )


def test_float16_cpu_path():
    idx = make_index([2, 3, 1], perm_seed=2)
    c, w, rt = (randn(6, 8, seed=0), randn(5, 8, seed=1), randn(3, 5, seed=2))
    out = torch.ops.rocs.broadcast_linear(c.half(), w.half(), None, rt.half(), idx)
    torch.testing.assert_close(out.float(), F.linear(c, w) + rt[idx], rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(
    "bad_idx, error",
    [
        (torch.tensor([0, 1, 3]), IndexError),
        (torch.tensor([0, -1, 1]), IndexError),
        (torch.tensor([0, 1, 1], dtype=torch.int32), TypeError),
        (torch.tensor([0, 1]), ValueError),
    ],
)
def test_bad_index_is_rejected(bad_idx, error):
    c, w, rt = randn(3, 4, seed=0), randn(2, 4, seed=1), randn(3, 2, seed=2)
    with pytest.raises(error):
        torch.ops.rocs.broadcast_linear(c, w, None, rt, bad_idx)
    with pytest.raises(error):
        torch.ops.rocs.broadcast_pointwise("add(c0, r0)", [randn(3, 2, seed=3)], [rt], bad_idx)


def test_bad_shapes_and_dtypes_are_rejected():
    idx = make_index([1, 2])
    with pytest.raises(ValueError, match="weight"):
        torch.ops.rocs.broadcast_linear(
            randn(3, 4, seed=0), randn(2, 5, seed=1), None, randn(2, 2, seed=2), idx
        )
    with pytest.raises(TypeError, match="dtype"):
        torch.ops.rocs.broadcast_linear(
            randn(3, 4, seed=0), randn(2, 4, seed=1).double(), None, randn(2, 2, seed=2), idx
        )
    with pytest.raises(TypeError, match="bool"):
        q, k = randn(3, 1, 2, 4, seed=0), randn(2, 1, 3, 4, seed=1)
        torch.ops.rocs.broadcast_attention(q, k, k, idx, torch.ones(2, 3))
    with pytest.raises(ValueError, match="r1"):
        torch.ops.rocs.broadcast_pointwise(
            "add(c0, r1)", [randn(3, 2, seed=0)], [randn(2, 2, seed=1), randn(2, 3, seed=2)], idx
        )


@given(index=candidate_index(max_requests=6, max_per_request=5))
@settings(max_examples=25, deadline=None)
def test_grouping_partitions_candidates(index):
    num_requests, idx = index
    groups = group_by_request(idx, num_requests)
    seen = torch.cat([g.candidates.reshape(-1) for g in groups])
    assert sorted(seen.tolist()) == list(range(idx.shape[0]))
    for g in groups:
        assert g.candidates.shape == (g.requests.shape[0], g.count)
        assert torch.equal(idx[g.candidates], g.requests[:, None].expand_as(g.candidates))
        # Within a request, candidates keep their original order.
        assert bool((g.candidates[:, 1:] > g.candidates[:, :-1]).all())
    assert len(groups) == len(set(torch.bincount(idx).tolist()) - {0})


def test_grouping_fast_path_is_one_view():
    idx = make_index([3, 3, 3])
    (group,) = group_by_request(idx, 3)
    assert group.contiguous and group.all_requests
    x = randn(9, 2, seed=0)
    assert group.gather_candidates(x).data_ptr() == x.data_ptr()


_NO_TRITON_SCRIPT = """
import sys

class BlockTriton:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("triton blocked for this test")

sys.meta_path.insert(0, BlockTriton())
import torch
import rocs_compiler.kernels as cg

idx = torch.tensor([1, 0, 1])
out = torch.ops.rocs.broadcast_pointwise("add(c0, r0)", [torch.ones(3, 2)], [torch.ones(2, 2)], idx)
assert out.eq(2).all()
torch.ops.rocs.broadcast_linear(torch.ones(3, 4), torch.ones(2, 4), None, torch.ones(2, 2), idx)
print(cg.kernel_source("neg(c0)", 1, 0).count("@triton.jit"))
assert "triton" not in sys.modules
"""


def test_package_works_without_triton():
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _NO_TRITON_SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "1"
