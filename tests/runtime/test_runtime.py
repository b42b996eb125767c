"""The runtime: any R and N without recompiling, threads, input and output structures, drop-in
request detection."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from models_for_tests import (
    DICT_FEATURES,
    OPTIONS,
    SEQUENCE_3D,
    USER_ITEM_MLP,
    D,
    assert_outputs_match,
    check_both_conventions,
    eager,
)
from torch import nn

import rocs_compiler as rocs
from models_zoo import Batch, request_index
from rocs_compiler.runtime.rows.request_detection import group_requests, rows_consistent

SHAPES = {
    "one": ([1], False),
    "two_requests": ([2, 3], False),
    "one_request": ([7], False),
    "singletons": ([1, 1, 1, 1], False),
    "ragged_shuffled": ([5, 9, 2, 4], True),
}


# ------------------------------------------------------------------------------------------
# Shapes


@pytest.mark.parametrize("example_counts", [(1,), (4,), (1, 1)], ids=["N1", "R1", "R2_N2"])
def test_tiny_example_batches_compile_and_run(example_counts):
    model = USER_ITEM_MLP.build()
    cm = USER_ITEM_MLP.compile(model, example_counts=example_counts)
    for counts, shuffle in SHAPES.values():
        batch = USER_ITEM_MLP.batch(counts, seed=1, shuffle=shuffle)
        check_both_conventions(cm, model, batch, f"example {example_counts}, counts {counts}")


@pytest.mark.parametrize("case", [USER_ITEM_MLP, SEQUENCE_3D], ids=lambda c: c.name)
def test_any_r_and_n_without_recompiling(case, monkeypatch):
    model = case.build()
    cm = case.compile(model)
    graph, code = cm.graph_module, cm.graph_module.code

    def no_capture(*args, **kwargs):
        raise AssertionError("the model was captured again at call time")

    monkeypatch.setattr(torch.export, "export", no_capture)
    for i, (counts, shuffle) in enumerate(SHAPES.values()):
        check_both_conventions(cm, model, case.batch(counts, seed=i, shuffle=shuffle), str(counts))
    assert cm.graph_module is graph
    assert cm.graph_module.code == code


def test_request_without_candidates_and_empty_batch():
    model = USER_ITEM_MLP.build()
    cm = USER_ITEM_MLP.compile(model)
    base = USER_ITEM_MLP.batch([2, 2, 3], seed=4)
    index = torch.tensor([0, 2, 2, 0, 2])  # request 1 has no candidates
    sparse = Batch(base.kwargs, index, base.request_inputs)
    sparse.kwargs["item"] = sparse.kwargs["item"][:5]
    expected = eager(model, sparse.replicated())
    assert_outputs_match(
        cm(**sparse.kwargs, candidate_to_request=index), expected, "unused request"
    )

    empty = USER_ITEM_MLP.batch([0], seed=4)
    expected = eager(model, empty.replicated())
    got = cm(**empty.kwargs, candidate_to_request=empty.candidate_to_request)
    assert_outputs_match(got, expected, "N = 0, shared layout")
    assert_outputs_match(cm(**empty.replicated()), expected, "N = 0, drop-in")


# ------------------------------------------------------------------------------------------
# Threads


@pytest.mark.parametrize("pointwise", [False, True], ids=["default", "ikbo-pointwise"])
def test_concurrent_calls_from_four_threads(pointwise):
    model = SEQUENCE_3D.build()
    options = {**OPTIONS, "ikbo_pointwise": True} if pointwise else OPTIONS
    cm = SEQUENCE_3D.compile(model, options=options)
    batches = [
        SEQUENCE_3D.batch(counts, seed=i, shuffle=True)
        for i, counts in enumerate([[3, 1, 5], [1], [2, 2, 2, 2, 2], [8, 1]])
    ]
    expected = [eager(model, b.replicated()) for b in batches]
    barrier = threading.Barrier(len(batches))
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            barrier.wait(timeout=30)
            batch = batches[i]
            for k in range(12):
                if k % 2:
                    got = cm(**batch.replicated())
                else:
                    got = cm(**batch.kwargs, candidate_to_request=batch.candidate_to_request)
                assert_outputs_match(got, expected[i], f"thread {i} call {k}")
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(batches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, errors[0]


# ------------------------------------------------------------------------------------------
# Input structures


def test_dict_inputs_and_dotted_request_names():
    model = DICT_FEATURES.build()
    cm = DICT_FEATURES.compile(model)
    batch = DICT_FEATURES.batch([3, 1, 2], seed=2, shuffle=True)
    check_both_conventions(cm, model, batch, "dict inputs")
    expected = eager(model, batch.replicated())
    positional = cm(batch.replicated()["features"])
    assert_outputs_match(positional, expected, "positional dict")
    positional = cm(batch.kwargs["features"], candidate_to_request=batch.candidate_to_request)
    assert_outputs_match(positional, expected, "positional dict, shared layout")


class NestedUser(nn.Module):
    """Request features in one dict argument, named as a whole by ``request_inputs=["user"]``."""

    def __init__(self):
        super().__init__()
        self.age = nn.Embedding(10, D)
        self.lin = nn.Linear(D, D)

    def forward(self, user, item):
        return ((self.age(user["age"]) + self.lin(user["dense"])) * item).sum(-1)


def test_a_dict_argument_named_as_a_whole():
    from models_for_tests import Case, Spec

    case = Case(
        "nested_user",
        NestedUser,
        ("user",),
        (("user.age", Spec((), 10)), ("user.dense", Spec()), ("item", Spec())),
    )
    model = case.build()
    batch = case.batch([2, 1, 3], seed=5, shuffle=True)
    assert batch.request_inputs == ("user.age", "user.dense")
    cm = case.compile(model)
    assert sorted(cm.contract.request_inputs) == ["user.age", "user.dense"]
    check_both_conventions(cm, model, batch, "whole dict")


def test_positional_and_keyword_calls_agree():
    model = USER_ITEM_MLP.build()
    cm = USER_ITEM_MLP.compile(model)
    batch = USER_ITEM_MLP.batch([3, 1, 2], seed=6, shuffle=True)
    rep, sh, idx = batch.replicated(), batch.kwargs, batch.candidate_to_request
    expected = eager(model, rep)
    calls = {
        "keywords": cm(**rep),
        "positional": cm(rep["user"], rep["user_ids"], rep["item"]),
        "mixed": cm(rep["user"], item=rep["item"], user_ids=rep["user_ids"]),
        "shared positional": cm(sh["user"], sh["user_ids"], sh["item"], candidate_to_request=idx),
        "shared keywords": cm(**sh, candidate_to_request=idx),
    }
    for what, got in calls.items():
        assert_outputs_match(got, expected, what)


class NonBatchedInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, user, item, weights):
        return (self.lin(user) * weights + item).sum(-1)


def test_non_batched_tensor_input_is_read_at_every_call():
    model = NonBatchedInput().eval()
    g = torch.Generator().manual_seed(0)
    index = torch.tensor([0, 0, 1, 1, 1])
    user, item = torch.randn(2, D, generator=g), torch.randn(5, D, generator=g)
    example = {"user": user[index], "item": item, "weights": torch.ones(D)}
    cm = rocs.compile(model, ["user"], example_kwargs=example, options=OPTIONS)
    for _ in range(2):
        w = torch.randn(D, generator=g)
        expected = eager(model, {"user": user[index], "item": item, "weights": w})
        assert_outputs_match(cm(user=user[index], item=item, weights=w), expected, "drop-in")
        got = cm(user=user, item=item, weights=w, candidate_to_request=index)
        assert_outputs_match(got, expected, "shared")


# ------------------------------------------------------------------------------------------
# Output structures


class ManyOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.user_lin = nn.Linear(D, D)
        self.item_lin = nn.Linear(D, D)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, D))

    def forward(self, user, item):
        u = torch.tanh(self.user_lin(user))
        score = (u * self.item_lin(item)).sum(-1)
        return {
            "scores": (score, torch.sigmoid(score)),
            "user_vec": u,  # request-only: comes back with N rows
            "user_raw": user,  # a request input returned as is
            "scale_doubled": self.scale * 2,  # no batch dim
            "batch_mean": score.mean(),  # 0-d, depends on every row
            "version": 3,
            "pair": [u.sum(-1, keepdim=True), item],
        }


def test_outputs_keep_the_original_structure():
    model = ManyOutputs().eval()
    from models_for_tests import Case

    case = Case("many_outputs", ManyOutputs)
    cm = case.compile(model)
    batch = case.batch([3, 1, 2], seed=7, shuffle=True)
    check_both_conventions(cm, model, batch, "many outputs")
    out = cm(**batch.kwargs, candidate_to_request=batch.candidate_to_request)
    assert list(out) == list(eager(model, batch.replicated()))
    assert out["user_vec"].shape == (6, D) and out["user_raw"].shape == (6, D)
    assert out["version"] == 3
    assert isinstance(out["scores"], tuple) and isinstance(out["pair"], list)


class NoneOutput(nn.Module):
    """Models often return ``(logits, None)`` when an auxiliary output is off in eval."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, 1)

    def forward(self, user, item):
        return self.lin(user * item).squeeze(-1), None


