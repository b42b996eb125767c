"""The numerical contract (docs/contract.md): which rewrites re-associate sums, and the bound.

The defer pass splits a contraction over a request/candidate concatenation into two partial
contractions and adds them. In float32 that re-association is the only difference from eager;
in float16/bfloat16 the partials are summed in float32 and rounded once (``float32_partials``),
as eager's GEMM accumulates, so the compiled model stays within one ulp of eager (and is equal
to it in almost every element).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import rocs_compiler as rocs

LOW = [torch.bfloat16, torch.float16]


def ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of ``x``'s dtype at each value of ``x`` (at least the smallest normal's)."""
    info = torch.finfo(x.dtype)
    mag = x.float().abs().clamp_min(info.tiny)
    return info.eps * torch.exp2(torch.floor(torch.log2(mag)))


def module(forward, **children) -> nn.Module:
    model = type("Numeric", (nn.Module,), {"forward": forward})()
    for name, child in children.items():
        setattr(model, name, child)
    return model.eval()


def linear_head(s, u, c):
    return s.h(torch.cat([s.a(u), c], -1))


def sum_head(s, u, c):
    return torch.cat([s.a(u), c], -1).sum(-1)


def compression_head(s, u, c):
    """DHEN-style linear compression over a concatenated embedding axis."""
    emb = torch.cat([s.a(u).view(-1, 4, 16), c.view(-1, 4, 16)], 1)
    return torch.matmul(s.w, emb)


def einsum_head(s, u, c):
    return torch.einsum("bi,ij->bj", torch.cat([s.a(u), c], -1), s.w)


HEADS = {
    "split_linear": (linear_head, lambda: dict(a=nn.Linear(64, 64), h=nn.Linear(128, 32))),
    "split_sum": (sum_head, lambda: dict(a=nn.Linear(64, 64))),
    "split_matmul": (compression_head, lambda: dict(a=nn.Linear(64, 64), w=nn.Parameter(torch.randn(3, 8)))),
    "split_einsum": (einsum_head, lambda: dict(a=nn.Linear(64, 64), w=nn.Parameter(torch.randn(128, 16) / 8))),
}


def _batch(dtype, requests=16, candidates=300, seed=1):
    g = torch.Generator().manual_seed(seed)
    index = torch.randint(0, requests, (candidates,), generator=g)
    u = torch.randn(requests, 64, generator=g).to(dtype)
    c = torch.randn(candidates, 64, generator=g).to(dtype)
    return u, c, index


def _compare(name, dtype, **options):
    torch.manual_seed(0)
    forward, children = HEADS[name]
    model = module(forward, **children()).to(dtype)
    u, c, index = _batch(dtype)
    example = {"u": u[index[:4]], "c": c[:4]}
    cm = rocs.compile(model, ["u"], example_kwargs=example, options=options)
    assert cm.report().pass_counts[name] == 1
    with torch.no_grad():
        want = model(u[index], c)
        got = cm(u=u, c=c, candidate_to_request=index)
        # Both layouts round the same partials once; drop-in's request partial runs at more rows
        # (every run of equal rows is a request), which a GEMM kernel may sum in another order.
        other = cm(u=u[index], c=c)
        one_ulp = ulp(torch.maximum(other.abs(), got.abs()))
        assert bool(((other.float() - got.float()).abs() <= one_ulp).all())
    return want, got


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("name", sorted(HEADS))
def test_low_precision_splits_round_once_like_eager(name, dtype):
    """float32 partials: within one ulp of eager everywhere, and equal almost everywhere."""
    want, got = _compare(name, dtype)
    diff = (got.float() - want.float()).abs()
    assert bool((diff <= ulp(want)).all()), f"max {diff.max()} over one ulp"
    assert (got != want).float().mean().item() <= 0.01


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_float32_partials_are_measurably_closer_to_eager(dtype):
    """Low-precision partials round three times; they differ from eager in a large fraction of
    elements by up to about one ulp of the partials' scale, the documented bound when
    ``float32_partials=False``."""
    want, wide = _compare("split_linear", dtype)
    _, narrow = _compare("split_linear", dtype, float32_partials=False)
    differ_wide = (wide != want).float().mean().item()
    differ_narrow = (narrow != want).float().mean().item()
    assert differ_narrow > 0.1 and differ_wide < differ_narrow / 10
    # The bound without float32 partials: two ulps of the partials' scale.
    torch.manual_seed(0)
    model = module(linear_head, **HEADS["split_linear"][1]()).to(dtype)
    u, c, index = _batch(dtype)
    with torch.no_grad():
        w = model.h.weight.float()
        scale = (model.a(u).float() @ w[:, :64].t()).abs()[index] + (c.float() @ w[:, 64:].t()).abs()
        scale = scale + model.h.bias.float().abs()
    assert bool(((narrow.float() - want.float()).abs() <= 2 * torch.finfo(dtype).eps * scale).all())


