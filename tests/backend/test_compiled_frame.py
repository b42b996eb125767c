"""A lowered graph's calls after the first run its compiled entry without dynamo's call machinery,
exactly when one of the entry's guards accepts them (``backend/compiled_frame.py``)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import fx, nn

from dynamo_frames import Scorer, scorer_inputs
from dynamo_frames import fresh_dynamo  # noqa: F401 (the fixture every test uses)
from rocs_compiler.backend.compiled_frame import MISS, CompiledFrame
from rocs_compiler.backend.lowering import Lowered
from rocs_compiler.ir.graph_meta import PLACEMENT
from rocs_compiler.ir.roles import Role

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _counted(lowered: Lowered) -> list:
    """Count the calls that go through ``torch.compile``'s own call."""
    calls = []
    for strategy, compiled in list(lowered._compiled.items()):
        lowered._compiled[strategy] = (
            lambda compiled: lambda *args: calls.append(1) or compiled(*args)
        )(compiled)
    return calls


def test_calls_after_the_first_run_the_compiled_entry_and_stay_exact():
    gm = fx.symbolic_trace(Scorer())
    lowered = Lowered(gm, use_inductor=True)
    calls = _counted(lowered)
    scores = []
    with torch.no_grad():
        for rows, candidates in [(3, 17), (4, 40), (2, 9), (5, 3)]:
            x, index = scorer_inputs(rows, candidates, seed=rows)
            (got,), (want,) = lowered(x, index), gm(x, index)
            torch.testing.assert_close(got, want)
            scores.append(want)
    assert torch.cat(scores).std() > 100 * 1e-5  # scores differ far more than the tolerance
    assert calls == [1]  # only the first call went through torch.compile
    assert lowered._frame._entries


def test_a_call_no_guard_accepts_goes_through_dynamo_which_compiles_it():
    gm = fx.symbolic_trace(Scorer())
    lowered = Lowered(gm, use_inductor=True)
    calls = _counted(lowered)
    with torch.no_grad():
        lowered(*scorer_inputs(3, 7))
        x, index = scorer_inputs(3, 7, dtype=torch.float64)
        gm.double()  # the guards pin the dtype: a float64 call is not the float32 entry's
        torch.testing.assert_close(lowered(x, index)[0], gm(x, index)[0])
        assert len(calls) == 2 and len(lowered._frame._entries) == 2
        lowered(x, index)  # the float64 entry, compiled by the call before, now accepts it
    assert len(calls) == 2
    with torch.enable_grad():  # grad mode is among the guards
        x.requires_grad_(True)
        out = lowered(x, index)[0]
    assert len(calls) == 3 and out.requires_grad


def _compiled_once():
    """A lowered graph compiled by one call, its later ``torch.compile`` calls counted."""
    gm = fx.symbolic_trace(Scorer())
    lowered = Lowered(gm, use_inductor=True)
    calls = _counted(lowered)
    x, index = scorer_inputs(3, 7)
    with torch.no_grad():
        lowered(x, index)
    return gm, lowered, calls, x, index


def test_a_stance_other_than_the_default_is_dynamos_to_apply():
    gm, lowered, calls, x, index = _compiled_once()
    with torch.no_grad():
        with torch.compiler.set_stance("force_eager"):
            torch.testing.assert_close(lowered(x, index)[0], gm(x, index)[0])
    assert len(calls) == 2


class _Broken(nn.Module):
    def forward(self, x):
        y = x.sin()
        torch._dynamo.graph_break()
        return y.cos()


def test_an_entry_that_resumes_after_a_graph_break_is_left_to_dynamo():
    module = _Broken()
    compiled = torch.compile(module, backend="eager")
    x = torch.randn(4)
    torch.testing.assert_close(compiled(x), x.sin().cos())
    frame = CompiledFrame(module)
    frame.refresh()
    assert frame((x,)) is MISS


def test_a_copied_lowered_graph_stays_exact_without_the_original_frame():
    gm = fx.symbolic_trace(Scorer())
    lowered = Lowered(gm, use_inductor=True)
    x, index = scorer_inputs(3, 7)
    with torch.no_grad():
        lowered(x, index)
        copied = copy.deepcopy(lowered)
        assert copied._frame is None  # the copy's forward is code of its own
        for _ in range(2):
            torch.testing.assert_close(copied(x, index)[0], gm(x, index)[0])
        assert copied._frame is not lowered._frame and lowered._frame._entries


def test_a_module_whose_forward_is_no_method_is_left_to_dynamo():
    module = nn.Module()
    module.forward = lambda x: x.sin()  # an attribute, not a method of the class
    frame = CompiledFrame(module)
    frame.refresh()
    assert frame((torch.randn(3),)) is MISS