def test_none_among_the_outputs():
    from models_for_tests import Case

    case = Case("none_output", NoneOutput)
    model = case.build()
    cm = case.compile(model)
    batch = case.batch([2, 3], seed=1, shuffle=True)
    try:
        check_both_conventions(cm, model, batch, "(tensor, None) output")
    except StopIteration:
        raise AssertionError(
            "a None output crashes the runtime: InputContract.outputs uses None as the marker for "
            "'a tensor goes here', so a literal None output consumes a graph output"
        ) from None


class SizeOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, 1)

    def forward(self, user, item):
        return (self.lin(user * item).squeeze(-1), user.size(0))


def test_integer_output_that_depends_on_the_batch_size():
    """``x.size(0)`` returned as an output is N at every call, not the example's N."""
    model = SizeOutput().eval()
    from models_for_tests import Case

    case = Case("size_output", SizeOutput)
    try:
        cm = case.compile(model, example_counts=(2, 3))  # example N = 5
    except rocs.CompileError:
        return  # refusing the model is acceptable; answering 5 forever is not
    batch = case.batch([4, 3], seed=1)
    out = cm(**batch.replicated())
    assert out[1] == 7, (
        f"the compiled model returned {out[1]} for x.size(0) with N = 7: non-tensor outputs are "
        "baked in from the example call at capture"
    )


class ConstantOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, user, item):
        return (self.lin(user) * item).sum(-1), self.lin.weight.t() * 2


def test_constant_outputs_do_not_alias_compiled_state():
    """The original returns a fresh tensor for ``weight.t() * 2`` at every call; the compiled model
    must not hand out its own folded constant, or a caller's in-place update corrupts later calls."""
    from models_for_tests import Case

    case = Case("constant_output", ConstantOutput)
    model = case.build()
    cm = case.compile(model)
    batch = case.batch([2, 1], seed=2)
    first = cm(**batch.replicated())
    first[1].add_(100.0)
    second = cm(**batch.replicated())
    expected = eager(model, batch.replicated())
    assert torch.allclose(second[1], expected[1]), (
        "mutating a returned constant output changed the next call's output: constant folding "
        "returns the compiled model's buffer itself"
    )


def test_to_cpu():
    model = USER_ITEM_MLP.build()
    cm = USER_ITEM_MLP.compile(model)
    assert cm.to("cpu") is cm
    assert cm.to(torch.device("cpu")) is cm
    assert all(b.device.type == "cpu" for b in cm.buffers())
    check_both_conventions(
        cm, model, USER_ITEM_MLP.batch([2, 3], seed=8, shuffle=True), "after .to"
    )


def test_runner_calls_the_ops_directly_on_the_same_weights():
    """The runtime runs the graph as straight-line code whose rocs ops skip the dispatcher and
    their checks; it must read the compiled graph's own tensors, not copies of them."""
    from rocs_compiler.kernels import ROCS_OPS
    from rocs_compiler.runtime.program.direct import DirectProgram

    model = USER_ITEM_MLP.build()
    cm = USER_ITEM_MLP.compile(model)
    graph_ops = [n.target for n in cm.graph_module.graph.nodes if n.op == "call_function"]
    assert torch.ops.rocs.broadcast_linear.default in graph_ops
    runner = cm._graph_runner()
    assert isinstance(runner, DirectProgram)
    runners = {getattr(f, "__self__", None) for f in runner._globals.values()}
    assert ROCS_OPS["broadcast_linear"] in runners  # RocsOp.run, bound: no checks, no dispatcher
    held = [*cm.graph_module.parameters(), *cm.graph_module.buffers()]
    constants = runner.constants()
    assert constants and all(any(c is t for t in held) for c in constants)
    assert not any(name.startswith("_runner") for name in cm.state_dict())


