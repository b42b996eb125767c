"""A compiled entry's code, run with no eval-frame hook installed, calls dynamo's helpers and the
compiled graph past their disable wrappers; with a hook installed it runs as dynamo wrote it
(``backend/direct_code.py``)."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

import rocs_compiler as rocs
from dynamo_frames import Scorer, scorer_inputs
from dynamo_frames import fresh_dynamo  # noqa: F401 (the fixture every test uses)
from rocs_compiler.backend import direct_code
from rocs_compiler.backend.lowering import Lowered
from models_zoo import request_index

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.fixture
def hook_swaps(monkeypatch):
    """The eval-frame hook swaps dynamo's disable wrappers make."""
    from torch._dynamo import eval_frame

    swaps = []
    real = eval_frame.set_eval_frame
    monkeypatch.setattr(eval_frame, "set_eval_frame", lambda cb: swaps.append(cb) or real(cb))
    return swaps


def _lowered_after_first_call():
    gm = fx.symbolic_trace(Scorer())
    lowered = Lowered(gm, use_inductor=True)
    with torch.no_grad():
        lowered(*scorer_inputs(3, 17, seed=0))
    (entry,) = lowered._frame._entries
    return gm, lowered, entry


def test_the_direct_code_reads_the_unwrapped_graph_and_helpers_and_stays_exact(hook_swaps):
    gm, lowered, (_, run, direct) = _lowered_after_first_call()
    assert direct is not None
    names = direct.__code__.co_names
    assert not any(n.startswith(("__compiled_fn", "__import_torch_dot__dynamo")) for n in names)
    renamed = [n for n in names if n.startswith("__rocs_direct_")]
    assert any("__compiled_fn" in n for n in renamed) and any("call_size" in n for n in names)
    assert direct.__globals__ is run.__globals__  # every other global is read live
    scores = []
    with torch.no_grad():
        for rows, candidates in [(4, 40), (2, 9), (5, 33)]:
            x, index = scorer_inputs(rows, candidates, seed=rows)
            hook_swaps.clear()
            (got,), (want,) = lowered(x, index), gm(x, index)
            assert hook_swaps == []  # no disable wrapper ran
            torch.testing.assert_close(got, want)
            scores.append(want)
    assert torch.cat(scores).std() > 100 * 1e-5  # scores differ far more than the tolerance


def test_with_an_eval_frame_hook_installed_the_code_runs_as_dynamo_wrote_it(hook_swaps):
    gm, lowered, _ = _lowered_after_first_call()
    x, index = scorer_inputs(4, 21, seed=4)
    hook_swaps.clear()
    with torch.no_grad():
        got = torch._dynamo.run(lambda: lowered(x, index))()  # the hook installed, run-only
        want = gm(x, index)
    torch.testing.assert_close(got[0], want[0])
    assert len(hook_swaps) >= 4  # the disable wrappers took the hook off and put it back


def test_the_helpers_are_dynamos_own_functions_unwrapped_and_the_rest_read_through():
    import torch._dynamo.utils as utils

    helpers = direct_code._helpers(utils)
    assert helpers.call_size is utils.call_size.__wrapped__
    assert helpers.call_size(torch.zeros(3, 5), 1) == 5
    assert helpers.record_pregraph_bytecode_exit is utils.record_pregraph_bytecode_exit.__wrapped__
    assert helpers.istype is utils.istype  # a function no disable wraps
    assert helpers.counters is utils.counters  # not a function: read from the module


def test_code_that_reads_no_wrapped_global_gets_no_direct_function():
    def plain(x):
        return torch.relu(x)

    assert direct_code.direct_function(plain.__code__, plain.__globals__) is None


class _Ranker(nn.Module):
    def __init__(self):
        super().__init__()
        self.user = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 16))
        self.items = nn.Embedding(300, 16)
        self.head = nn.Linear(32, 1)

    def forward(self, user_dense, item_id):
        user = self.user(user_dense)
        return self.head(torch.cat([user, self.items(item_id) * user], -1)).squeeze(-1)


def test_a_settled_door_call_swaps_no_hook_and_stays_exact(hook_swaps):
    torch.manual_seed(0)
    model = _Ranker().eval()
    door = torch.compile(model, backend=rocs.backend(["user_dense"]), dynamic=True)
    g = torch.Generator().manual_seed(1)
    outputs = []
    with torch.no_grad():
        for counts in [[3, 5], [7, 1, 2], [4, 4, 9], [2, 6]]:
            index = request_index(counts)
            user = torch.randn(len(counts), 12, generator=g)
            items = torch.randint(0, 300, (len(index),), generator=g)
            hook_swaps.clear()
            got = rocs.shared_call(door, user, items, candidate_to_request=index)
            want = model(user[index], items)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            outputs.append(want)
    assert hook_swaps == []  # the last call ran both frames' direct code
    assert torch.cat(outputs).std() > 1e-2  # outputs differ far more than the tolerance
