"""The ``torch.compile`` backend: entry-point registration, exactness, recompiles, graph breaks,
shared-layout calls, Inductor lowering and its fallback.

The oracle everywhere is the original eager model on the replicated batch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch
import torch._dynamo.testing as dynamo_testing
from torch import nn
from torch.utils import _pytree as pytree

import rocs_compiler as rocs
from models_zoo import get_entry, names, request_index
from rocs_compiler.backend.lowering import Lowered

RAGGED = [([3, 1, 5], True), ([7], False), ([2, 9, 1, 1], True)]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _assert_close(out, ref, what: str) -> None:
    got, want = pytree.tree_leaves(out), pytree.tree_leaves(ref)
    assert len(got) == len(want), what
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


def _compile(entry, *, inductor=False, counter=False, **kwargs):
    backend = rocs.backend(list(entry.request_inputs), inductor=inductor)
    wrapped = dynamo_testing.CompileCounterWithBackend(backend) if counter else backend
    return backend, wrapped, kwargs


def _check_batches(model, compiled, entry, batches, label):
    with torch.no_grad():
        for counts, shuffle in batches:
            batch = entry.make_batch(counts, seed=len(counts), shuffle=shuffle)
            ref = model(**batch.replicated())
            _assert_close(compiled(**batch.replicated()), ref, f"{label} drop-in {counts}")
            with warnings.catch_warnings():
                warnings.simplefilter("error", UserWarning)  # warns when nothing was shared
                shared = rocs.shared_call(
                    compiled, **batch.kwargs, candidate_to_request=batch.candidate_to_request
                )
            _assert_close(shared, ref, f"{label} shared {counts}")


# -- registration through the entry point ---------------------------------------------------------

_FRESH_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from torch.utils import _pytree as pytree
    from models_zoo import get_entry

    result = {"imported_before": "rocs_compiler" in sys.modules, "models": {}}
    for name in sys.argv[1:]:
        entry = get_entry(name)
        model = entry.build()
        options = {"request_inputs": list(entry.request_inputs), "inductor": False}
        compiled = torch.compile(model, backend="rocs", options=options, dynamic=True)
        errors = []
        with torch.no_grad():
            for counts in ([3, 1, 5], [6], [2, 2, 4]):
                batch = entry.make_batch(counts, shuffle=True)
                out, ref = compiled(**batch.replicated()), model(**batch.replicated())
                errors += [
                    (a - b).abs().max().item()
                    for a, b in zip(pytree.tree_leaves(out), pytree.tree_leaves(ref))
                ]
        result["models"][name] = max(errors)
    result["imported_after"] = "rocs_compiler" in sys.modules
    print(json.dumps(result))
    """
)


def test_backend_string_works_in_a_fresh_process_without_importing_rocs():
    models = ["dlrm", "mmoe", "din"]  # plain args, a dict of inputs, a sequence model
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, "-c", _FRESH_SCRIPT, *models],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["imported_before"] is False
    assert result["imported_after"] is True, "the entry point should have loaded the backend"
    for name in models:
        assert result["models"][name] < 1e-5, (name, result["models"][name])


# -- exactness on every zoo model -----------------------------------------------------------------


@pytest.mark.parametrize("name", names())
def test_drop_in_and_shared_calls_are_exact(name):
    entry = get_entry(name)
    model = entry.build()
    backend, wrapped, _ = _compile(entry)
    compiled = torch.compile(model, backend=wrapped, dynamic=True)
    _check_batches(model, compiled, entry, RAGGED, name)
    rewritten = [s for s in backend.subgraphs if s.compiled_model is not None]
    assert rewritten, f"{name}: no dynamo graph was rewritten by rocs"
    report = rewritten[0].compiled_model.report()
    assert report.request_flops > 0, f"{name}: nothing runs per request"