def test_graphs_with_module_calls_stay_fx_graphs():
    from torch import fx

    from rocs_compiler.runtime.program.direct import DirectProgram, direct_program

    gm = fx.symbolic_trace(nn.Sequential(nn.Linear(3, 2), nn.ReLU()))
    assert direct_program(gm) is gm
    with pytest.raises(ValueError, match="call_module"):
        DirectProgram(gm)


def test_dynamo_traces_the_graph_not_the_direct_program():
    """Under torch.compile the runtime hands dynamo the FX graph, whose ops it can trace."""
    model = USER_ITEM_MLP.build()
    cm = USER_ITEM_MLP.compile(model)
    batch = USER_ITEM_MLP.batch([2, 3], seed=6, shuffle=True)
    seen = []

    def recording_backend(gm, example_inputs):
        seen.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(cm, backend=recording_backend)
    shared = dict(batch.kwargs, candidate_to_request=batch.candidate_to_request)
    torch.testing.assert_close(compiled(**shared), cm(**shared))
    assert any("broadcast_linear" in str(t) for t in seen)


def test_dtype_change_rebuilds_the_runner():
    model = USER_ITEM_MLP.build()
    cm = USER_ITEM_MLP.compile(model)
    batch = USER_ITEM_MLP.batch([2, 3], seed=4, shuffle=True)
    cm(**batch.replicated())  # builds the runner on the float32 buffers
    cm.to(torch.float64)
    model.to(torch.float64)
    inputs = {k: v.double() if v.is_floating_point() else v for k, v in batch.replicated().items()}
    got = cm(**inputs)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, eager(model, inputs), rtol=1e-10, atol=1e-10)


# ------------------------------------------------------------------------------------------
# Exactness corner cases


class SignedZeros(nn.Module):
    def forward(self, user, item):
        return torch.reciprocal(item * 0.0) + torch.reciprocal(item * -0.0) + user


def test_signed_zero_literals_are_not_merged():
    """``x * 0.0`` and ``x * -0.0`` differ in sign (1/0 = inf, 1/-0 = -inf); merging them as
    common subexpressions changes inf + -inf = nan into inf."""
    from models_for_tests import Case

    case = Case("signed_zeros", SignedZeros)
    model = case.build()
    cm = case.compile(model)
    batch = case.batch([2, 2], seed=3)
    batch.kwargs["item"] = batch.kwargs["item"].abs() + 0.5
    expected = eager(model, batch.replicated())
    got = cm(**batch.replicated())
    assert torch.isnan(expected).all()
    assert torch.equal(got.isnan(), expected.isnan()), (
        "x * 0.0 and x * -0.0 were merged into one node (cleanup CSE keys 0.0 == -0.0)"
    )