class _Named(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(module, x, scale=2.0):  # noqa: N805  (``self`` by another name)
        return module.linear(x) * scale


def test_arguments_by_name_with_defaults_and_self_by_another_name_run_the_entry():
    module = _Named()
    compiled = torch.compile(module, backend="eager", dynamic=True)
    x = torch.randn(5, 4)
    with torch.no_grad():
        compiled(x)
        frame = CompiledFrame(module)
        frame.refresh()
        torch.testing.assert_close(frame.call((), {"x": x}), module(x))
        torch.testing.assert_close(frame.call((x,), {}), module(x))
        assert frame.call((x,), {"x": x}) is MISS  # given twice: Python's call raises
        assert frame.call((), {"x": x, "y": x}) is MISS  # a name forward does not take
        assert frame.call((), {}) is MISS  # a parameter without a value


def test_the_frame_keeps_every_guard_but_those_on_its_own_module_and_torchs_functions():
    from rocs_compiler.backend import lowering

    kept_and_dropped = []
    real = lowering._guard_filter

    def recording(entries):
        keep = real(entries)
        kept_and_dropped.extend(zip(entries, keep))
        return keep

    gm = fx.symbolic_trace(Scorer())
    lowering._guard_filter = recording
    try:
        lowered = Lowered(gm, use_inductor=True)
        x, index = scorer_inputs(3, 7)
        with torch.no_grad():
            lowered(x, index)
    finally:
        lowering._guard_filter = real
    kept = {(e.guard_type, e.name) for e, keep in kept_and_dropped if keep}
    dropped = [e for e, keep in kept_and_dropped if not keep]
    kinds = {kind for kind, _ in kept}
    assert {"GLOBAL_STATE", "GRAD_MODE", "SHAPE_ENV"} <= kinds
    assert ("TENSOR_MATCH", "x") in kept and ("TENSOR_MATCH", "index") in kept
    assert any(e.guard_type == "TENSOR_MATCH" and e.name.startswith("self.") for e in dropped)
    assert any(e.guard_type == "BUILTIN_MATCH" and e.name.startswith("G['torch']") for e in dropped)
    assert all(e.name.split(".")[0] == "self" or e.name.startswith("G[") for e in dropped)
    assert all("hooks" not in e.name for e in dropped if e.name.startswith("G["))
    # What is kept still guards: another dtype of an input is not the compiled entry's.
    with torch.no_grad():
        x64 = x.double()
        gm.double()
        torch.testing.assert_close(lowered(x64, index)[0], gm(x64, index)[0])
    assert len(lowered._frame._entries) == 2


def test_dynamos_disable_option_is_followed_as_dynamo_follows_it():
    gm, lowered, calls, x, index = _compiled_once()
    with torch.no_grad():
        with torch._dynamo.config.patch(disable=True):
            # An entry compiled before runs (dynamo's own call runs it too) ...
            torch.testing.assert_close(lowered(x, index)[0], gm(x, index)[0])
            assert len(calls) == 1
            # ... and a call no entry accepts runs uncompiled: nothing new is compiled.
            x64 = x.double()
            gm.double()
            torch.testing.assert_close(lowered(x64, index)[0], gm(x64, index)[0])
    assert len(calls) == 2 and len(lowered._frame._entries) == 1


class _NormedScorer(nn.Module):
    """A batch norm in eval mode over candidate rows: its check of the rows' count cannot be
    answered for an unbacked size, where dynamo would break the graph in two."""

    def __init__(self):
        super().__init__()
        self.hidden, self.norm, self.head = nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Linear(16, 1)

    def forward(self, x, index):
        return (self.head(self.norm(self.hidden(x.index_select(0, index)))),)


def test_a_graph_that_breaks_with_unbacked_candidates_keeps_its_requests_unbacked():
    torch.manual_seed(0)
    model = _NormedScorer().eval()
    with torch.no_grad():
        model.norm.running_mean.uniform_(-1, 1)
        model.norm.running_var.uniform_(0.5, 2)
    gm = fx.symbolic_trace(model)
    x_node, index_node = [n for n in gm.graph.nodes if n.op == "placeholder"]
    x_node.meta[PLACEMENT], index_node.meta[PLACEMENT] = Role.REQUEST, Role.CANDIDATE
    lowered = Lowered(gm, use_inductor=True)
    calls = _counted(lowered)
    scores = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a fall back to the FX graph would warn
        with torch.no_grad():
            for rows, candidates in [(3, 17), (4, 40), (2, 9), (1, 6)]:
                x, index = scorer_inputs(rows, candidates, seed=rows)
                (got,), (want,) = lowered(x, index), gm(x, index)
                torch.testing.assert_close(got, want)
                scores.append(want)
    assert torch.cat(scores).std() > 100 * 1e-5
    assert lowered._strategies[0] == "unbacked requests"
    assert lowered._errors[0].startswith("unbacked:")  # the whole batch unbacked broke the graph
    assert len(calls) == 2  # that refusal, then one compile for every R, one request included
    assert len(lowered._frame._entries) == 1  # one whole graph, run without dynamo's call
