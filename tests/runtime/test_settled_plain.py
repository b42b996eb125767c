"""A shared-layout call of a bucket settled on the plain program (an inference call) or on the
original model (a training call) runs in one pass (``runtime/call/settled_plain.py``): the same answer
and gradients as the general path, the same errors, and every call it does not recognize left to
the general path."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import rocs_compiler as rocs
from models_for_tests import NothingShared
from rocs_compiler.errors import InputError
from rocs_compiler.kernels.index_contract import IndexRangeError, IndexTypeError
from rocs_compiler.runtime.call import path
from rocs_compiler.runtime.call import settled_plain
from rocs_compiler.runtime.choice.program_choice import PLAIN, SHARED, bucket


def _compiled():
    torch.manual_seed(0)
    model = NothingShared().eval()
    index = torch.tensor([0, 0, 0, 1, 1])
    example = {"user": torch.randn(2, 8)[index], "item": torch.randn(5, 8)}
    return model, rocs.compile(model, ["user"], example_kwargs=example)


def _batch(counts, seed=0):
    g = torch.Generator().manual_seed(seed)
    index = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    return torch.randn(len(counts), 8, generator=g), torch.randn(sum(counts), 8, generator=g), index


def _record_lane(monkeypatch, lane: str) -> list[bool]:
    """Whether each call the lane ``lane`` (a function the call path calls, ``runtime/call/path.py``) saw was taken."""
    calls = []
    real = getattr(path, lane)

    def recording(*args):
        result = real(*args)
        calls.append(result is not settled_plain.NOT_TAKEN)
        return result

    monkeypatch.setattr(path, lane, recording)
    return calls


@pytest.fixture
def taken(monkeypatch):
    """The calls the settled lane of inference calls took, recorded."""
    return _record_lane(monkeypatch, "run_settled_plain")


def _settle(cm, counts, program):
    rows, requests = sum(counts), len(counts)
    cm._choice.settle(bucket("shared", rows, requests), program)


@pytest.mark.parametrize("counts", [[5, 1, 3], [1], [4, 4], [2, 7, 1, 1]])
def test_a_settled_plain_bucket_returns_the_original_models_answer(taken, counts):
    model, cm = _compiled()
    _settle(cm, counts, PLAIN)
    user, item, index = _batch(counts, seed=len(counts))
    with torch.no_grad():
        want = model(user=user[index], item=item)
        got = cm(user=user, item=item, candidate_to_request=index)
        positional = cm(user, item, candidate_to_request=index)
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # the model's own ops, row by row
    torch.testing.assert_close(positional, want, rtol=0, atol=0)
    assert taken == [True, True]


def test_a_bucket_settled_shared_or_still_measuring_is_not_taken(taken):
    model, cm = _compiled()
    user, item, index = _batch([3, 2])
    _settle(cm, [3, 2], SHARED)
    user2, item2, index2 = _batch([9, 9, 9], seed=1)  # an undecided bucket
    with torch.no_grad():
        torch.testing.assert_close(
            cm(user=user, item=item, candidate_to_request=index), model(user=user[index], item=item)
        )
        torch.testing.assert_close(
            cm(user=user2, item=item2, candidate_to_request=index2),
            model(user=user2[index2], item=item2),
        )
    assert taken == [False, False]


def test_grad_mode_calls_are_not_taken(taken):
    model, cm = _compiled()
    _settle(cm, [3, 2], PLAIN)
    user, item, index = _batch([3, 2])
    got = cm(user=user, item=item, candidate_to_request=index)
    torch.testing.assert_close(got, model(user=user[index], item=item).detach())
    assert taken == []  # grad mode runs no program choice: the lane is not even consulted


def test_one_row_per_candidate_is_left_to_the_general_path_which_refuses_a_grouping(taken):
    _, cm = _compiled()
    _settle(cm, [1, 1, 1], PLAIN)
    with torch.no_grad(), pytest.raises(InputError, match="one per candidate"):
        cm(user=torch.randn(3, 8), item=torch.randn(3, 8), candidate_to_request=torch.tensor([0, 0, 1]))
    assert taken == [False]


def _broken(case):
    user, item, index = _batch([3, 2])
    if case == "out_of_range":
        index = index.clone()
        index[-1] = 2
    elif case == "negative":
        index = index.clone()
        index[0] = -1
    elif case == "int32_index":
        index = index.int()
    elif case == "short_index":
        index = index[:-1]
    elif case == "float64_item":
        item = item.double()
    elif case == "wide_item":
        item = torch.randn(5, 9)
    elif case == "vector_user":
        user = user[0]
    return {"user": user, "item": item, "candidate_to_request": index}


# -- training calls whose bucket chose the original model (``run_settled_original``) -------------


def _training_compiled():
    torch.manual_seed(0)
    model = NothingShared().train()
    index = torch.tensor([0, 0, 0, 1, 1])
    example = {"user": torch.randn(2, 8)[index], "item": torch.randn(5, 8)}
    return model, rocs.compile(model, ["user"], example_kwargs=example, training=True)


def _settle_training(cm, counts, program):
    cm._training.choice.settle(bucket("train-shared", sum(counts), len(counts)), program)


@pytest.fixture
def taken_training(monkeypatch):
    """The calls the settled lane of training calls took, recorded."""
    return _record_lane(monkeypatch, "run_settled_original")


def _grads(model, user, loss):
    model.zero_grad(set_to_none=True)
    user.grad = None
    loss().backward()
    return [p.grad.clone() for p in model.parameters()], user.grad.clone()


@pytest.mark.parametrize("counts", [[5, 1, 3], [1], [4, 4], [2, 7, 1, 1]])
def test_a_training_bucket_settled_on_the_original_gives_eagers_gradients(taken_training, counts):
    model, cm = _training_compiled()
    _settle_training(cm, counts, PLAIN)
    user, item, index = _batch(counts, seed=len(counts))
    user.requires_grad_(True)  # a request row's gradient is the sum over its candidates
    want = _grads(model, user, lambda: (model(user=user[index], item=item) ** 2).sum())
    got = _grads(model, user, lambda: (cm(user=user, item=item, candidate_to_request=index) ** 2).sum())
    torch.testing.assert_close(got, want)  # the request rows' sums may add in another order
    assert taken_training == [True]


def test_a_training_bucket_settled_on_the_program_is_not_taken(taken_training):
    model, cm = _training_compiled()
    _settle_training(cm, [3, 2], SHARED)
    user, item, index = _batch([3, 2])
    want = _grads(model, user.requires_grad_(True), lambda: model(user=user[index], item=item).sum())
    got = _grads(model, user, lambda: cm(user=user, item=item, candidate_to_request=index).sum())
    torch.testing.assert_close(got, want)
    assert taken_training == [False]


BROKEN_CALLS = [
    ("out_of_range", IndexRangeError),
    ("negative", IndexRangeError),
    ("int32_index", IndexTypeError),
    ("short_index", InputError),
    ("float64_item", InputError),
    ("wide_item", InputError),
    ("vector_user", InputError),
]


@pytest.mark.parametrize("lane", ["run_settled_plain", "run_settled_original"])
@pytest.mark.parametrize("case, error", BROKEN_CALLS)
def test_a_settled_bucket_raises_what_the_general_path_raises(monkeypatch, lane, case, error):
    """Inference calls (no grad) in a bucket settled on the plain program, training calls in one
    that chose the original model: the lane's errors are the general path's, word for word."""
    training = lane == "run_settled_original"
    _, cm = _training_compiled() if training else _compiled()
    (_settle_training if training else _settle)(cm, [3, 2], PLAIN)
    grad = torch.enable_grad() if training else torch.no_grad()
    with grad, pytest.raises(error) as settled:
        cm(**_broken(case))
    monkeypatch.setattr(path, lane, lambda *a: settled_plain.NOT_TAKEN)
    with grad, pytest.raises(error) as general:
        cm(**_broken(case))
    assert str(settled.value) == str(general.value)


def test_every_candidate_its_own_request_is_taken_in_either_lane(taken, taken_training):
    """One request row per candidate with a permutation for the index (every impression its own
    request, shuffled) is a shared-layout call like any other: both lanes take it."""
    index = torch.tensor([2, 0, 3, 1])
    user, item = torch.randn(4, 8), torch.randn(4, 8)
    model, cm = _compiled()
    _settle(cm, [1, 1, 1, 1], PLAIN)
    with torch.no_grad():
        got = cm(user=user, item=item, candidate_to_request=index)
    torch.testing.assert_close(got, model(user=user[index], item=item), rtol=0, atol=0)
    model, cm = _training_compiled()
    _settle_training(cm, [1, 1, 1, 1], PLAIN)
    user.requires_grad_(True)
    want = _grads(model, user, lambda: model(user=user[index], item=item).sum())
    got = _grads(model, user, lambda: cm(user=user, item=item, candidate_to_request=index).sum())
    torch.testing.assert_close(got, want)
    assert taken == [True] and taken_training == [True]
