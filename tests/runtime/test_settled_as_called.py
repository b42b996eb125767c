"""A column-range model whose bucket settled on the plain program runs the packed input as
called (``formats/packed_plain.py``, ``runtime/settled_plain.run_settled_as_called``): no split
into column pieces and no concatenation back, the original model's answer on ragged batches in
both layouts, the general path's errors, and trials that charge the shared program alone for
reducing the replicated request columns."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import rocs_compiler as rocs
from rocs_compiler.kernels.index_contract import IndexRangeError, IndexTypeError
from rocs_compiler.runtime.call import choosing, contract, path, settled_plain
from rocs_compiler.runtime.choice import program_choice
from rocs_compiler.runtime.choice.program_choice import PLAIN, SHARED, bucket

FIELDS = (10, 5, 20, 30)  # two user fields, two item fields
ATEN = torch.ops.aten


class TorchfmLR(nn.Module):
    """torchfm's logistic regression: the whole packed ``x`` offset into one table."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Embedding(sum(FIELDS), 1)
        self.bias = nn.Parameter(torch.randn(1))
        self.offsets = np.array((0, *np.cumsum(FIELDS)[:-1]), dtype=np.int64)

    def forward(self, x):
        ids = x + x.new_tensor(self.offsets).unsqueeze(0)
        return torch.sigmoid(torch.sum(self.fc(ids), dim=1) + self.bias).squeeze(1)


class WithDense(TorchfmLR):
    """The same beside a dense request input with one row per request in the shared layout."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Linear(3, 1)

    def forward(self, x, u):
        return super().forward(x) * self.scale(u).squeeze(1)


def _draw(counts, seed=0):
    g = torch.Generator().manual_seed(seed)
    index = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    user = torch.stack([torch.randint(0, v, (len(counts),), generator=g) for v in FIELDS[:2]], 1)
    item = torch.stack([torch.randint(0, v, (sum(counts),), generator=g) for v in FIELDS[2:]], 1)
    dense = torch.randn(len(counts), 3, generator=g)
    return torch.cat([user[index], item], 1), index, dense


def _compiled(cls=TorchfmLR):
    torch.manual_seed(0)
    model = cls().eval()
    x, index, dense = _draw([2, 3], seed=1)
    example = {"x": x} if cls is TorchfmLR else {"x": x, "u": dense[index]}
    request = ["x[:, 0:2]"] if cls is TorchfmLR else ["x[:, 0:2]", "u"]
    return model, rocs.compile(model, request, example_kwargs=example)


def _settle(cm, counts, program=PLAIN):
    rows, requests = sum(counts), len(counts)
    cm._choice.settle(bucket("dropin", rows, requests), program)
    cm._choice.settle(bucket("shared", rows, requests), program)


class _Ops(TorchDispatchMode):
    """The ATen ops a call runs, and the tensors they read."""

    def __init__(self):
        super().__init__()
        self.ops, self.read = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        self.read += [a for a in args if isinstance(a, torch.Tensor)]
        return func(*args, **(kwargs or {}))


def test_the_plain_graph_takes_the_packed_input_and_never_concatenates():
    _, cm = _compiled()
    graph = cm._plain.graph_module.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    assert [n.name for n in placeholders] == ["x"] and cm._plain.input_names == ["x"]
    targets = {n.target for n in graph.nodes if n.op == "call_function"}
    assert ATEN.cat.default not in targets and ATEN.slice.Tensor not in targets


@pytest.mark.parametrize("layout", ["dropin", "shared"])
def test_a_settled_plain_bucket_runs_the_packed_input_as_given(layout):
    """No split into column views, no concatenation: the program's first op reads the caller's
    own tensor, and the answer is the original model's."""
    model, cm = _compiled()
    counts = [3, 1, 4]
    _settle(cm, counts)
    x, index, _ = _draw(counts, seed=2)
    call = {"x": x} if layout == "dropin" else {"x": x, "candidate_to_request": index}
    with torch.no_grad():
        want = model(x)
        with _Ops() as seen:
            got = cm(**call)
    assert ATEN.cat.default not in seen.ops
    assert ATEN.slice.Tensor not in seen.ops and ATEN.split_with_sizes.default not in seen.ops
    assert any(t is x for t in seen.read)
    torch.testing.assert_close(got, want)


# The last: 2,400 ids, which the plain program looks up by a 1-D gather (``runtime/program/lowerings.py``).
@pytest.mark.parametrize("counts", [[1], [3], [17], [1, 3, 17], [17, 1, 3, 1], [200, 1, 99, 300]])
def test_every_layout_returns_the_original_models_answer_while_choosing_and_once_settled(counts):
    model, cm = _compiled()
    x, index, _ = _draw(counts, seed=len(counts))
    with torch.no_grad():
        want = model(x)
        for _ in range(2 * program_choice.TRIALS + 2):  # the trials, then the settled bucket
            torch.testing.assert_close(cm(x=x), want)
            torch.testing.assert_close(cm(x), want)  # positional
            torch.testing.assert_close(cm(x=x, candidate_to_request=index), want)
            torch.testing.assert_close(cm.call_replicated(x=x, candidate_to_request=index), want)
        _settle(cm, counts)
        torch.testing.assert_close(cm(x=x), want)
        torch.testing.assert_close(cm(x=x, candidate_to_request=index), want)
        torch.testing.assert_close(cm.call_replicated(x=x, candidate_to_request=index), want)


