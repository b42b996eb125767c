"""Autograd of every ``rocs::`` op: ``torch.autograd.gradcheck`` in float64 at small shapes.

The oracle of gradcheck is finite differences of the op itself, which knows nothing about the
backward formula under test. A second check compares the op's gradients with those of its
reference (the broadcast materialized, then the unfused op), so a formula that is right for the
op but not for the model it replaced cannot pass either. Index layouts: ragged (1, 3 and 5
candidates), a request without candidates, shuffled order, R = 1, every candidate its own
request.
"""

from __future__ import annotations

import pytest
import torch
from ikbo_testing import (
    AUTOGRAD_INDEXES,
    autograd_cases,
    differentiable_leaves,
    make_index,
    randn,
)
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import rocs_compiler.kernels as cg
from rocs_compiler.kernels import attention, request_groups, rocs_op
from rocs_compiler.kernels.request_groups import group_by_request

DT = torch.float64
INDEXES = AUTOGRAD_INDEXES


def _leaf(*shape, seed):
    return randn(*shape, seed=seed, dtype=DT).requires_grad_()


def _op(name):
    return getattr(torch.ops.rocs, name).default


# Both ways a program calls an op under autograd: through the dispatcher (the graph module,
# tracers) and the direct call of the training program (``RocsOp.run_with_backward``).
CALLS = {
    "dispatcher": _op,
    "direct": lambda name: cg.ROCS_OPS[name].run_with_backward,
}


# The direct call differs from the dispatcher's only in the wrapper around one formula: two
# index layouts check it.
CALLED = [(i, "dispatcher") for i in INDEXES] + [
    ("ragged_shuffled", "direct"), ("each_its_own", "direct")
]


@pytest.mark.parametrize("index_name, call_name", CALLED)
def test_gradcheck_every_op(index_name, call_name):
    covered = set()
    for name, args in autograd_cases(index_name):
        covered.add(name)
        op = CALLS[call_name](name)
        leaves = differentiable_leaves(args)

        def call(*values, args=args, op=op):
            return op(*_rebuilt(args, values))

        assert torch.autograd.gradcheck(call, tuple(leaves), eps=1e-6, atol=1e-6), name
    assert covered == set(cg.ROCS_OPS), "every rocs:: op has a gradcheck case"


def _rebuilt(args, values):
    it = iter(values)
    rebuilt = []
    for a in args:
        if isinstance(a, list):
            rebuilt.append([next(it) if t.requires_grad else t for t in a])
        elif isinstance(a, torch.Tensor) and a.requires_grad:
            rebuilt.append(next(it))
        else:
            rebuilt.append(a)
    return rebuilt


def _gradgradcheck(fn, leaves) -> bool:
    return torch.autograd.gradgradcheck(fn, tuple(leaves), eps=1e-6, atol=1e-5, fast_mode=True)


@pytest.mark.parametrize("call_name", list(CALLS))
def test_double_backward_every_op(call_name):
    """``create_graph=True`` through every op: second derivatives by finite differences of the
    first (``gradgradcheck``), on a ragged shuffled index; where the reference (the unfused op,
    eager's, SDPA in its math form) has no second derivative (``embedding_bag``), the op raises
    as eager does."""
    for name, args in autograd_cases("ragged_shuffled"):
        op = CALLS[call_name](name)
        leaves = differentiable_leaves(args)
        call = lambda *values, args=args, op=op: op(*_rebuilt(args, values))  # noqa: E731
        reference = cg.ROCS_OPS[name].reference
        eager = lambda *values, args=args, f=reference: f(*_rebuilt(args, values))  # noqa: E731
        try:
            with sdpa_kernel(SDPBackend.MATH):  # SDPA's fused CPU backward is first order only
                _gradgradcheck(eager, leaves)
        except (NotImplementedError, RuntimeError) as err:
            assert "not implemented" in str(err), (name, err)
            with pytest.raises((NotImplementedError, RuntimeError), match="not implemented"):
                _gradgradcheck(call, leaves)
            continue
        assert _gradgradcheck(call, leaves), name