def test_float32_cancelling_terms_stay_within_eager_error():
    """A float32 head whose request and candidate terms cancel: the split re-associates the sum.
    Against a float64 reference the compiled model is no worse than eager times a small factor,
    and it differs from eager by less than the classical bound ``(K + 2) eps sum|terms|``."""
    torch.manual_seed(0)
    model = module(linear_head, a=nn.Linear(32, 32), h=nn.Linear(64, 8))
    with torch.no_grad():
        model.h.weight[:, 32:] = model.h.weight[:, :32]  # candidate columns repeat request ones
    g = torch.Generator().manual_seed(1)
    index = torch.randint(0, 8, (200,), generator=g)
    u = torch.randn(8, 32, generator=g) * 1e3
    with torch.no_grad():
        request_term = model.a(u)
    c = -request_term[index] + torch.randn(200, 32, generator=g) * 1e-2  # cancels it
    cm = rocs.compile(model, ["u"], example_kwargs={"u": u[index[:4]], "c": c[:4]})
    assert cm.report().pass_counts["split_linear"] == 1
    with torch.no_grad():
        want = model(u[index], c)
        got = cm(u=u, c=c, candidate_to_request=index)
        x = torch.cat([request_term[index], c], -1).double()
        w, b = model.h.weight.double(), model.h.bias.double()
        reference = x @ w.t() + b
        terms = x.abs() @ w.abs().t() + b.abs()
    eager_error = (want.double() - reference).abs().max()
    assert (got.double() - reference).abs().max() <= 4 * eager_error
    eps = torch.finfo(torch.float32).eps
    assert bool(((got - want).double().abs() <= (64 + 2) * eps * terms).all())
    assert not torch.equal(got, want)  # the sums were re-associated: the bound is the contract


def test_without_defer_low_precision_is_bitwise():
    """Sharing alone computes each row with the same ops as eager: bit for bit where the GEMM's
    rows do not depend on its row count (the request tower runs at R rows, eager's at N), and
    one rounding of a re-associated float32 sum apart, within one ulp, where they do."""
    torch.manual_seed(0)
    model = module(linear_head, **HEADS["split_linear"][1]()).to(torch.bfloat16)
    u, c, index = _batch(torch.bfloat16)
    cm = rocs.compile(model, ["u"], example_kwargs={"u": u[index[:4]], "c": c[:4]}, options={"defer": False})
    with torch.no_grad():
        got, want = cm(u=u, c=c, candidate_to_request=index), model(u[index], c)
        if torch.equal(model.a(u)[index], model.a(u[index])):
            assert torch.equal(got, want)
        else:  # the request linear's outputs moved by up to one ulp each; the head carries that
            carried = ulp(model.a(u[index])) @ model.h.weight.float()[:, :64].abs().t()
            assert bool(((got.float() - want.float()).abs() <= carried + 2 * ulp(want)).all())


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_inputs_propagate_as_in_eager(value):
    """An inf or NaN in a request or a candidate feature reaches the same outputs as in eager,
    through the split linear (inf - inf = NaN included)."""
    torch.manual_seed(0)
    model = module(linear_head, **HEADS["split_linear"][1]())
    u, c, index = _batch(torch.float32, requests=4, candidates=9)
    u[1, 3] = value
    c[2, 5] = value
    c[4, 0], c[4, 1] = float("inf"), float("-inf")
    cm = rocs.compile(model, ["u"], example_kwargs={"u": u[index[:4]], "c": c[:4]})
    with torch.no_grad():
        want = model(u[index], c)
        for got in (cm(u=u, c=c, candidate_to_request=index), cm(u=u[index], c=c)):
            assert torch.equal(got.isnan(), want.isnan())
            assert torch.equal(got.isinf(), want.isinf())
            torch.testing.assert_close(got, want, equal_nan=True)