def test_dropin_with_nan_request_features_is_exact():
    model = USER_ITEM_MLP.build()
    cm = USER_ITEM_MLP.compile(model)
    batch = USER_ITEM_MLP.batch([2, 3, 2], seed=9)
    batch.kwargs["user"][1, 2] = float("nan")
    batch.kwargs["user"][2, 0] = -0.0
    check_both_conventions(cm, model, batch, "NaN and -0.0 in request features")


# ------------------------------------------------------------------------------------------
# Drop-in request detection


def _groups(*leaves, rows=None):
    rows = leaves[0].shape[0] if rows is None else rows
    starts, index = group_requests(list(leaves), rows)
    return starts.tolist(), index.tolist()


def test_grouping_contiguous_requests():
    x = torch.tensor([[1.0, 2.0], [1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [5.0, 6.0], [5.0, 6.0]])
    assert _groups(x) == ([0, 2, 3], [0, 0, 1, 2, 2, 2])


def test_grouping_matches_request_index():
    """Recovers the grouping a serving batch was built from (unshuffled)."""
    counts = [3, 1, 4, 2]
    index = request_index(counts)
    users = torch.randn(len(counts), 5)[index]
    ids = torch.arange(len(counts))[index]
    starts, got = _groups(users, ids)
    assert got == index.tolist()
    assert starts == [0, 3, 4, 8]


def test_grouping_non_contiguous_repeats_form_new_requests():
    x = torch.tensor([7, 7, 8, 7, 7, 8])
    assert _groups(x) == ([0, 2, 3, 5], [0, 0, 1, 2, 2, 3])


def test_grouping_nan_rows_with_the_same_bits_are_one_request():
    x = torch.tensor([[float("nan"), 1.0], [float("nan"), 1.0], [0.0, 1.0]])
    assert _groups(x) == ([0, 2], [0, 0, 1])


def test_grouping_negative_zero_is_a_different_request():
    x = torch.tensor([[0.0], [-0.0], [-0.0], [0.0]])
    assert _groups(x) == ([0, 1, 3], [0, 1, 1, 2])


def test_grouping_any_leaf_change_starts_a_request():
    a = torch.tensor([1, 1, 1, 1])
    b = torch.tensor([[0.5], [0.5], [0.25], [0.25]], dtype=torch.float16)
    c = torch.tensor([[[1.0, 2.0]], [[1.0, 2.0]], [[1.0, 2.0]], [[1.0, 3.0]]], dtype=torch.float64)
    assert _groups(a, b, c) == ([0, 2, 3], [0, 0, 1, 2])


def test_grouping_edge_cases():
    assert _groups(torch.zeros(0, 3), rows=0) == ([], [])
    assert _groups(torch.ones(1, 3)) == ([0], [0])
    assert _groups(torch.zeros(4, 0)) == ([0], [0, 0, 0, 0])
    assert _groups(torch.tensor([True, True, False])) == ([0, 2], [0, 0, 1])
    non_contiguous = torch.tensor([[1.0, 1.0, 2.0], [9.0, 9.0, 2.0]]).t()  # rows: (1,9) (1,9) (2,2)
    assert _groups(non_contiguous) == ([0, 2], [0, 0, 1])


def test_rows_consistent():
    index = torch.tensor([0, 0, 1])
    shared = torch.tensor([[1.0, float("nan")], [0.0, 2.0]])
    assert rows_consistent(shared[index], shared, index)
    replicated = shared[index].clone()
    replicated[2, 0] = -0.0
    assert not rows_consistent(replicated, shared, index)


def test_request_detection_gives_request_sizes():
    from rocs_compiler.runtime.rows.request_detection import detect_requests

    users = torch.tensor([[1.0, 2.0], [1.0, 2.0], [3.0, 4.0], [3.0, 4.0], [3.0, 4.0]])
    flags = torch.tensor([True, True, True, True, False])  # bool and float leaves compared at once
    found = detect_requests([users, flags], 5)
    assert found.counts == [2, 2, 1]
    assert found.starts.tolist() == [0, 2, 4]
    assert found.index.tolist() == [0, 0, 1, 1, 2]
    one = detect_requests([users[:2]], 2)
    assert one.counts == [2] and one.starts.tolist() == [0] and one.index.tolist() == [0, 0]
    equal = detect_requests([users[:4], flags[:4]], 4)  # two requests of two rows
    assert equal.counts == [2, 2] and equal.starts.tolist() == [0, 2]
    assert equal.index.tolist() == [0, 0, 1, 1]


_LEAF_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
                torch.int8, torch.bool, torch.complex64]