@pytest.mark.parametrize("name", ["dlrm", "din", "hstu", "target_attention"])
def test_inductor_lowering_is_exact_and_runs_one_compiled_graph_per_call(name):
    """Exact through Inductor, and a shared call runs one Inductor graph and never dynamo's call
    (din's and hstu's lowered graphs broke in two with their batch unbacked: a batch norm's and a
    reshape's check of the candidates' count)."""
    entry = get_entry(name)
    model = entry.build()
    backend, wrapped, _ = _compile(entry, inductor=True)
    compiled = torch.compile(model, backend=wrapped, dynamic=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # an FX fallback would warn
        _check_batches(model, compiled, entry, RAGGED[:2], f"{name} inductor")
    lowered = next(s.variants for s in backend.subgraphs if s.compiled_model is not None)
    runner = next(iter(lowered.values())).runner
    assert isinstance(runner.graph_module, Lowered) and runner.graph_module.uses_inductor
    batch = entry.make_batch([5, 2, 7], seed=11, shuffle=True)
    graphs, lookups = _compiled_regions(
        lambda: rocs.shared_call(
            compiled, **batch.kwargs, candidate_to_request=batch.candidate_to_request
        )
    )
    assert (graphs, lookups) == (1, 0), f"{name}: {graphs} compiled graphs, {lookups} lookups"


def test_an_attention_over_packed_keys_and_values_stays_in_inductor_at_every_r():
    """Keys and values as views of one projection (``nn.MultiheadAttention``'s), compiled first at
    three requests, then at one and at four: every lowered graph runs through Inductor (a fall
    back to its FX graph warns) and is exact. A trace that fixed R once skipped the copies that
    the tiles' own ``torch.cond`` needs, and Inductor refused the aliased operands."""
    from models_zoo.user_models import HistoryTransformerRanker

    torch.manual_seed(0)
    model = HistoryTransformerRanker(
        num_items=200, layers=1, history_length=12, nested_tensor=False
    ).eval()
    backend = rocs.backend(["history"])
    compiled = torch.compile(model, backend=backend, dynamic=True)
    g = torch.Generator().manual_seed(3)
    outputs = []
    with warnings.catch_warnings(), torch.no_grad():
        warnings.filterwarnings("error", message="rocs")  # the fall back to the FX graph
        for counts in ([3, 1, 2], [2], [4, 4, 1, 2], [1, 6, 2], [40]):
            index = request_index(counts, shuffle=True, generator=g)
            history = torch.randint(1, 200, (len(counts), 12), generator=g)
            history[:, 9:] = 0  # padding at the end
            item = torch.randint(1, 200, (len(index),), generator=g)
            want = model(history[index], item)
            got = rocs.shared_call(compiled, history, item, candidate_to_request=index)
            _assert_close(got, want, f"shared {counts}")
            outputs.append(want)
    assert torch.cat(outputs).std() > 100 * 1e-5
    lowered = [
        v.runner.graph_module for s in backend.subgraphs for v in s.variants.values()
    ]
    assert lowered and all(g.uses_inductor and not g._errors for g in lowered)


def test_an_attention_graph_with_its_requests_unbacked_compiles_once_for_every_r():
    """bst's lowered graph holds an attention and takes R unbacked: one compiled entry serves
    three requests, one, four and one again (dynamo's 0/1 rule would compile R = 1 apart)."""
    entry = get_entry("bst")
    model = entry.build()
    backend, wrapped, _ = _compile(entry, inductor=True)
    compiled = torch.compile(model, backend=wrapped, dynamic=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="rocs")  # a fall back to the FX graph warns
        batches = [([5, 2, 7], True), ([3], False), ([2, 9, 1, 1], True), ([6], True)]
        _check_batches(model, compiled, entry, batches, "bst inductor")
    (variant,) = [v for s in backend.subgraphs for v in s.variants.values()]
    lowered = variant.runner.graph_module
    assert lowered._strategies[0] == "unbacked requests", lowered._errors
    assert len(lowered._frame._entries) == 1


def _compiled_regions(call) -> tuple[int, int]:
    """Per call of ``call`` (after two warm calls): the Inductor graphs it runs, and the calls
    that went through dynamo's eval-frame hook (its cache lookup), as the profiler records them."""
    with torch.no_grad():
        for _ in range(2):
            call()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                call()
    names = [event.name for event in prof.events()]
    graphs = sum(n.startswith("## Call CompiledFxGraph") for n in names)
    lookups = sum(
        n == "TorchDynamo Cache Lookup" or n.startswith("Torch-Compiled Region") for n in names
    )
    return graphs // 3, lookups // 3


# -- recompiles -----------------------------------------------------------------------------------

SHAPES = [[3, 1, 5], [6], [2, 2], [7, 1, 1, 4], [40, 40, 40]]  # R = 1 included, N >= 2


def _frames(entry, model, shapes, **compile_kwargs) -> int:
    """The graphs dynamo compiled over ``shapes`` (a trace restarted before its graph was
    compiled, as for floats traced as constants, compiles none)."""
    backend = rocs.backend(list(entry.request_inputs), inductor=False)
    compiled = torch.compile(model, backend=backend, **compile_kwargs)
    with torch.no_grad():
        for i, counts in enumerate(shapes):
            batch = entry.make_batch(counts, seed=i, shuffle=True)
            _assert_close(compiled(**batch.replicated()), model(**batch.replicated()), str(counts))
    return len(backend.subgraphs)


def test_no_recompiles_across_r_and_n_with_dynamic_true():
    entry = get_entry("dlrm")
    assert _frames(entry, entry.build(), SHAPES, dynamic=True) == 1


def test_no_recompiles_for_a_single_candidate_with_backed_size_oblivious():
    """N = 1 is specialized by dynamo's 0/1 rule unless sizes are treated size-obliviously."""
    entry = get_entry("dlrm")
    with torch.fx.experimental._config.patch(backed_size_oblivious=True):
        assert _frames(entry, entry.build(), [[1], *SHAPES], dynamic=True) == 1


def test_default_dynamic_retraces_once():
    """dynamic=None: a static first graph, then one dynamic graph (automatic dynamic shapes)."""
    entry = get_entry("dlrm")
    assert _frames(entry, entry.build(), SHAPES) == 2


# -- graph breaks ---------------------------------------------------------------------------------


class _BreakingModel(nn.Module):
    """A user tower, a graph break, then the interaction with the item."""

    def __init__(self):
        super().__init__()
        self.user = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16))
        self.item = nn.Embedding(50, 16)
        self.head = nn.Linear(32, 1)

    def forward(self, user_dense, item_id):
        u = self.user(user_dense)
        torch._dynamo.graph_break()
        return self.head(torch.cat([u, self.item(item_id)], dim=1)).squeeze(-1)


