"""The direct program's generated-binding calls compute exactly what the ATen overloads do."""

from __future__ import annotations

import operator

import pytest
import torch

from rocs_compiler.runtime.program.bindings import fast_callable

aten = torch.ops.aten
g = torch.Generator().manual_seed(0)


def t(*shape, dtype=torch.float32):
    if dtype == torch.bool:
        return torch.rand(*shape, generator=g) > 0.5
    if dtype == torch.int64:
        return torch.randint(0, 4, shape, generator=g)
    return torch.randn(*shape, generator=g, dtype=dtype)


x, y, w, b = t(3, 4), t(3, 4), t(5, 4), t(5)
x3, y3 = t(2, 3, 4), t(2, 4, 3)
CALLS = [
    (aten.linear.default, (x, w, b), {}),
    (aten.linear.default, (x, w), {}),
    (aten.addmm.default, (b, x, w.t()), {}),
    (aten.mm.default, (x, w.t()), {}),
    (aten.bmm.default, (x3, y3), {}),
    (aten.baddbmm.default, (t(2, 3, 3), x3, y3), {"alpha": 0.5}),
    (aten.matmul.default, (x3, t(4, 2)), {}),
    (aten.einsum.default, ("bij,bjk->bik", [x3, y3]), {}),
    (aten.reshape.default, (x3, [6, -1]), {}),
    (aten.view.default, (x3, [2, 12]), {}),
    (aten.transpose.int, (x3, 1, 2), {}),
    (aten.t.default, (x,), {}),
    (aten.permute.default, (x3, [2, 0, 1]), {}),
    (aten.unsqueeze.default, (x, 1), {}),
    (aten.squeeze.dim, (t(3, 1, 4), 1), {}),
    (aten.squeeze.dims, (t(3, 1, 1), [1, 2]), {}),
    (aten.select.int, (x3, 1, -1), {}),
    (aten.expand.default, (t(1, 4), [3, 4]), {}),
    (aten.expand_as.default, (t(1, 4), x), {}),
    (aten.flatten.using_ints, (x3, 1), {}),
    (aten.unflatten.int, (x, 1, [2, 2]), {}),
    (aten.contiguous.default, (x.t(),), {}),
    (aten.clone.default, (x,), {"memory_format": torch.contiguous_format}),
    (aten.narrow.default, (x, 1, 1, 2), {}),
    (aten.split.Tensor, (x, 2, 1), {}),
    (aten.split_with_sizes.default, (x, [1, 3], 1), {}),
    (aten.chunk.default, (x, 2, -1), {}),
    (aten.unbind.int, (x3, 1), {}),
    (aten.repeat.default, (x, [2, 1]), {}),
    (aten.cat.default, ([x, y], 1), {}),
    (aten.cat.default, ([x, y],), {}),
    (aten.stack.default, ([x, y], 2), {}),
    (aten.index_select.default, (x, 0, torch.tensor([2, 0, 0])), {}),
    (aten.gather.default, (x, 1, t(3, 2, dtype=torch.int64)), {}),
    (aten.embedding.default, (w, torch.tensor([[1, 4], [0, 0]])), {}),
    (aten.embedding.default, (w, torch.tensor([1, 4]), 0), {}),
    (aten.sum.dim_IntList, (x3, [-1]), {}),
    (aten.sum.dim_IntList, (x3, [0, 2], True), {}),
    (aten.sum.default, (x,), {}),
    (aten.mean.dim, (x3, [1]), {"keepdim": True}),
    (aten.mean.default, (x,), {}),
    (aten.amax.default, (x3, [1]), {}),
    (aten.softmax.int, (x, -1), {}),
    (aten._softmax.default, (x, 1, False), {}),
    (aten.log_softmax.int, (x, 0), {}),
    (aten._log_softmax.default, (x, 1, False), {}),
    (aten.layer_norm.default, (x, [4], t(4), t(4), 1e-5), {}),
    (aten.dropout.default, (x, 0.1, False), {}),
    (aten.scaled_dot_product_attention.default, (x3, x3, x3), {"scale": 0.3}),
    (aten.zeros_like.default, (x,), {"dtype": torch.float64}),
    (aten.ones_like.default, (x,), {}),
    (aten.full_like.default, (x, 2.5), {}),
    (aten.cumsum.default, (x, 1), {}),
    (aten.sym_size.int, (x3, 1), {}),
    # pointwise, tensor and Python-number operands
    (aten.add.Tensor, (x, y), {}),
    (aten.add.Tensor, (x, 2), {"alpha": 3}),
    (aten.add.Tensor, (t(3, 4, dtype=torch.int64), 0.5), {}),
    (aten.sub.Tensor, (x, t(4)), {}),
    (aten.mul.Tensor, (x, 3.0), {}),
    (aten.mul.Tensor, (t(3, 4, dtype=torch.int64), 2), {}),
    (aten.div.Tensor, (x, y), {}),
    (aten.div.Tensor_mode, (x, y), {"rounding_mode": "floor"}),
    (aten.rsub.Scalar, (x, 1), {}),
    (aten.pow.Tensor_Scalar, (x, 2), {}),
    (aten.relu.default, (x,), {}),
    (aten.sigmoid.default, (x,), {}),
    (aten.tanh.default, (x,), {}),
    (aten.gelu.default, (x,), {"approximate": "tanh"}),
    (aten.silu.default, (x,), {}),
    (aten.leaky_relu.default, (x, 0.2), {}),
    (aten.clamp_min.default, (x, 0.1), {}),
    (aten.clamp.default, (x, -0.5, 0.5), {}),
    (aten.where.self, (t(3, 4, dtype=torch.bool), x, y), {}),
    (aten.masked_fill.Scalar, (x, t(3, 4, dtype=torch.bool), -1.0), {}),
    (aten.eq.Scalar, (t(3, 4, dtype=torch.int64), 0), {}),
    (aten.ne.Scalar, (t(3, 4, dtype=torch.int64), 1), {}),
    (aten.gt.Scalar, (x, 0.0), {}),
    (aten.lt.Tensor, (x, y), {}),
    (aten.bitwise_not.default, (t(3, 4, dtype=torch.bool),), {}),
    (aten.__and__.Tensor, (t(3, 4, dtype=torch.bool), t(3, 4, dtype=torch.bool)), {}),
    (aten.fill.Scalar, (x, 1.5), {}),
    # in-place variants (run on copies)
    (aten.add_.Tensor, (x, y), {}),
    (aten.mul_.Tensor, (x, 0.5), {}),
    (aten.relu_.default, (x,), {}),
    (aten.sigmoid_.default, (x,), {}),
    (aten.div_.Tensor, (x, 3.0), {}),
]


