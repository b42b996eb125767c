"""Triton paths of the IKBO ops (launcher + kernel) against the plain-torch references.

Not collected by a plain ``pytest`` run (the file name does not start with ``test_``): the
interpreter must be switched on before triton is imported, so this file runs in its own
process.

- CPU, Triton interpreter (small shapes, float32 and a float16 case):
  ``tests/kernels/test_triton_interp.py`` runs it in a subprocess with
  ``TRITON_INTERPRET=1 ROCS_TRITON_ON_CPU=1``.
- GPU: ``ROCS_TRITON_TEST_DEVICE=cuda python -m pytest tests/kernels/triton_cases.py``
  (``benchmarks/gpu_check.sh`` does this); adds larger shapes and 16-bit dtypes.

Every test also checks that the Triton launcher ran, so a silent fall back to the torch
path cannot pass.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

DEVICE = os.environ.get("ROCS_TRITON_TEST_DEVICE", "cpu")
if DEVICE == "cpu" and not (
    os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("ROCS_TRITON_ON_CPU") == "1"
):
    raise RuntimeError(
        "triton_cases.py on CPU needs TRITON_INTERPRET=1 ROCS_TRITON_ON_CPU=1 set before start"
    )
if DEVICE == "cuda" and not torch.cuda.is_available():
    raise RuntimeError("ROCS_TRITON_TEST_DEVICE=cuda needs a CUDA device; this machine has none")

from ikbo_testing import (  # noqa: E402
    autograd_cases,
    differentiable_leaves,
    make_index,
    random_mask,
)

import rocs_compiler.kernels as cg  # noqa: E402
from rocs_compiler.kernels import (
    attention_triton,
    interaction_triton,
    linear_triton,
    pointwise_triton,
)

ON_GPU = DEVICE == "cuda"
F32_TOL = dict(rtol=1e-4, atol=1e-4)
HALF_TOL = {torch.float16: dict(rtol=1e-2, atol=1e-2), torch.bfloat16: dict(rtol=5e-2, atol=5e-2)}
GPU_ONLY = pytest.mark.skipif(not ON_GPU, reason="large or bfloat16 shapes run on a GPU only")


@pytest.fixture(autouse=True)
def launches(monkeypatch):
    """Count calls into the Triton launchers."""
    counts = {}
    for module, name in [
        (linear_triton, "broadcast_linear"),
        (linear_triton, "broadcast_linear_compression"),
        (attention_triton, "broadcast_attention"),
        (interaction_triton, "broadcast_interaction"),
        (pointwise_triton, "broadcast_pointwise"),
    ]:
        launcher = getattr(module, name)

        def counted(*args, _launcher=launcher, _name=name, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _launcher(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return counts


def randn(*shape, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)


def index(counts, perm_seed=None):
    return make_index(counts, perm_seed).to(DEVICE)


def tol(dtype):
    return F32_TOL if dtype == torch.float32 else HALF_TOL[dtype]


def ref_in_float32(fn, *args):
    """Reference computed in float32 from the same (possibly 16-bit) inputs."""

    def up(a):
        if isinstance(a, list):
            return [up(x) for x in a]
        return a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a

    return fn(*[up(a) for a in args])


LINEAR_CASES = [
    # counts, perm_seed, K, M, bias, dtype
    ([3, 1, 5, 2], 0, 37, 45, True, torch.float32),
    ([4], None, 8, 16, False, torch.float32),
    ([0, 2, 1], 1, 19, 70, True, torch.float32),
    ([2, 3], 2, 24, 16, True, torch.float16),
    pytest.param([70] * 15, 3, 1178, 433, True, torch.float16, marks=GPU_ONLY),
    pytest.param([33, 1, 90], 4, 515, 256, False, torch.bfloat16, marks=GPU_ONLY),
]


@pytest.mark.parametrize("counts, perm_seed, k, m, has_bias, dtype", LINEAR_CASES)
def test_broadcast_linear(launches, counts, perm_seed, k, m, has_bias, dtype):
    idx = index(counts, perm_seed)
    n, r = idx.shape[0], len(counts)
    c, w = randn(n, k, seed=0, dtype=dtype), randn(m, k, seed=1, dtype=dtype)
    bias = randn(m, seed=2, dtype=dtype) if has_bias else None
    rt = randn(r, m, seed=3, dtype=dtype)
    out = torch.ops.rocs.broadcast_linear(c, w, bias, rt, idx)
    ref = ref_in_float32(cg.ROCS_OPS["broadcast_linear"].reference, c, w, bias, rt, idx)
    torch.testing.assert_close(out.float(), ref, **tol(dtype))
    assert out.dtype == dtype and launches["broadcast_linear"] == 1


COMPRESSION_CASES = [
    # counts, perm_seed, Kc, M, D, dtype
    ([2, 1, 3], 0, 20, 45, 33, torch.float32),
    ([1, 2], None, 9, 70, 16, torch.float32),
    pytest.param([70] * 15, 1, 866, 433, 256, torch.float16, marks=GPU_ONLY),
    pytest.param([5, 1, 30], 2, 100, 50, 64, torch.bfloat16, marks=GPU_ONLY),
]


@pytest.mark.parametrize("counts, perm_seed, kc, m, d, dtype", COMPRESSION_CASES)
def test_broadcast_linear_compression(launches, counts, perm_seed, kc, m, d, dtype):
    idx = index(counts, perm_seed)
    n, r = idx.shape[0], len(counts)
    ec, w = randn(n, kc, d, seed=0, dtype=dtype), randn(m, kc, seed=1, dtype=dtype)
    rt = randn(r, m, d, seed=2, dtype=dtype)
    out = torch.ops.rocs.broadcast_linear_compression(ec, w, rt, idx)
    ref = ref_in_float32(cg.ROCS_OPS["broadcast_linear_compression"].reference, ec, w, rt, idx)
    torch.testing.assert_close(out.float(), ref, **tol(dtype))
    assert launches["broadcast_linear_compression"] == 1


ATTENTION_CASES = [
    # counts, perm_seed, H, Lq, L, D, mask kind, scale, dtype
    ([3, 1, 2], 0, 2, 5, 40, 12, "fully_masked", None, torch.float32),
    ([2, 2], None, 1, 20, 100, 16, "random", 0.3, torch.float32),
    ([1, 0, 2], 1, 2, 1, 7, 8, "none", None, torch.float32),
    ([2, 1], 2, 1, 4, 30, 16, "random", None, torch.float16),
    ([2, 3], 5, 2, 3, 33, 8, "bias", None, torch.float32),
    pytest.param([64] * 32, 3, 2, 64, 1024, 128, "random", None, torch.float16, marks=GPU_ONLY),
    pytest.param(
        [3, 40, 1], 4, 4, 17, 300, 64, "fully_masked", None, torch.bfloat16, marks=GPU_ONLY
    ),
]


@pytest.mark.parametrize(
    "counts, perm_seed, h, lq, key_len, d, mask_kind, scale, dtype", ATTENTION_CASES
)
def test_broadcast_attention(
    launches, counts, perm_seed, h, lq, key_len, d, mask_kind, scale, dtype
):
    idx = index(counts, perm_seed)
    n, r = idx.shape[0], len(counts)
    q = randn(n, h, lq, d, seed=0, dtype=dtype)
    k, v = (
        randn(r, h, key_len, d, seed=1, dtype=dtype),
        randn(r, h, key_len, d, seed=2, dtype=dtype),
    )
    mask = bias = None
    if mask_kind == "bias":  # a float mask per request and head: -inf on padded keys, else a bias
        keep = random_mask(r, key_len, seed=3).to(DEVICE)[:, None, None, :]
        bias = randn(r, h, 1, key_len, seed=4, dtype=dtype).masked_fill(~keep, float("-inf"))
    elif mask_kind != "none":
        fully = 0 if mask_kind == "fully_masked" else None
        mask = random_mask(r, key_len, seed=3, fully_masked=fully).to(DEVICE)
    out = torch.ops.rocs.broadcast_attention(q, k, v, idx, mask, scale, bias)
    reference = cg.ROCS_OPS["broadcast_attention"].reference
    ref = ref_in_float32(reference, q, k, v, idx, mask, scale, bias)
    torch.testing.assert_close(out.float(), ref, **tol(dtype))
    if mask_kind == "fully_masked":
        assert torch.equal(out[idx == 0], torch.zeros_like(out[idx == 0]))
    assert launches["broadcast_attention"] == 1


INTERACTION_CASES = [
    # counts, perm_seed, Fu, Fc, D, dtype
    ([3, 1, 5], 0, 7, 5, 70, torch.float32),
    ([2], None, 20, 3, 16, torch.float32),
    pytest.param([70] * 15, 1, 26, 40, 128, torch.float16, marks=GPU_ONLY),
    pytest.param([5, 1, 9], 2, 100, 9, 64, torch.bfloat16, marks=GPU_ONLY),
]


@pytest.mark.parametrize("counts, perm_seed, fu, fc, d, dtype", INTERACTION_CASES)
def test_broadcast_interaction(launches, counts, perm_seed, fu, fc, d, dtype):
    idx = index(counts, perm_seed)
    n, r = idx.shape[0], len(counts)
    rs, cs = randn(r, fu, d, seed=0, dtype=dtype), randn(n, fc, d, seed=1, dtype=dtype)
    out = torch.ops.rocs.broadcast_interaction(rs, cs, idx)
    ref = ref_in_float32(cg.ROCS_OPS["broadcast_interaction"].reference, rs, cs, idx)
    torch.testing.assert_close(out.float(), ref, **tol(dtype))
    assert launches["broadcast_interaction"] == 1


POINTWISE_CASES = [
    # program, trailing shape, dtype
    ("mul(sigmoid(add(c0, r0)), r1)", (3, 5), torch.float32),
    ("add(tanh(c0), gelu(silu(r0)))", (), torch.float32),
    ("where(relu(sub(c0, 0.25)), maximum(r0, c1), minimum(neg(r1), -0.5))", (4,), torch.float32),
    ("div(exp(neg(abs(c0))), sqrt(add(abs(r0), 1.5)))", (2, 3), torch.float32),
    ("mul(rsqrt(add(mul(r0, r0), 1e-05)), log(add(abs(c1), 2.0)))", (7,), torch.float16),
    ("sub(1.0, r0)", (3,), torch.float32),
    pytest.param("mul(sigmoid(add(c0, r0)), r1)", (64, 48), torch.bfloat16, marks=GPU_ONLY),
]


@pytest.mark.parametrize("program, trailing, dtype", POINTWISE_CASES)
def test_broadcast_pointwise(launches, program, trailing, dtype, tmp_path, monkeypatch):
    monkeypatch.setenv("ROCS_KERNEL_CACHE_DIR", str(tmp_path))
    idx = index([3, 1, 4, 2], perm_seed=5)
    n, r = idx.shape[0], 4
    cands = [randn(n, *trailing, seed=i, dtype=dtype) for i in range(2)]
    reqs = [randn(r, *trailing, seed=10 + i, dtype=dtype) for i in range(2)]
    out = torch.ops.rocs.broadcast_pointwise(program, cands, reqs, idx)
    ref = ref_in_float32(cg.ROCS_OPS["broadcast_pointwise"].reference, program, cands, reqs, idx)
    torch.testing.assert_close(out.float(), ref, **tol(dtype), equal_nan=True)
    assert launches["broadcast_pointwise"] == 1


def test_pointwise_kernel_cache_reuses_compiled_kernels(tmp_path, monkeypatch):
    monkeypatch.setenv("ROCS_KERNEL_CACHE_DIR", str(tmp_path))
    from rocs_compiler.kernels.pointwise_program import parse_program

    program = parse_program("add(mul(c0, 3.0), r0)")
    first = pointwise_triton.get_kernel(program, 1, 1, torch.float32)
    assert pointwise_triton.get_kernel(program, 1, 1, torch.float32) is first
    assert any(name.startswith("rocs_generated_pointwise_") for name in sys.modules)


def _on_device(value):
    """``value`` in float32 on DEVICE: floating tensors as new leaves (requiring grad where the
    original does), other tensors moved, lists item by item."""
    if isinstance(value, list):
        return [_on_device(v) for v in value]
    if not isinstance(value, torch.Tensor):
        return value
    if not value.is_floating_point():
        return value.to(DEVICE)
    return value.detach().float().to(DEVICE).requires_grad_(value.requires_grad)


CALLS = {
    "dispatcher": lambda name: getattr(torch.ops.rocs, name).default,
    "direct": lambda name: cg.ROCS_OPS[name].run_with_backward,
}


@pytest.mark.parametrize("call_name", list(CALLS))
@pytest.mark.parametrize("index_name", ["ragged_shuffled"])
def test_backward_after_a_triton_forward(launches, index_name, call_name):
    """Every op's autograd formula, run after the Triton forward, gives the gradients of the
    op's reference (the broadcast materialized, then the unfused op), in float32: the backward
    the training program runs on a GPU."""
    for name, args in autograd_cases(index_name):
        args = tuple(_on_device(a) for a in args)
        leaves = differentiable_leaves(args)
        out = CALLS[call_name](name)(*args)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(DEVICE)
        got = torch.autograd.grad(out, leaves, grad)
        want = torch.autograd.grad(
            cg.ROCS_OPS[name].reference(*args), leaves, grad, allow_unused=True,
            materialize_grads=True,
        )  # fmt: skip
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, **F32_TOL, msg=lambda m, name=name: f"{name}: {m}")
    assert set(launches) == {
        "broadcast_linear", "broadcast_linear_compression", "broadcast_attention",
        "broadcast_interaction", "broadcast_pointwise",
    }, "every op with a Triton kernel ran it"  # fmt: skip


def test_launcher_rejects_out_of_range_index():
    idx = index([2, 1])
    idx[0] = 5
    with pytest.raises(IndexError):
        torch.ops.rocs.broadcast_linear(
            randn(3, 4, seed=0), randn(2, 4, seed=1), None, randn(2, 2, seed=2), idx
        )