def test_every_subgraph_of_a_graph_break_is_compiled():
    torch.manual_seed(0)
    model = _BreakingModel().eval()
    backend = rocs.backend(["user_dense"], inductor=False)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        for counts in ([3, 1, 5], [4], [2, 6]):
            index = request_index(counts)
            user, item = torch.randn(len(counts), 8), torch.randint(0, 50, (len(index),))
            ref = model(user[index], item)
            _assert_close(compiled(user[index], item), ref, f"drop-in {counts}")
            with warnings.catch_warnings():
                warnings.simplefilter("error", UserWarning)  # warns when nothing was shared
                shared = rocs.shared_call(compiled, user, item, candidate_to_request=index)
            _assert_close(shared, ref, f"shared {counts}")
    assert len(backend.subgraphs) == 2
    first, second = backend.subgraphs
    assert first.compiled_model is not None, "the user tower should be rewritten"
    assert (
        second.plain is not None and second.fallback_reason == "no request input reaches this graph"
    )


def test_a_model_with_a_graph_break_of_its_own_runs_a_compiled_graph_on_each_side():
    """The count the one-region test asserts sees more where the model breaks its own graph: the
    frame that resumes after the break runs through dynamo's call."""
    torch.manual_seed(0)
    model = _BreakingModel().eval()
    compiled = torch.compile(model, backend=rocs.backend(["user_dense"]), dynamic=True)
    index = request_index([3, 1, 5])
    user, item = torch.randn(3, 8), torch.randint(0, 50, (len(index),))
    with torch.no_grad():
        shared = rocs.shared_call(compiled, user, item, candidate_to_request=index)
        _assert_close(shared, model(user[index], item), "shared through Inductor")
    graphs, lookups = _compiled_regions(
        lambda: rocs.shared_call(compiled, user, item, candidate_to_request=index)
    )
    assert graphs == 2 and lookups >= 1, (graphs, lookups)


# -- state, errors, fallback ----------------------------------------------------------------------