@settings(max_examples=60, deadline=None)
@example(counts=[2, 1, 3], dtypes=[torch.float32], width=0, transpose=True, seed=0)
@given(
    counts=st.lists(st.integers(1, 4), min_size=1, max_size=8),
    dtypes=st.lists(st.sampled_from(_LEAF_DTYPES), min_size=1, max_size=3),
    width=st.integers(0, 3),
    transpose=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_numpy_and_torch_scans_find_the_same_requests(counts, dtypes, width, transpose, seed):
    """Small CPU batches are scanned through numpy, the rest with torch ops: both find the
    requests a batch was built from (bitwise, so NaN, -0.0, bf16, complex, bool, views)."""
    from rocs_compiler.runtime.rows import request_detection as rd

    g = torch.Generator().manual_seed(seed)
    index = request_index(counts)
    leaves = []
    for dtype in dtypes:
        values = (torch.randint(0, 2, (len(counts), width + 1), generator=g) * 2.0 - 1.0) * 0.0
        values = values + torch.randint(0, 3, values.shape, generator=g)  # few values: collisions
        leaf = values.to(dtype)[index]
        if transpose:  # column-major, as ``from_numpy`` of a Fortran array (a [N, 1] one too)
            leaf = leaf.t().clone(memory_format=torch.contiguous_format).t()
        leaves.append(leaf)
    conj = (torch.randint(0, 2, (len(counts), 1), generator=g) * (1 + 1j)).to(torch.complex64)
    leaves.append(conj[index].conj())  # a lazy conjugate, which numpy cannot read directly
    assert leaves[-1].is_conj()
    rows, dense = len(index), torch.contiguous_format
    as_bytes = [
        x.resolve_conj().clone(memory_format=dense).view(torch.uint8).reshape(rows, -1)
        for x in leaves
    ]
    expected = [0] + [
        r for r in range(1, rows) if any(not torch.equal(b[r], b[r - 1]) for b in as_bytes)
    ]
    assert [0] + rd._change_rows_numpy(leaves, rows) == expected
    assert [0] + rd._change_rows_torch(leaves, rows) == expected
    found = rd.detect_requests(leaves, rows)
    assert found.starts.tolist() == expected
    assert found.counts == [b - a for a, b in zip(expected, expected[1:] + [rows])]


@pytest.mark.parametrize("width", [1, 3])
def test_column_major_leaves_are_scanned_above_the_numpy_rows(width):
    """A ``[N, 1]`` column-major leaf (strides ``(1, N)``) counts as contiguous, so the torch scan
    (batches above ``NUMPY_ROWS``) viewed it as bytes with a last stride of N and crashed."""
    from rocs_compiler.runtime.rows import request_detection as rd

    counts = [300, 1, 350]
    index = request_index(counts)
    values = torch.arange(3.0 * (width + 1)).reshape(3, width + 1)[index].numpy()
    leaf = torch.from_numpy(np.asfortranarray(values))[:, :width]  # a column piece of a packed X
    assert leaf.stride() == (1, len(index)) and len(index) > rd.NUMPY_ROWS
    found = rd.detect_requests([leaf], len(index))
    assert found.counts == counts
    assert rows_consistent(leaf, leaf[found.starts], found.index)


class _UserColumn(nn.Module):
    def __init__(self):
        super().__init__()
        self.user = nn.Linear(1, 8)
        self.mlp = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, u, c):
        return self.mlp(torch.cat([torch.tanh(self.user(u)), c], -1)).squeeze(-1)


