"""A compiled model moved to another floating dtype keeps the contract of one compiled there.

``cm.to(torch.bfloat16)`` on a float32-compiled model ran the float32 graph's split partials in
bfloat16 (three roundings; 69 of 240 elements off, up to 0.0078, where compiling the bfloat16
model gives none); a bfloat16 graph moved to float32 kept its cast back to bfloat16. A move that
changes a floating dtype now compiles the moved model again (``runtime/follow/dtype_move.py``), still
following and guarding the original. Oracle: the eager original, copied and moved, and the
moved original compiled directly.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from test_numerics import HEADS, LOW, _batch, module, ulp
from torch import nn

import rocs_compiler as rocs

CALLS = 13  # past the program choice's trials, so both programs run


def _fp32_model(name: str) -> nn.Module:
    torch.manual_seed(0)
    forward, children = HEADS[name]
    return module(forward, **children())


def _compile(model: nn.Module, dtype: torch.dtype, **options):
    u, c, index = _batch(dtype)
    example = {"u": u[index[:4]], "c": c[:4]}
    return rocs.compile(model, ["u"], example_kwargs=example, options=options)


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("name", sorted(HEADS))
def test_a_float32_model_moved_to_low_precision_is_the_model_compiled_there(name, dtype):
    model = _fp32_model(name)
    moved = _compile(model, torch.float32, autotune=False).to(dtype)
    eager = copy.deepcopy(model).to(dtype)
    direct = _compile(eager, dtype, autotune=False)
    u, c, index = _batch(dtype)
    with torch.no_grad():
        want = eager(u[index], c)
        got = moved(u=u, c=c, candidate_to_request=index)
        assert torch.equal(got, direct(u=u, c=c, candidate_to_request=index))  # one program
    # The float16/bfloat16 contract: within one ulp of eager, equal almost everywhere.
    assert got.dtype == dtype
    assert bool(((got.float() - want.float()).abs() <= ulp(want)).all())
    assert (got != want).float().mean().item() <= 0.01


def test_a_moved_model_in_every_layout_past_the_program_choice():
    model = _fp32_model("split_linear")
    cm = _compile(model, torch.float32).to(torch.bfloat16)
    eager = copy.deepcopy(model).to(torch.bfloat16)
    u, c, index = _batch(torch.bfloat16)
    with torch.no_grad():
        want = eager(u[index], c)
        for _ in range(CALLS):
            for got in (
                cm(u=u, c=c, candidate_to_request=index),
                cm(u=u[index], c=c),
                cm.call_replicated(u=u[index], c=c, candidate_to_request=index),
            ):
                assert bool(((got.float() - want.float()).abs() <= ulp(want)).all())
                assert (got != want).float().mean().item() <= 0.01


def test_a_low_precision_model_moved_to_float32_computes_in_float32():
    model = _fp32_model("split_linear").to(torch.bfloat16)
    cm = _compile(model, torch.bfloat16).float()
    eager = copy.deepcopy(model).float()
    u, c, index = _batch(torch.float32)
    with torch.no_grad():
        want = eager(u[index], c)
        got = cm(u=u, c=c, candidate_to_request=index)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want)


def test_a_moved_model_follows_and_guards_the_original():
    """The original keeps its dtype; the moved model computes with cast copies of its current
    weights and refuses a change of what its graph depends on, as before the move."""
    model = _fp32_model("split_linear")
    cm = _compile(model, torch.float32).to(torch.bfloat16)
    u, c, index = _batch(torch.bfloat16)
    assert model.h.weight.dtype == torch.float32
    with torch.no_grad():
        model.h.weight.mul_(2)
        model.a = nn.Linear(64, 64)
        want = copy.deepcopy(model).to(torch.bfloat16)(u[index], c)
        for _ in range(CALLS):
            got = cm(u=u, c=c, candidate_to_request=index)
            assert bool(((got.float() - want.float()).abs() <= ulp(want)).all())
        model.h = nn.Sequential(nn.Linear(128, 32))
        with pytest.raises(rocs.CompileError, match=r"model\.h was replaced since compile"):
            cm(u=u, c=c, candidate_to_request=index)


def test_a_move_that_keeps_the_dtype_keeps_the_graph():
    cm = _compile(_fp32_model("split_linear"), torch.float32)
    graph = cm.graph_module
    assert cm.to(torch.float32).graph_module is graph
    assert cm.to("cpu").graph_module is graph


class _Locked(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.h = nn.Linear(64, 64), nn.Linear(128, 32)
        self.lock = threading.Lock()  # not deep-copyable

    def forward(self, u, c):
        return self.h(torch.cat([self.a(u), c], -1))


def test_a_model_that_cannot_be_copied_is_refused_with_how_to_move_it():
    torch.manual_seed(0)
    model = _Locked().eval()
    cm = _compile(model, torch.float32)
    with pytest.raises(rocs.CompileError, match=r"rocs\.compile\(model\.to\(torch\.bfloat16\)"):
        cm.to(torch.bfloat16)
    u, c, index = _batch(torch.float32)
    with torch.no_grad():  # still the float32 model, unmoved
        got = cm(u=u, c=c, candidate_to_request=index)
        torch.testing.assert_close(got, model(u[index], c))


def test_type_keeps_integer_inputs_and_moves_floating_ones():
    """``nn.Module.type`` casts every tensor; a compiled model's ``.type(torch.float64)`` after
    ``.to(torch.float64)`` (no floating dtype changes, so no recompile) used to cast its input
    specs too and refuse the int64 ids as "compiled for torch.float64"."""
    from models_for_tests import USER_ITEM_MLP, check_both_conventions

    model = USER_ITEM_MLP.build()
    cm = USER_ITEM_MLP.compile(model).to(torch.float64).type(torch.float64)
    model.double()
    batch = USER_ITEM_MLP.batch([3, 1, 2], seed=5, shuffle=True)
    batch.kwargs = {k: v.double() if v.is_floating_point() else v for k, v in batch.kwargs.items()}
    assert batch.kwargs["user_ids"].dtype == torch.int64
    with torch.no_grad():
        for _ in range(CALLS):  # past the program choice's trials: both programs
            check_both_conventions(cm, model, batch, "float64 after .type")