def test_in_place_weight_update_is_seen():
    entry = get_entry("dcnv2")
    model = entry.build()
    compiled = torch.compile(
        model, backend=rocs.backend(list(entry.request_inputs), inductor=False)
    )
    batch = entry.make_batch([2, 3])
    with torch.no_grad():
        compiled(**batch.replicated())
        weight = next(p for p in model.parameters() if p.dim() == 2 and p.shape[0] > 1)
        weight.mul_(1.5)
        _assert_close(compiled(**batch.replicated()), model(**batch.replicated()), "updated")


def test_missing_request_inputs_is_a_clear_error():
    model = get_entry("dlrm").build()
    compiled = torch.compile(model, backend="rocs")
    batch = get_entry("dlrm").make_batch([2])
    with pytest.raises(Exception, match="request_inputs"), torch.no_grad():
        compiled(**batch.replicated())


def test_unknown_request_input_is_a_clear_error():
    model = get_entry("dlrm").build()
    compiled = torch.compile(model, backend=rocs.backend(["user_dens"], inductor=False))
    batch = get_entry("dlrm").make_batch([2])
    with pytest.raises(Exception, match="unknown request input.*user_dens"), torch.no_grad():
        compiled(**batch.replicated())


def test_shared_call_checks_the_index():
    entry = get_entry("dlrm")
    model = entry.build()
    compiled = torch.compile(
        model, backend=rocs.backend(list(entry.request_inputs), inductor=False)
    )
    batch = entry.make_batch([2, 3])
    with pytest.raises(rocs.InputError, match="int64"):
        rocs.shared_call(
            compiled, **batch.kwargs, candidate_to_request=batch.candidate_to_request.int()
        )
    bad = batch.candidate_to_request.clone()
    bad[0] = 5
    with pytest.raises(rocs.InputError, match=r"\[0, 2\)"):
        rocs.shared_call(compiled, **batch.kwargs, candidate_to_request=bad)


def test_shared_call_without_rocs_graphs_warns_and_stays_exact():
    entry = get_entry("dlrm")
    model = entry.build()
    compiled = torch.compile(model, backend="eager")
    batch = entry.make_batch([2, 3], shuffle=True)
    with pytest.warns(UserWarning, match="replicated layout"), torch.no_grad():
        out = rocs.shared_call(
            compiled,
            **batch.kwargs,
            candidate_to_request=batch.candidate_to_request,
            request_inputs=list(entry.request_inputs),
        )
    _assert_close(out, model(**batch.replicated()), "eager backend")