def _copies(args):
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def _assert_same(got, want):
    if isinstance(want, (tuple, list)):
        assert len(got) == len(want)
        for a, b in zip(got, want):
            _assert_same(a, b)
        return
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape and got.stride() == want.stride()
        assert torch.equal(got, want)
    else:
        assert got == want


@pytest.mark.parametrize("op, args, kwargs", CALLS, ids=[str(c[0]) for c in CALLS])
def test_binding_matches_overload(op, args, kwargs):
    binding = fast_callable(op)
    assert binding is not None, f"{op} has no binding"
    want_args, got_args = _copies(args), _copies(args)
    want = op(*want_args, **kwargs)
    got = binding(*got_args, **kwargs)
    _assert_same(got, want)
    _assert_same(got_args, want_args)  # in-place variants wrote the same values


@pytest.mark.parametrize(
    "op",
    [aten.index.Tensor, aten.slice.Tensor, aten.nonzero.default, aten.native_dropout.default,
     aten.bernoulli.default, aten.scatter_.src, aten.index_put_.default, aten.max.dim,
     aten.to.dtype, aten.to.dtype_layout, aten.__and__.bool, aten.add.int],
    ids=str,
)  # fmt: skip
def test_unreviewed_ops_keep_the_overload(op):
    """Ops without a reviewed binding (no binding, random, writes through their first argument
    but not elementwise, not listed, a binding parsing other signatures, or an overload on
    Python numbers) are called through the overload."""
    assert fast_callable(op) is None


def test_non_aten_targets_are_not_bound():
    assert fast_callable(operator.getitem) is None
    assert fast_callable(torch.ops.rocs.broadcast_linear.default) is None