def test_a_column_major_one_column_input_runs_drop_in_above_the_numpy_rows():
    torch.manual_seed(0)
    model = _UserColumn().eval()
    index = request_index([2, 1])
    example = {"u": torch.randn(2, 1)[index], "c": torch.randn(3, 8)}
    cm = rocs.compile(model, ["u"], example_kwargs=example)
    counts = [300, 1, 350]
    index = request_index(counts)
    packed = np.asfortranarray(torch.randn(3, 2)[index].numpy())
    u = torch.from_numpy(packed)[:, :1]
    c = torch.randn(len(index), 8)
    assert u.stride() == (1, len(index))
    with torch.no_grad():
        expected = model(u, c)
        for _ in range(13):  # past the program choice's trials
            torch.testing.assert_close(cm(u, c), expected, rtol=1e-5, atol=1e-6)


def test_uniform_groupings_are_ordinary_tensors_made_once():
    """The cached grouping of equal-sized requests serves inference-mode and autograd calls."""
    from rocs_compiler.runtime.rows.request_detection import detect_requests

    users = torch.arange(3.0).repeat_interleave(5).unsqueeze(1)
    with torch.inference_mode():
        first = detect_requests([users], 15)
    again = detect_requests([users.clone()], 15)
    assert first.index is again.index and not first.index.is_inference()
    assert first.index.tolist() == request_index([5, 5, 5]).tolist() and first.counts == [5, 5, 5]
    weight = torch.ones(3, 2, requires_grad=True)
    weight.index_select(0, again.index).sum().backward()  # index saved for backward
    assert weight.grad.tolist() == [[5.0, 5.0]] * 3


def test_a_uniform_grouping_hint_gives_the_grouping_of_the_values():
    from rocs_compiler.kernels import request_groups

    index = torch.arange(3).repeat_interleave(4)
    with request_groups.call_groups(index, uniform=3):
        (hinted,) = request_groups.group_by_request(index, 3)
    (computed,) = request_groups._group_by_request(index.clone(), 3)
    assert hinted.count == computed.count == 4 and hinted.contiguous and computed.contiguous
    assert torch.equal(hinted.candidates, computed.candidates)
    assert torch.equal(hinted.requests, computed.requests)


class _NothingPerRequest(nn.Module):
    """Request features meet candidate features in the first op: no op runs per request."""

    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, u, c):
        return self.mlp(u * c).squeeze(-1)


def test_dropin_without_request_work_skips_request_detection(monkeypatch):
    from rocs_compiler.runtime.call import grouping

    model = _NothingPerRequest().eval()
    u, c = torch.randn(3, 4), torch.randn(7, 4)
    index = torch.tensor([0, 0, 1, 1, 1, 2, 2])
    cm = rocs.compile(model, ["u"], example_kwargs={"u": u[index], "c": c})

    def refuse(*args):
        raise AssertionError("request detection ran")

    monkeypatch.setattr(grouping, "detect_requests", refuse)
    with torch.no_grad():
        expected = model(u[index], c)
        torch.testing.assert_close(cm(u=u[index], c=c), expected, rtol=0, atol=0)
        torch.testing.assert_close(cm(u=u, c=c, candidate_to_request=index), expected, rtol=0, atol=0)