def test_inductor_failure_falls_back_to_fx_with_a_warning():
    gm = torch.fx.symbolic_trace(nn.Linear(4, 2))
    lowered = Lowered(gm, use_inductor=True)

    def broken(*args):
        raise RuntimeError("inductor exploded")

    lowered._compiled = {s: broken for s in lowered._compiled}
    x = torch.randn(3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(lowered(x), gm(x))  # first strategy failed, the next one is due
    with pytest.warns(UserWarning, match="inductor exploded"):
        out = lowered(x)
    torch.testing.assert_close(out, gm(x))
    assert not lowered.uses_inductor


def test_bad_inputs_do_not_switch_inductor_off():
    gm = torch.fx.symbolic_trace(nn.Linear(4, 2))
    lowered = Lowered(gm, use_inductor=True)

    def failing(*args):
        raise RuntimeError("shape mismatch")

    lowered._compiled = {s: failing for s in lowered._compiled}
    strategies = list(lowered._strategies)
    with pytest.raises(RuntimeError):
        lowered(torch.randn(3, 5))  # wrong width: the FX graph fails as well
    assert lowered.uses_inductor and lowered._strategies == strategies


# -- values dynamo passes as tensors --------------------------------------------------------------


class _NumpyOffsets(nn.Module):
    """Per-field id offsets held as a NumPy array and made into a tensor in forward."""

    def __init__(self):
        super().__init__()
        self.offsets = np.array((0, 10, 20, 30, 40, 50, 60), dtype=np.int64)
        self.emb, self.head = nn.Embedding(70, 8), nn.Linear(7 * 8, 1)

    def forward(self, batch):
        ids = torch.stack([batch[k] for k in ("u1", "u2", "u3", "i1", "i2", "i3", "i4")], 1)
        ids = ids + ids.new_tensor(self.offsets).unsqueeze(0)
        return self.head(self.emb(ids).flatten(1)).squeeze(-1)


def _offsets_batch(counts, seed):
    gen = torch.Generator().manual_seed(seed)
    index = request_index(counts, shuffle=True, generator=gen)
    users = torch.randint(0, 10, (3, len(counts)), generator=gen)
    ids = {k: users[i][index] for i, k in enumerate(("u1", "u2", "u3"))}
    for k in ("i1", "i2", "i3", "i4"):
        ids[k] = torch.randint(0, 10, (len(index),), generator=gen)
    return ids


def test_numpy_array_made_into_a_tensor_in_forward_is_a_constant():
    torch.manual_seed(0)
    model = _NumpyOffsets().eval()
    options = {"request_inputs": ["batch.u1", "batch.u2", "batch.u3"], "inductor": False}
    compiled = torch.compile(model, backend="rocs", dynamic=True, options=options)
    with torch.no_grad():
        for i in range(14):  # past the program choice's trials
            batch = _offsets_batch([64, 64, 64, 64] if i == 0 else [3, 1, 5, 2][: 1 + i % 4], i)
            _assert_close(compiled(batch), model(batch), f"call {i}")
        model.offsets[:] = model.offsets[::-1].copy()  # changed in place: the rewrite must see it
        batch = _offsets_batch([3, 4], 99)
        _assert_close(compiled(batch), model(batch), "offsets changed")


def test_numpy_offsets_repro_through_inductor():
    """The issue's repro, exactly: ``dynamic=True``, Inductor on, R = 4, N = 64."""
    torch.manual_seed(0)
    model = _NumpyOffsets().eval()
    backend = rocs.backend(["batch.u1", "batch.u2", "batch.u3"])
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        batch = _offsets_batch([64] * 4, 0)
        _assert_close(compiled(batch), model(batch), "R=4, N=64")
    assert backend.subgraphs[0].compiled_model is not None, "the graph should be rewritten"
    assert backend.subgraphs[0].compiled_model.report().request_flops > 0


class _RenormingUser(nn.Module):
    """A request-side ``nn.Embedding(max_norm=...)``: each lookup renormalizes rows in place."""

    def __init__(self):
        super().__init__()
        self.user = nn.Embedding(20, 8, max_norm=1.0)
        self.item = nn.Embedding(30, 8)
        with torch.no_grad():
            self.user.weight.mul_(5)

    def forward(self, user_id, item_id):
        return (self.user(user_id) * self.item(item_id)).sum(-1)


def test_embedding_with_max_norm_runs_unshared_and_exact_with_its_reason():
    torch.manual_seed(0)
    model, twin = _RenormingUser().eval(), _RenormingUser().eval()
    twin.load_state_dict(model.state_dict())
    backend = rocs.backend(["user_id"], inductor=False)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad(), pytest.warns(UserWarning, match=r"mutates .*max_norm"):
        for i, counts in enumerate([[3, 1, 5], [2, 6], [4]]):
            index = request_index(counts)
            user, item = torch.randint(0, 20, (len(counts),)), torch.randint(0, 30, (len(index),))
            _assert_close(compiled(user[index], item), twin(user[index], item), str(counts))
            assert torch.equal(model.user.weight, twin.user.weight), "eager's renorm was lost"
    assert "max_norm" in backend.subgraphs[0].fallback_reason


# -- recompiles and Inductor through the tutorial's model -----------------------------------------


class _TutorialRanker(nn.Module):
    """The model of docs/tutorial.md, smaller tables."""

    def __init__(self, num_items: int = 1000, dim: int = 32):
        super().__init__()
        self.item_emb = nn.Embedding(num_items, dim)
        self.user_tower = nn.Sequential(nn.Linear(16, 128), nn.ReLU(), nn.Linear(128, dim))
        self.history_proj = nn.Linear(dim, dim)
        self.head = nn.Sequential(nn.Linear(3 * dim, 256), nn.ReLU(), nn.Linear(256, 1))

    def forward(self, user_dense, history, item_id):
        user = self.user_tower(user_dense)
        hist = torch.relu(self.history_proj(self.item_emb(history).mean(1)))
        item = self.item_emb(item_id)
        return self.head(torch.cat([user, hist, item * user], dim=-1)).squeeze(-1)


def _tutorial_batch(counts, seed):
    g = torch.Generator().manual_seed(seed)
    index = request_index(counts)
    users = torch.randn(len(counts), 16, generator=g)
    history = torch.randint(0, 1000, (len(counts), 50), generator=g)
    items = torch.randint(0, 1000, (len(index),), generator=g)
    return {"user_dense": users[index], "history": history[index], "item_id": items}


def test_tutorial_model_does_not_recompile_across_r_n_and_request_row_strides():
    """R = 1 hands the lowered graph request rows ``x[::N]`` of row stride ``N * D``, equal-sized
    requests strided views, ragged ones gathered copies: one compile of the user's frame and one
    of the rewritten graph serve them all (a stride guard recompiled on the first R = 1 batch)."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = _TutorialRanker().eval()
    options = {"request_inputs": ["user_dense", "history"]}
    compiled = torch.compile(model, backend="rocs", options=options, dynamic=True)
    counters.clear()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # an Inductor fallback would warn
        for i, counts in enumerate([(3, 1, 5), (200,), (2, 2, 2, 2), (1, 1), (64,) * 3, (5, 9)]):
            batch = _tutorial_batch(counts, seed=i)
            _assert_close(compiled(**batch), model(**batch), str(counts))
            if i == 0:
                first = dict(counters["frames"])
    assert dict(counters["frames"]) == first, "a new R, N or request-row layout recompiled"
    assert not counters["recompiles"]


def test_a_one_row_batch_is_lowered_without_a_warning():
    """Dynamo specializes a one-row batch; compiling that graph, Inductor asks dynamo to restart
    its analysis (``TensorifyScalarRestartAnalysis``), which the backend passed off as an Inductor
    failure with an empty reason and ran the graph uncompiled."""
    torch.manual_seed(0)
    model = _TutorialRanker().eval()
    options = {"request_inputs": ["user_dense", "history"]}
    compiled = torch.compile(model, backend="rocs", options=options, dynamic=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        for counts in [(3, 1, 5), (1,)]:
            batch = _tutorial_batch(counts, seed=len(counts))
            _assert_close(compiled(**batch), model(**batch), str(counts))


def test_an_inductor_failure_without_a_message_still_names_its_reason():
    from rocs_compiler.backend.lowering import describe_failure

    class Quiet(RuntimeError):
        pass

    try:
        raise Quiet()
    except Quiet as err:
        text = describe_failure(err)
    assert text.startswith("Quiet (no message, raised at test_backend.py:"), text
    assert describe_failure(ValueError("\n\nbad shape\nmore")) == "ValueError: bad shape"


def test_inductor_compiles_the_rocs_ops_in_their_portable_forms_and_runs_the_shared_program():
    """The lowered graph hands Inductor ATen ops only (each ``rocs::`` op in its portable form,
    which Inductor fuses with its neighbours), exact in both layouts; the compiled model never
    trials its eagerly run plain program against the Inductor-compiled shared one."""
    from rocs_compiler.kernels import rocs_op_for

    torch.manual_seed(0)
    model = _TutorialRanker().eval()
    backend = rocs.backend(["user_dense", "history"])
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        for i, counts in enumerate([(3, 1, 5), (1,), (4, 4, 2)]):
            batch = _tutorial_batch(counts, seed=20 + i)
            _assert_close(compiled(**batch), model(**batch), f"drop-in {counts}")
            index = request_index(counts)
            firsts = torch.cumsum(torch.tensor([0, *counts[:-1]]), 0)
            shared = {**batch, "user_dense": batch["user_dense"][firsts],
                      "history": batch["history"][firsts]}  # fmt: skip
            out = rocs.shared_call(compiled, **shared, candidate_to_request=index)
            _assert_close(out, model(**batch), f"shared {counts}")
    (variant,) = [v for s in backend.subgraphs for v in s.variants.values()]
    assert variant.runner.program_choices() == {}, "a bucket was trialled against eager"
    lowered = variant.runner.graph_module
    assert isinstance(lowered, Lowered)

    def rocs_nodes(gm):
        return [n.name for n in gm.graph.nodes if rocs_op_for(n.target) is not None]

    assert rocs_nodes(lowered.gm), "the rewritten graph shares through rocs:: ops"
    assert not rocs_nodes(lowered._portable), "Inductor was handed an opaque rocs:: op"
