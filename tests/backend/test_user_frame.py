"""``rocs.shared_call`` of a model compiled with the rocs backend: after the first call, the model's
compiled ``forward`` runs without ``torch.compile``'s call machinery wherever its guards accept the
call (``backend/user_frame.py``), and the floats dynamo would pass as tensors are traced as
constants (``backend/specialized_floats.py``); both stay exact."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import rocs_compiler as rocs
from dynamo_frames import fresh_dynamo  # noqa: F401 (the fixture every test uses)
from rocs_compiler.backend import specialized_floats, user_frame
from models_zoo import request_index

TOLERANCE = 1e-4


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class _Ranker(nn.Module):
    """A user tower and an item embedding, a float scale and a dropout read in forward (dynamo
    would pass both floats to the graph as tensors under ``dynamic=True``)."""

    def __init__(self):
        super().__init__()
        self.user = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 16))
        self.items = nn.Embedding(300, 16)
        self.head = nn.Linear(32, 1)
        self.drop = nn.Dropout(0.2)
        self.scale = 3.0

    def forward(self, user_dense, item_id):
        user = self.drop(self.user(user_dense))
        both = torch.cat([user, self.items(item_id) * user], -1)
        return self.scale * self.head(both).squeeze(-1)


def _batch(counts, seed):
    g = torch.Generator().manual_seed(seed)
    index = request_index(counts)
    index = index[torch.randperm(len(index), generator=g)]
    shared = {
        "user_dense": torch.randn(len(counts), 12, generator=g),
        "item_id": torch.randint(0, 300, (len(index),), generator=g),
    }
    return shared, {**shared, "user_dense": shared["user_dense"][index]}, index


def _compiled(model, backend=None):
    backend = backend or rocs.backend(["user_dense"], inductor=False)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    calls = []
    through_dynamo = compiled.forward  # the optimized module's call into dynamo's context
    compiled.forward = lambda *a, **k: calls.append(1) or through_dynamo(*a, **k)
    return backend, compiled, calls


def _check(model, compiled, counts, seed, allowed: str = "$^"):
    shared, replicated, index = _batch(counts, seed)
    want = model(**replicated)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # warns when no graph shared anything
        warnings.filterwarnings("ignore", allowed, UserWarning)
        got = rocs.shared_call(compiled, **shared, candidate_to_request=index)
    torch.testing.assert_close(got, want, rtol=TOLERANCE, atol=TOLERANCE)
    assert want.std() > 100 * TOLERANCE, "outputs too flat to tell a wrong answer"


def test_shared_calls_after_the_first_run_the_compiled_forward_and_stay_exact():
    torch.manual_seed(0)
    model = _Ranker().eval()
    _, compiled, calls = _compiled(model)
    with torch.no_grad():
        for seed, counts in enumerate([[3, 1, 5], [7], [2, 9, 1, 4], [1, 2], [30, 2, 11]]):
            _check(model, compiled, counts, seed)
    assert calls == [1], "a call after the first went through torch.compile's call"


def test_floats_are_traced_as_constants_and_a_changed_one_compiles_anew():
    torch.manual_seed(1)
    model = _Ranker().eval()
    backend, compiled, calls = _compiled(model)
    with torch.no_grad():
        _check(model, compiled, [3, 4], seed=1)
        (subgraph,) = backend.subgraphs
        assert subgraph.values == [], "a float reached the graph as a tensor"
        assert not [s for s in subgraph.slots if s.kind == "value"]
        model.scale = -0.5  # fails dynamo's guard on the constant: a new trace
        _check(model, compiled, [2, 6, 1], seed=2)
        _check(model, compiled, [4, 1], seed=3)
    assert len(backend.subgraphs) == 2 and len(calls) == 2
    assert not specialized_floats._OURS, "the names asked of dynamo outlived their trace"


def test_a_model_with_hooks_is_called_through_torch_compile_and_runs_them():
    torch.manual_seed(2)
    model = _Ranker().eval()
    _, compiled, calls = _compiled(model)
    with torch.no_grad():
        _check(model, compiled, [3, 1], seed=4)
        handle = model.register_forward_hook(lambda module, args, out: out * 2.0)
        try:
            # The hook is a frame of its own, which takes no request input: it runs unshared.
            for seed, counts in enumerate([[2, 5], [4, 4, 1]]):
                _check(model, compiled, counts, 5 + seed, allowed="rocs: unknown request input")
        finally:
            handle.remove()
        _check(model, compiled, [6], seed=9)
    assert len(calls) == 3  # the two hooked calls, then the first, not the last


def test_entries_another_backend_compiled_for_the_same_forward_are_not_run():
    torch.manual_seed(3)
    other, model = _Ranker().eval(), _Ranker().eval()
    seen = []

    def eager_backend(gm, example_inputs):
        seen.append(gm)
        return gm.forward

    with torch.no_grad():
        shared, replicated, index = _batch([3, 2], seed=10)
        plain = torch.compile(other, backend=eager_backend, dynamic=True)
        torch.testing.assert_close(plain(**replicated), other(**replicated))
        # Both compiles cache entries on the class's one ``forward`` code, whose guards accept
        # either instance; a shared call must run only the rocs backend's (else it warns).
        _, compiled, calls = _compiled(model)
        for seed, counts in enumerate([[3, 2], [5, 1, 1], [8]]):
            _check(model, compiled, counts, seed=11 + seed)
    frame = user_frame._FRAMES[compiled]
    assert len(frame._entries) == 1 and calls == [1]


def test_a_call_in_grad_mode_goes_through_dynamo_and_stays_exact():
    torch.manual_seed(4)
    model = _Ranker().eval()
    _, compiled, calls = _compiled(model)
    with torch.no_grad():
        _check(model, compiled, [3, 5], seed=20)
    shared, replicated, index = _batch([2, 4], seed=21)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # rocs compiles for inference: it says so
        out = rocs.shared_call(compiled, **shared, candidate_to_request=index)
    torch.testing.assert_close(out, model(**replicated), rtol=TOLERANCE, atol=TOLERANCE)
    assert len(calls) == 2, "grad mode is among the guards: its call is dynamo's to compile"


class _Breaking(_Ranker):
    def forward(self, user_dense, item_id):
        user = self.user(user_dense)
        torch._dynamo.graph_break()
        return self.head(torch.cat([user, self.items(item_id) * user], -1)).squeeze(-1)


def test_a_forward_with_a_graph_break_is_dynamos_to_run_and_its_cache_is_read_rarely(monkeypatch):
    torch.manual_seed(5)
    model = _Breaking().eval()
    _, compiled, calls = _compiled(model)
    reads = []
    refresh = user_frame.CompiledFrame.refresh
    monkeypatch.setattr(
        user_frame.CompiledFrame, "refresh", lambda self: reads.append(1) or refresh(self)
    )
    with torch.no_grad():
        for seed in range(16):
            _check(model, compiled, [3, 1 + seed % 4], seed=30 + seed)
    assert len(calls) == 16, "an entry that resumes after a graph break was run directly"
    assert len(reads) == 5  # at the 1st, 2nd, 4th, 8th and 16th miss in a row


class _Tempered(_Ranker):
    def forward(self, user_dense, item_id, temperature: float = 1.0):
        return super().forward(user_dense, item_id) / temperature


def test_a_float_the_caller_passes_stays_an_input_and_follows_every_value():
    torch.manual_seed(6)
    model = _Tempered().eval()
    backend, compiled, _ = _compiled(model)
    with torch.no_grad():
        for step, temperature in enumerate([1.0, 0.5, 2.0, 0.25, 3.0]):
            shared, replicated, index = _batch([3, 2, 4], seed=40 + step)
            want = model(**replicated, temperature=temperature)
            got = rocs.shared_call(
                compiled, **shared, temperature=temperature, candidate_to_request=index
            )
            torch.testing.assert_close(got, want, rtol=TOLERANCE, atol=TOLERANCE)
    slots = [s for sub in backend.subgraphs for s in sub.slots if s.kind == "value"]
    assert slots, "the caller's float was traced as a constant"
    assert len(backend.subgraphs) == 1  # one graph for every temperature


def test_the_backend_named_by_string_runs_its_own_entries_too():
    torch.manual_seed(7)
    model = _Ranker().eval()
    options = {"request_inputs": ["user_dense"], "inductor": False}
    compiled = torch.compile(model, backend="rocs", options=options, dynamic=True)
    calls = []
    through_dynamo = compiled.forward
    compiled.forward = lambda *a, **k: calls.append(1) or through_dynamo(*a, **k)
    with torch.no_grad():
        for seed, counts in enumerate([[3, 1, 5], [7], [2, 9, 1, 4]]):
            _check(model, compiled, counts, seed=50 + seed)
    assert calls == [1] and len(user_frame._FRAMES[compiled]._entries) == 1


def _tag_safe_roots(manager) -> int:
    if manager is None:
        return 0
    own = int(manager.is_tag_safe_root())
    return own + sum(_tag_safe_roots(child) for child in manager.get_child_managers())


def test_the_models_frame_is_guarded_by_dict_tags_and_follows_what_changes():
    torch.manual_seed(8)
    model = _Ranker().eval()
    _, compiled, calls = _compiled(model)
    with torch.no_grad():
        _check(model, compiled, [3, 2], seed=60)
        (entry,) = user_frame._FRAMES[compiled]._entries
        guards = entry[0]
        # The modules' subtrees are skipped while their dicts' tags match.
        assert _tag_safe_roots(guards.root) >= 1
        assert not torch._dynamo.config.use_recursive_dict_tags_for_guards, "the flag leaked"
        model.head = nn.Linear(32, 1)  # a new submodule: the model's dict tag changes
        _check(model, compiled, [4, 1], seed=61)
        model.user[2].weight = nn.Parameter(torch.randn(16, 32))  # a swapped parameter
        _check(model, compiled, [2, 5, 3], seed=62)
        model.items.weight.mul_(-2.0)  # in place: no tag sees it, the rewrite's state check does
        _check(model, compiled, [1, 6], seed=63)
        _check(model, compiled, [5, 2], seed=64)
    # Swapped modules and parameters reach the graph as inputs, whose identity the rewrite's state
    # check follows: dynamo's guards (checked in full after a tag changed) needed no new trace.
    assert calls == [1]


def test_a_weight_given_new_data_through_dot_data_is_followed():
    """``p.data = t`` gives ``p`` another storage without a new object or a version bump (the
    old way to load weights); the door's rewrite, which reads an alias of ``p``, compiles again."""
    torch.manual_seed(9)
    model = _Ranker().eval()
    backend = rocs.backend(["user_dense"])  # lowered with Inductor, as the door runs by default
    _, compiled, _ = _compiled(model, backend)
    with torch.no_grad():
        _check(model, compiled, [3, 2], seed=70)
        _check(model, compiled, [2, 4], seed=71)
        model.user[0].weight.data = torch.randn(32, 12)
        model.head.weight.data = torch.randn(1, 32)
        _check(model, compiled, [4, 1, 2], seed=72)
        _check(model, compiled, [1, 5], seed=73)
