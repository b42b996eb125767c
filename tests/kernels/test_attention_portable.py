"""The portable form of ``rocs::broadcast_attention`` (``kernels/attention_portable.py``) against
the op's reference (gather the keys and values per candidate, then SDPA), eager and exported.

Batches cover both layouts of the tiles: every request within ``T = ceil(N / R)`` candidates
(R = 1, equal counts, one candidate each) and a request that spills beyond T (ragged counts),
with requests that have no candidate, a request whose keys are all masked, shuffled order,
Lq > 1.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ikbo_testing import candidate_index, make_index, randn, random_mask
from torch.export import Dim

import rocs_compiler.kernels as cg
from rocs_compiler.kernels.attention_portable import candidate_ranks, per_request_attention

TOL = dict(rtol=1e-5, atol=1e-5)
REFERENCE = cg.ROCS_OPS["broadcast_attention"].reference


def _inputs(counts, *, lq=1, heads=2, key_len=7, dim=8, mask="bool", seed=0, shuffle=True):
    """``(q, k, v, idx, key_mask, scale, key_bias)`` with ``counts[r]`` candidates of request r;
    the keys of the first request with candidates but fewer than the most all masked."""
    idx = make_index(counts, perm_seed=seed if shuffle else None)
    num_requests, num_candidates = len(counts), idx.shape[0]
    q = randn(num_candidates, heads, lq, dim, seed=seed + 1) * 2
    k = randn(num_requests, heads, key_len, dim, seed=seed + 2) * 2
    v = randn(num_requests, heads, key_len, dim, seed=seed + 3)
    fully = next((r for r, c in enumerate(counts) if 0 < c < max(counts)), None)
    keep = random_mask(num_requests, key_len, seed, fully_masked=fully)
    if mask == "bias":
        bias = randn(num_requests, heads, 1, key_len, seed=seed + 4)
        return q, k, v, idx, None, None, bias.masked_fill(~keep[:, None, None, :], float("-inf"))
    if mask == "none":
        return q, k, v, idx, None, 0.37, None
    return q, k, v, idx, keep, None, None


def _spills(counts) -> bool:
    """Whether some request has more than ``ceil(N / R)`` candidates."""
    tile_rows = -(-sum(counts) // len(counts))
    return max(counts) > tile_rows


BATCHES = [  # (counts, spills)
    ([4, 0, 9, 1], True),
    ([3, 1, 17], True),
    ([0, 5], True),
    ([6], False),
    ([3, 3, 3], False),
    ([1, 1, 1, 1, 1], False),
    ([2, 0, 2, 1], False),
]


def test_the_batches_cover_both_layouts():
    assert [_spills(counts) for counts, _ in BATCHES] == [s for _, s in BATCHES]


@pytest.mark.parametrize("mask", ["bool", "bias", "none"])
@pytest.mark.parametrize("lq", [1, 3])
@pytest.mark.parametrize("counts", [c for c, _ in BATCHES], ids=str)
def test_equals_the_reference(counts, lq, mask):
    args = _inputs(counts, lq=lq, mask=mask)
    want = REFERENCE(*args)
    torch.testing.assert_close(per_request_attention(*args), want, **TOL)
    candidates = want.flatten(1)
    if candidates.shape[0] > 1:  # rows differ far beyond the tolerance
        assert (candidates - candidates[0]).abs().max() > 100 * TOL["atol"]


def test_a_request_whose_keys_are_all_masked_gets_zeros():
    args = _inputs([2, 3, 4], mask="bool")
    out = per_request_attention(*args)
    assert torch.equal(out[args[3] == 0], torch.zeros_like(out[args[3] == 0]))
    assert out[args[3] != 0].abs().min() > 0


def test_no_candidates():
    q, k, v, _, key_mask, _, _ = _inputs([2, 1])
    idx = torch.zeros(0, dtype=torch.int64)
    out = per_request_attention(q[:0], k, v, idx, key_mask)
    assert out.shape == (0, *q.shape[1:])


def test_candidate_ranks_number_each_requests_candidates_in_index_order():
    idx = torch.tensor([2, 0, 2, 2, 0, 3])
    rank, counts = candidate_ranks(idx, 5)
    assert rank.tolist() == [0, 0, 1, 2, 1, 0]
    assert counts.tolist() == [2, 0, 3, 1, 0]


@settings(max_examples=40, deadline=None)
@given(
    index=candidate_index(max_requests=6, max_per_request=9),
    heads=st.integers(1, 3),
    lq=st.integers(1, 4),
    key_len=st.integers(1, 11),
    dim=st.integers(1, 9),
    mask_kind=st.sampled_from(["none", "random", "one_request_fully_masked", "bias"]),
    scale=st.sampled_from([None, 0.37]),
    seed=st.integers(0, 2**16),
)
def test_equals_the_reference_for_any_index(index, heads, lq, key_len, dim, mask_kind, scale, seed):
    num_requests, idx = index
    q = randn(idx.shape[0], heads, lq, dim, seed=seed)
    k = randn(num_requests, heads, key_len, dim, seed=seed + 1)
    v = randn(num_requests, heads, key_len, dim, seed=seed + 2)
    mask = bias = None
    if mask_kind == "bias":
        keep = random_mask(num_requests, key_len, seed)[:, None, None, :]
        bias = randn(num_requests, heads, 1, key_len, seed=seed + 3)
        bias = bias.masked_fill(~keep, float("-inf"))
    elif mask_kind != "none":
        fully = 0 if mask_kind == "one_request_fully_masked" else None
        mask = random_mask(num_requests, key_len, seed, fully_masked=fully)
    args = (q, k, v, idx, mask, scale, bias)
    torch.testing.assert_close(per_request_attention(*args), REFERENCE(*args), **TOL)


def test_the_op_record_names_the_portable_form():
    op = cg.ROCS_OPS["broadcast_attention"]
    assert op.portable is per_request_attention and op.portable_form is per_request_attention
    others = [o for name, o in cg.ROCS_OPS.items() if name != "broadcast_attention"]
    assert all(o.portable_form is o.reference for o in others)


class _Attention(torch.nn.Module):
    def __init__(self, mask: str):
        super().__init__()
        self.mask = mask

    def forward(self, q, k, v, idx, key_mask, key_bias):
        if self.mask == "bias":
            return per_request_attention(q, k, v, idx, key_bias=key_bias)
        return per_request_attention(q, k, v, idx, key_mask)


@pytest.mark.parametrize("mask", ["bool", "bias"])
def test_an_exported_program_is_exact_for_any_r_and_n(mask):
    """One program, exported with dynamic R and N from R = 2, N = 3, holds both layouts (a
    ``torch.cond``) and reads keys and values at R rows only."""
    lq = 2
    q, k, v, idx, key_mask, _, key_bias = _inputs([2, 1], lq=lq, mask=mask)
    key_mask = key_mask if key_mask is not None else torch.ones(2, 7, dtype=torch.bool)
    key_bias = key_bias if key_bias is not None else torch.zeros(2, 2, 1, 7)
    requests, candidates = Dim("R", min=1), Dim("N", min=1)
    dims = ({0: candidates}, {0: requests}, {0: requests}, {0: candidates}, {0: requests},
            {0: requests})  # fmt: skip
    with torch.no_grad():
        program = torch.export.export(
            _Attention(mask), (q, k, v, idx, key_mask, key_bias), dynamic_shapes=dims, strict=False
        )
    conds = [n for n in program.graph.nodes if n.op == "call_function" and "cond" in str(n.target)]
    assert len(conds) == 1
    run = program.module()
    for i, (counts, _) in enumerate(BATCHES):
        q, k, v, idx, key_mask, _, key_bias = _inputs(counts, lq=lq, mask=mask, seed=10 * i)
        key_mask = key_mask if key_mask is not None else torch.ones(len(counts), 7, dtype=bool)
        key_bias = key_bias if key_bias is not None else torch.zeros(len(counts), 2, 1, 7)
        want = REFERENCE(q, k, v, idx, key_mask if mask == "bool" else None, None,
                         key_bias if mask == "bias" else None)  # fmt: skip
        with torch.no_grad():
            torch.testing.assert_close(run(q, k, v, idx, key_mask, key_bias), want, **TOL)
