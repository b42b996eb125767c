"""A compiled model refuses what ``torch.nn.functional``'s wrappers refuse before their ATen op
(``runtime/program/eager_checks.py``): one value per channel for batch statistics, in inference and in
training, and one spatial element for an instance norm's input statistics; a model that calls the
ATen-level function itself gets eager's answer, unchecked."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

import rocs_compiler as rocs
from models_zoo import Batch, request_index
from rocs_compiler.runtime.program.direct import DirectProgram
from rocs_compiler.runtime.program.eager_checks import eager_check

aten = torch.ops.aten
D = 6


def _batch(counts, seed=0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    index = request_index(counts, shuffle=False, generator=g)
    user = torch.randn(len(counts), D, generator=g)
    item = torch.randn(index.shape[0], D, generator=g)
    return Batch({"user": user, "item": item}, index, ("user",))


class UserNorm(nn.Module):
    """The user's features normalized by the batch's statistics, scored against the item."""

    def __init__(self, functional: bool = True):
        super().__init__()
        self.functional = functional
        self.bn = nn.BatchNorm1d(D)
        self.lin = nn.Linear(D, D)

    def forward(self, user, item):
        if self.functional:
            normed = self.bn(user)
        else:  # the ATen-level function: no check of the batch size, in eager either
            normed = torch.batch_norm(
                user, self.bn.weight, self.bn.bias, None, None, True, 0.1, 1e-5, False
            )
        return (self.lin(normed) * item).sum(-1)


def _compile(model, **kwargs):
    example = _batch([2, 3], seed=1).replicated()
    return rocs.compile(model, ["user"], example_kwargs=example, **kwargs)


def test_a_one_row_training_call_is_refused_as_eager_refuses_it():
    torch.manual_seed(0)
    model = UserNorm().train()
    cm = _compile(model, training=True, options={"autotune": False})  # the training program
    one = _batch([1], seed=2)
    with pytest.raises(ValueError, match="more than 1 value per channel") as eager_error:
        model(**one.replicated())
    with pytest.raises(ValueError, match="more than 1 value per channel") as compiled_error:
        cm(**one.replicated())
    assert str(compiled_error.value) == str(eager_error.value)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        cm(**one.kwargs, candidate_to_request=one.candidate_to_request)
    two = _batch([1, 1], seed=2)
    torch.testing.assert_close(
        cm(**two.kwargs, candidate_to_request=two.candidate_to_request),
        UserNorm.forward(model, **two.replicated()),
    )


def test_a_model_calling_the_aten_level_function_gets_eagers_answer():
    torch.manual_seed(0)
    model = UserNorm(functional=False).eval()
    cm = _compile(model)
    one = _batch([1], seed=2)
    with torch.no_grad():
        want = model(**one.replicated())  # eager answers: torch.batch_norm checks nothing
        torch.testing.assert_close(cm(**one.replicated()), want)
        torch.testing.assert_close(
            cm(**one.kwargs, candidate_to_request=one.candidate_to_request), want
        )


def _instance_norm_graph(torch_fn) -> fx.GraphModule:
    """``instance_norm(x)`` with input statistics, as capture records it."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    args = (x, None, None, None, None, True, 0.1, 1e-5, False)
    node = graph.call_function(aten.instance_norm.default, args)
    if torch_fn is not None:
        node.meta["torch_fn"] = torch_fn
    graph.output(node)
    return fx.GraphModule({}, graph)


def test_an_instance_norm_over_one_spatial_element_is_refused_as_eager_refuses_it():
    gm = _instance_norm_graph(("instance_norm_1", "function.instance_norm"))
    program = DirectProgram(gm)
    x = torch.randn(4, D, 3)
    torch.testing.assert_close(program(x), nn.functional.instance_norm(x))
    single = torch.randn(4, D, 1)
    with pytest.raises(ValueError, match="more than 1 spatial element") as eager_error:
        nn.functional.instance_norm(single)
    with pytest.raises(ValueError, match="more than 1 spatial element") as compiled_error:
        program(single)
    assert str(compiled_error.value) == str(eager_error.value)
    builtin = ("instance_norm", "builtin_function_or_method.instance_norm")
    unchecked = DirectProgram(_instance_norm_graph(builtin))
    assert torch.isfinite(unchecked(single)).all()  # the ATen op answers: no wrapper, no check


def test_only_batch_statistics_are_checked():
    gm = _instance_norm_graph(("instance_norm_1", "function.instance_norm"))
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    assert eager_check(node) is not None
    node.args = node.args[:5] + (False,) + node.args[6:]  # running statistics: nothing to check
    assert eager_check(node) is None
    node.meta.pop("torch_fn")
    node.args = node.args[:5] + (True,) + node.args[6:]
    assert eager_check(node) is None  # not known to come from the wrapper