@pytest.mark.parametrize("counts", [[1], [1, 3, 17]])
def test_request_rows_beside_the_packed_input_are_gathered(counts):
    """A request input with one row per request goes on being gathered to the candidates in a
    plain bucket; the packed input beside it is taken whole."""
    model, cm = _compiled(WithDense)
    assert cm._plain.input_names == ["x", "u"]
    _settle(cm, counts)
    x, index, dense = _draw(counts, seed=5)
    with torch.no_grad():
        want = model(x, dense[index])
        torch.testing.assert_close(cm(x=x, u=dense, candidate_to_request=index), want)
        torch.testing.assert_close(cm(x=x, u=dense[index]), want)


BROKEN = {
    "wide": (lambda x, i: {"x": torch.cat([x, x[:, :1]], 1)}, rocs.InputError),
    "float": (lambda x, i: {"x": x.float()}, rocs.InputError),
    "out_of_range": (lambda x, i: {"x": x, "candidate_to_request": i + 100}, IndexRangeError),
    "negative": (lambda x, i: {"x": x, "candidate_to_request": i - 1}, IndexRangeError),
    "short_index": (lambda x, i: {"x": x, "candidate_to_request": i[:-1]}, rocs.InputError),
    "column_index": (lambda x, i: {"x": x, "candidate_to_request": i[:, None]}, rocs.InputError),
    "int32_index": (lambda x, i: {"x": x, "candidate_to_request": i.int()}, IndexTypeError),
    "list_index": (lambda x, i: {"x": x, "candidate_to_request": i.tolist()}, IndexTypeError),
    "unknown_name": (lambda x, i: {"x": x, "y": x}, rocs.InputError),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_settled_bucket_refuses_what_the_general_path_refuses(monkeypatch, case):
    make, error = BROKEN[case]
    _, cm = _compiled()
    counts = [3, 2]
    _settle(cm, counts)
    x, index, _ = _draw(counts)
    with torch.no_grad(), pytest.raises(error):
        cm(**make(x, index))
    # The same call on the general path (the settled lane off) is refused as well.
    monkeypatch.setattr(
        path, "run_settled_as_called", lambda *a: settled_plain.NOT_TAKEN
    )
    with torch.no_grad(), pytest.raises(error):
        cm(**make(x, index))


def test_a_replaced_submodule_is_still_refused_in_a_settled_bucket():
    _, cm = _compiled()
    _settle(cm, [3, 2])
    x, _, _ = _draw([3, 2])
    cm._original.fc = nn.Linear(1, 1)
    with torch.no_grad(), pytest.raises(rocs.CompileError, match="fc"):
        cm(x=x)


def test_reducing_the_request_columns_counts_toward_the_shared_program(monkeypatch):
    """Only the shared program needs the replicated request columns reduced to one row per
    request: a trial charges that time to it. On a clock where reducing costs 10, the shared
    program 1 and the plain one 2, the bucket chooses the plain program."""
    _, cm = _compiled()
    clock = [0.0]
    monkeypatch.setattr(program_choice, "now", lambda: clock[0])
    monkeypatch.setattr(choosing, "call_clock", lambda on_cpu=True: lambda: clock[0])

    def costing(method, seconds):
        def run(*args, **kwargs):
            clock[0] += seconds
            return method(*args, **kwargs)

        return run

    monkeypatch.setattr(path, "reduce_leaves", costing(path.reduce_leaves, 10.0))
    monkeypatch.setattr(choosing, "run", costing(choosing.run, 1.0))
    monkeypatch.setattr(choosing, "shared_plain", costing(choosing.shared_plain, 2.0))
    counts = [4, 4]
    x, index, _ = _draw(counts)
    with torch.no_grad():
        for _ in range(2 * program_choice.TRIALS):
            cm(x=x, candidate_to_request=index)
    assert cm.program_choices()[bucket("shared", 8, 2)] == PLAIN


@dataclasses.dataclass
class Features:
    user: torch.Tensor
    item: torch.Tensor


class OfBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Linear(4, 1)

    def forward(self, batch):
        return self.mlp(batch.user * batch.item).squeeze(1)


def test_a_batch_object_is_named_without_binding(monkeypatch):
    """A dataclass of tensors is named field by field, as a dict of tensors is: no binding and no
    tree walk per call (its floor, ``benchmarks/call_overhead.py --formats``)."""
    torch.manual_seed(0)
    model = OfBatch().eval()
    index = torch.tensor([0, 0, 1])
    user, item = torch.randn(2, 4), torch.randn(3, 4)
    cm = rocs.compile(model, ["batch.user"], example_kwargs={"batch": Features(user[index], item)})
    _settle(cm, [2, 1])

    def refused(*args, **kwargs):
        raise AssertionError("bound the call")

    monkeypatch.setattr(contract, "bind_inputs", refused)
    with torch.no_grad():
        want = model(Features(user[index], item))
        torch.testing.assert_close(cm(batch=Features(user[index], item)), want)
        torch.testing.assert_close(
            cm(batch=Features(user, item), candidate_to_request=index), want
        )