@pytest.mark.parametrize("call_name", list(CALLS))
@pytest.mark.parametrize("index_name", list(INDEXES))
def test_gradients_equal_the_references(index_name, call_name):
    for name, args in autograd_cases(index_name):
        record = cg.ROCS_OPS[name]
        leaves = differentiable_leaves(args)
        out = CALLS[call_name](name)(*args)
        grad = torch.randn(out.shape, dtype=DT, generator=torch.Generator().manual_seed(5))
        got = torch.autograd.grad(out, leaves, grad)
        want = torch.autograd.grad(
            record.reference(*args), leaves, grad, allow_unused=True, materialize_grads=True
        )
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, msg=name)


def test_only_requested_gradients_are_computed():
    r, idx = INDEXES["ragged_shuffled"]
    c = randn(idx.shape[0], 3, seed=1, dtype=DT)
    weight = _leaf(2, 3, seed=2)
    request_term = randn(r, 2, seed=3, dtype=DT)
    out = torch.ops.rocs.broadcast_linear(c, weight, None, request_term, idx)
    (grad,) = torch.autograd.grad(out.sum(), [weight])
    torch.testing.assert_close(grad, torch.ones(idx.shape[0], 2, dtype=DT).t() @ c)


def test_backward_of_broadcast_is_a_per_request_sum():
    """A request row read by k candidates gets the sum of their k gradient rows."""
    idx = make_index([1, 3, 17])
    request_term = torch.zeros(3, 2, requires_grad=True)
    out = torch.ops.rocs.broadcast_linear(
        torch.zeros(21, 1), torch.zeros(2, 1), None, request_term, idx
    )
    out.backward(torch.ones(21, 2))
    torch.testing.assert_close(
        request_term.grad, torch.tensor([[1.0, 1.0], [3.0, 3.0], [17.0, 17.0]])
    )


class _Recorder(TorchDispatchMode):
    """Records every ATen op run inside it and the shapes of its tensor outputs."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, list[tuple]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        shapes = [tuple(t.shape) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.ops.append((str(func), shapes))
        return out


@pytest.mark.parametrize("index_name", ["ragged_shuffled", "equal_contiguous"])
def test_backward_neither_recomputes_nor_replicates(index_name):
    """The interaction's and attention's backward are their own formulas: no forward op runs
    again (no SDPA, no third bmm) and no tensor of the request side's shape at N rows exists."""
    r, idx = INDEXES[index_name]
    n = idx.shape[0]
    cases = {
        "broadcast_interaction": (_leaf(r, 3, 7, seed=1), _leaf(n, 2, 7, seed=2), idx),
        "broadcast_attention": (
            _leaf(n, 2, 1, 3, seed=3), _leaf(r, 2, 6, 3, seed=4), _leaf(r, 2, 6, 3, seed=5), idx
        ),
    }  # fmt: skip
    groups = len(group_by_request(idx, r))
    for name, args in cases.items():
        out = _op(name)(*args)
        recorder = _Recorder()
        with recorder:
            torch.autograd.grad(out, differentiable_leaves(args), torch.ones_like(out))
        names = [op for op, _ in recorder.ops]
        replicated = (n, *args[0 if name == "broadcast_interaction" else 1].shape[1:])
        assert all(replicated not in shapes for _, shapes in recorder.ops), (name, recorder.ops)
        assert not any("scaled_dot_product" in op for op in names), (name, names)
        if name == "broadcast_interaction":
            assert names.count("aten.bmm.default") == 2 * groups, names


@pytest.mark.parametrize("mode", [0, 1])
def test_embedding_bag_rows_backward_does_not_pool_again(mode):
    weight = _leaf(6, 3, seed=1)
    indices = torch.tensor([[0, 1, 5], [2, 2, 0]])
    out = _op("embedding_bag_rows")(weight, indices, mode, 0)
    recorder = _Recorder()
    with recorder:
        (grad,) = torch.autograd.grad(out, [weight], torch.ones_like(out))
    assert not any("embedding_bag" in op for op, _ in recorder.ops), recorder.ops
    want = torch.zeros(6, 3, dtype=DT)
    share = 1.0 if mode == 0 else 0.5
    for row in ([1, 5], [2, 2]):
        for i in row:
            want[i] += share
    torch.testing.assert_close(grad, want)


