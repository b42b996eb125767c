"""``candidate_to_request`` is checked by one function: one message and one exception type per
failure, the same whether the runtime or an op called on its own finds it."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import rocs_compiler as rocs
from rocs_compiler.kernels.index_contract import IndexRangeError, IndexTypeError
from rocs_compiler.runtime.choice.program_choice import TRIALS

BAD = [
    ([0, 1, 3], IndexError, r"values must lie in \[0, 2\).*\[0, 3\]"),
    ([0, -1, 1], IndexError, r"values must lie in \[0, 2\).*\[-1, 1\]"),
    (torch.tensor([0, 1, 1], dtype=torch.int32), TypeError, "dtype torch.int64, got torch.int32"),
    ([0, 1], ValueError, "has 2 entries but the candidate inputs have 3 rows"),
    (torch.zeros(3, 1, dtype=torch.int64), ValueError, r"1-D \[N\]"),
    ([0.0, 1.0, 1.0], TypeError, "dtype torch.int64"),
]


def _index(value):
    return value if isinstance(value, torch.Tensor) else torch.tensor(value)


class UserItem(nn.Module):
    def __init__(self):
        super().__init__()
        self.user = nn.Linear(4, 3)
        self.item = nn.Linear(4, 3)

    def forward(self, u, c):
        return (self.user(u) * self.item(c)).sum(-1)


@pytest.mark.parametrize("value, builtin, message", BAD)
def test_the_runtime_and_the_ops_raise_the_same_error(value, builtin, message):
    u, c = torch.randn(2, 4), torch.randn(3, 4)
    cm = rocs.compile(UserItem().eval(), ["u"], example_kwargs={"u": u[[0, 0, 1]], "c": c})
    index = _index(value)
    with pytest.raises(rocs.InputError, match=message) as from_runtime:
        cm(u=u, c=c, candidate_to_request=index)
    assert isinstance(from_runtime.value, builtin)
    with pytest.raises(builtin, match=message) as from_op:
        torch.ops.rocs.broadcast_linear(c, torch.randn(2, 4), None, torch.randn(2, 2), index)
    assert type(from_op.value) is type(from_runtime.value)
    assert "rocs::broadcast_linear" in str(from_op.value)


def test_error_types_are_both_input_errors_and_builtins():
    assert issubclass(IndexTypeError, rocs.InputError) and issubclass(IndexTypeError, TypeError)
    assert issubclass(IndexRangeError, rocs.InputError) and issubclass(IndexRangeError, IndexError)


def test_a_non_tensor_index_names_its_type():
    u, c = torch.randn(2, 4), torch.randn(3, 4)
    cm = rocs.compile(UserItem().eval(), ["u"], example_kwargs={"u": u[[0, 0, 1]], "c": c})
    with pytest.raises(TypeError, match="must be a torch.Tensor.*got list"):
        cm(u=u, c=c, candidate_to_request=[0, 0, 1])


def _user_item_call(num_candidates: int):
    u, c = torch.randn(2, 4), torch.randn(num_candidates, 4)
    model = UserItem().eval()
    cm = rocs.compile(model, ["u"], example_kwargs={"u": u[[0, 0, 1]], "c": c[:3]})
    return model, cm, u, c


@pytest.mark.parametrize("num_candidates", [3, 200])  # checked in Python, and by a reduction
def test_the_range_check_reads_every_value(num_candidates):
    _, cm, u, c = _user_item_call(num_candidates)
    for bad in (2, -1):
        index = torch.zeros(num_candidates, dtype=torch.int64)
        index[num_candidates // 2] = bad
        with torch.no_grad(), pytest.raises(IndexRangeError, match=r"values must lie in \[0, 2\)"):
            cm(u=u, c=c, candidate_to_request=index)


def test_trusted_index_nests_decorates_and_ends_with_its_block():
    from rocs_compiler.kernels.index_contract import index_trusted

    @rocs.trusted_index()
    def depth(n: int) -> int:
        assert index_trusted()
        return depth(n - 1) + 1 if n else 0

    assert not index_trusted()
    with rocs.trusted_index():
        with rocs.trusted_index():
            assert index_trusted()
        assert index_trusted()  # the inner block restores the outer one's setting
    assert not index_trusted()
    assert depth(3) == 3 and not index_trusted()
    with pytest.raises(ValueError), rocs.trusted_index():
        raise ValueError
    assert not index_trusted()
    seen = []
    with rocs.trusted_index():
        worker = threading.Thread(target=lambda: seen.append(index_trusted()))
        worker.start()
        worker.join(timeout=10)
    assert seen == [False]  # per thread


def test_a_trusted_index_skips_the_value_checks_only(monkeypatch):
    model, cm, u, c = _user_item_call(3)
    index = torch.tensor([0, 1, 1])
    with torch.no_grad():
        expected = model(u=u[index], c=c)
        from rocs_compiler.kernels import index_contract

        def refuse(*args, **kwargs):
            raise AssertionError("the range check ran inside trusted_index()")

        monkeypatch.setattr(index_contract, "index_bounds", refuse)  # what every range check reads
        with rocs.trusted_index():
            torch.testing.assert_close(cm(u=u, c=c, candidate_to_request=index), expected)
            with pytest.raises(IndexTypeError):  # type, shape and device are still checked
                cm(u=u, c=c, candidate_to_request=index.int())
            with pytest.raises(rocs.InputError, match="has 2 entries"):
                cm(u=u, c=c, candidate_to_request=index[:2])
        monkeypatch.undo()
        bad = torch.tensor([0, 1, 3])
        for _ in range(2 * TRIALS + 1):  # outside it, in both programs (autotune's trials)
            cm(u=u, c=c, candidate_to_request=index)
            with pytest.raises(IndexRangeError, match=r"\[0, 2\)"):
                cm(u=u, c=c, candidate_to_request=bad)