def test_attention_backward_of_a_fully_masked_bias_row_is_zero():
    r, idx = INDEXES["ragged_shuffled"]
    q = _leaf(idx.shape[0], 2, 1, 3, seed=1)
    k, v = _leaf(r, 2, 4, 3, seed=2), _leaf(r, 2, 4, 3, seed=3)
    bias = torch.zeros(r, 2, 1, 4, dtype=DT)
    bias[1] = -float("inf")
    bias.requires_grad_()
    args = (q, k, v, idx, None, None, bias)
    assert torch.autograd.gradcheck(lambda *t: _op("broadcast_attention")(*t, idx, None, None,
                                    bias), (q, k, v), eps=1e-6, atol=1e-6)  # fmt: skip
    out = _op("broadcast_attention")(*args)
    grads = torch.autograd.grad(out, [q, k, v, bias], torch.ones_like(out))
    assert all(torch.isfinite(g).all() for g in grads)
    assert (grads[0][idx == 1] == 0).all() and (grads[1][1] == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_backward_is_float32s_rounded(dtype):
    """Half-precision inputs are differentiated in float32: gradients equal the float32 ones
    computed from the same (rounded) inputs, up to the final rounding."""
    r, idx = INDEXES["ragged_shuffled"]
    n = idx.shape[0]
    cases = {
        "broadcast_attention": (randn(n, 2, 2, 8, seed=1), randn(r, 2, 5, 8, seed=2),
                                randn(r, 2, 5, 8, seed=3), idx),
        "broadcast_interaction": (randn(r, 3, 8, seed=4), randn(n, 2, 8, seed=5), idx),
    }  # fmt: skip
    for name, args in cases.items():
        low = [a.to(dtype) if a.is_floating_point() else a for a in args]
        results = []
        for inputs in (low, [a.float() if a.is_floating_point() else a for a in low]):
            leaves = [a.detach().requires_grad_() if a.is_floating_point() else a for a in inputs]
            out = _op(name)(*leaves)
            grad = torch.ones_like(out)
            results.append(torch.autograd.grad(out, [t for t in leaves if t.requires_grad], grad))
        for got, want in zip(*results):
            assert got.dtype == dtype
            torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2, msg=name)


@pytest.mark.parametrize("limit", [0, 1 << 30])
def test_attention_backward_either_way_is_the_references(monkeypatch, limit):
    """Large attentions differentiate the grouped SDPA instead of the formula: both are exact."""
    monkeypatch.setattr(attention, "EXPLICIT_BACKWARD_MAX_SCORES", limit)
    for index_name in INDEXES:
        for name, args in autograd_cases(index_name):
            if name != "broadcast_attention":
                continue
            leaves = differentiable_leaves(args)
            out = _op(name)(*args)
            grad = torch.randn(out.shape, dtype=DT, generator=torch.Generator().manual_seed(5))
            got = torch.autograd.grad(out, leaves, grad)
            want = torch.autograd.grad(cg.ROCS_OPS[name].reference(*args), leaves, grad)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, msg=index_name)


def test_one_call_groups_and_checks_its_index_once_forward_and_backward(monkeypatch):
    """Ops of one compiled call share the grouping and the index check of their index, and
    their backward (run by autograd after the call returned) reuses the forward's grouping."""
    counts = {"groups": 0, "checks": 0}
    group, check = request_groups._group_by_request, rocs_op.check_candidate_to_request

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(request_groups, "_group_by_request", counted("groups", group))
    monkeypatch.setattr(rocs_op, "check_candidate_to_request", counted("checks", check))
    r, idx = INDEXES["ragged_shuffled"]
    u, c = _leaf(r, 3, 4, seed=1), _leaf(idx.shape[0], 2, 4, seed=2)
    with request_groups.call_groups(idx):
        out = _op("broadcast_interaction")(u, c, idx) + _op("broadcast_interaction")(u, c, idx)
    out.sum().backward()
    assert counts == {"groups": 1, "checks": 1}
    with pytest.raises(ValueError, match="candidate_to_request"), request_groups.call_groups(idx):
        _op("broadcast_interaction")(u, c, idx)
        _op("broadcast_interaction")(u[:1], c, idx)  # other rows: checked again
