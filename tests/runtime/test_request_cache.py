"""The request cache: hits are the bits a miss computed, the budget holds, weights flush it."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.utils._pytree import tree_leaves

import rocs_compiler as rocs
from models_zoo.batch import Batch, get_leaf, set_leaf
from models_zoo.registry import ZOO
from rocs_compiler.ir.graph_meta import BATCH_AXIS, PLACEMENT
from rocs_compiler.ir.roles import Role
from rocs_compiler.runtime.choice import program_choice
from rocs_compiler.runtime.cache import request_cache
from rocs_compiler.runtime.cache.request_cache import CacheChoice, RequestCache, row_keys
from rocs_compiler.runtime.cache.request_split import split_request_region

MODELS = ["two_tower", "din", "target_attention", "hstu", "wukong", "bst"]
NO_CHOICE = {"autotune": False}  # these tests are about the cache, not the program choice


def _compiled(name, cache=None, options=NO_CHOICE):
    entry = ZOO[name]
    model = entry.build()
    example = entry.make_batch([3, 2, 4])
    cache = RequestCache(1 << 24, autotune=False) if cache is None else cache
    cm = rocs.compile(
        model, list(entry.request_inputs), example_kwargs=example.replicated(),
        options=options, request_cache=cache,
    )  # fmt: skip
    return entry, model, cm


def _batch(entry, pool: Batch, rows: list[int], counts: list[int], seed: int) -> Batch:
    """Requests ``rows`` of ``pool`` with fresh candidates, ``counts[i]`` for request i."""
    batch = entry.make_batch(counts, seed=seed, shuffle=True)
    picked = torch.tensor(rows)
    for name in entry.request_inputs:
        set_leaf(batch.kwargs, name, get_leaf(pool.kwargs, name).index_select(0, picked))
    return batch


def _call(cm, batch):
    with torch.no_grad():
        return cm(**batch.kwargs, candidate_to_request=batch.candidate_to_request)


def _eager(model, batch):
    with torch.no_grad():
        return model(**batch.replicated())


def _same_bits(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(tree_leaves(a), tree_leaves(b), strict=True))


def _close(a, b) -> None:
    for x, y in zip(tree_leaves(a), tree_leaves(b), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", MODELS)
def test_hits_equal_recomputation_bit_for_bit(name):
    entry, model, cm = _compiled(name)
    plain = rocs.compile(
        model, list(entry.request_inputs), example_kwargs=entry.make_batch([2, 2]).replicated(),
        options=NO_CHOICE,
    )  # fmt: skip
    batch = entry.make_batch([5, 1, 3, 2], seed=7, shuffle=True)
    first, second = _call(cm, batch), _call(cm, batch)
    stats = cm.cache_stats()
    assert (stats["misses"], stats["hits"]) == (4, 4)
    assert _same_bits(second, first)
    assert _same_bits(second, _call(plain, batch))  # the same compiled model without the cache
    _close(second, _eager(model, batch))


@pytest.mark.parametrize("name", ["two_tower", "din", "target_attention", "hstu"])
def test_a_batch_mixing_hits_and_misses_equals_eager(name):
    entry, model, cm = _compiled(name)
    pool = entry.make_batch([1] * 6, seed=3)
    _call(cm, _batch(entry, pool, [0, 1, 2], [2, 3, 1], seed=4))
    mixed = _batch(entry, pool, [4, 1, 3, 0, 5], [3, 1, 4, 2, 1], seed=5)
    _close(_call(cm, mixed), _eager(model, mixed))
    stats = cm.cache_stats()
    assert (stats["hits"], stats["misses"], stats["entries"]) == (2, 6, 6)
    again = _batch(entry, pool, [5, 4, 3, 2, 1, 0], [1, 2, 1, 3, 1, 2], seed=6)
    _close(_call(cm, again), _eager(model, again))
    assert cm.cache_stats()["hits"] == 8


def test_drop_in_calls_use_the_cache():
    entry, model, cm = _compiled("two_tower")
    batch = entry.make_batch([3, 1, 2], seed=2)
    replicated = batch.replicated()
    with torch.no_grad():
        first = cm(**replicated)
        second = cm(**replicated)
    assert _same_bits(first, second)
    assert cm.cache_stats()["hits"] == 3
    _close(second, _eager(model, batch))


def test_inputs_one_bit_apart_never_share_an_entry():
    entry, model, cm = _compiled("two_tower")
    batch = entry.make_batch([2, 3], seed=1)
    _call(cm, batch)
    dense = get_leaf(batch.kwargs, "user_dense").clone()
    dense.view(torch.int32)[1, 5] ^= 1  # the last mantissa bit of one feature of request 1
    flipped = Batch(
        dict(batch.kwargs, user_dense=dense), batch.candidate_to_request, batch.request_inputs
    )
    out = _call(cm, flipped)
    assert (cm.cache_stats()["hits"], cm.cache_stats()["misses"]) == (1, 3)
    _close(out, _eager(model, flipped))
    # -0.0 and 0.0 compare equal but differ in one bit: two entries
    zeros = dense.clone()
    zeros[0] = 0.0
    negative = zeros.clone()
    negative[0, 0] = -0.0
    keys = row_keys([zeros[:1]], 1) + row_keys([negative[:1]], 1)
    assert keys[0] != keys[1]


def test_keys_tell_layouts_of_the_same_bytes_apart():
    a = torch.arange(6, dtype=torch.int32).reshape(1, 2, 3)
    assert row_keys([a], 1) != row_keys([a.reshape(1, 3, 2)], 1)
    assert row_keys([a], 1) != row_keys([a.view(torch.float32)], 1)


def test_eviction_keeps_the_budget_and_drops_the_least_recently_used():
    entry, _, cm = _compiled("two_tower")
    pool = entry.make_batch([1] * 5, seed=9)
    _call(cm, _batch(entry, pool, [0], [2], seed=1))
    per_entry = cm.cache_stats()["bytes"]
    _, model_, cm = _compiled("two_tower", RequestCache(3 * per_entry, autotune=False))
    _call(cm, _batch(entry, pool, [0, 1, 2], [1, 1, 1], seed=1))
    _call(cm, _batch(entry, pool, [0], [1], seed=2))  # request 0 becomes the most recent
    _call(cm, _batch(entry, pool, [3], [2], seed=3))  # evicts request 1
    stats = cm.cache_stats()
    assert stats["bytes"] <= stats["max_bytes"] and stats["entries"] == 3
    assert stats["evictions"] == 1
    before = stats["hits"]
    _call(cm, _batch(entry, pool, [0, 2, 3], [1, 1, 1], seed=4))
    assert cm.cache_stats()["hits"] == before + 3
    last = _batch(entry, pool, [1, 4], [2, 1], seed=5)
    _close(_call(cm, last), _eager(model_, last))
    stats = cm.cache_stats()
    assert stats["hits"] == before + 3 and stats["bytes"] <= stats["max_bytes"]


def test_a_request_larger_than_the_budget_is_not_kept():
    entry, model, cm = _compiled("din", RequestCache(64, autotune=False))
    batch = entry.make_batch([2, 1], seed=1)
    _close(_call(cm, batch), _eager(model, batch))
    stats = cm.cache_stats()
    assert stats["entries"] == 0 and stats["bytes"] == 0 and stats["too_large"] == 2


def test_weight_updates_invalidate_the_cache():
    entry, model, cm = _compiled("two_tower")
    batch = entry.make_batch([2, 3], seed=1)
    _call(cm, batch)
    with torch.no_grad():
        next(model.parameters()).mul_(1.5)  # in place: seen through the version counter
    _close(_call(cm, batch), _eager(model, batch))
    assert cm.cache_stats()["invalidations"] == 1 and cm.cache_stats()["hits"] == 0
    param = next(model.parameters())
    param.data.mul_(2.0)  # bypasses version counters: refresh_weights() makes it seen
    cm.refresh_weights()
    _close(_call(cm, batch), _eager(model, batch))
    assert cm.cache_stats()["invalidations"] == 2 and cm.cache_stats()["hits"] == 0
    _call(cm, batch)
    assert cm.cache_stats()["hits"] == 2


def test_unrelated_modules_made_elsewhere_do_not_flush_it():
    entry, _, cm = _compiled("two_tower")
    batch = entry.make_batch([2, 3], seed=1)
    _call(cm, batch)
    torch.nn.Linear(3, 3)  # registers parameters, which makes the weight refresh look again
    _call(cm, batch)
    assert cm.cache_stats()["hits"] == 2 and cm.cache_stats()["invalidations"] == 0


def test_concurrent_threads_share_one_cache():
    entry, model, cm = _compiled("target_attention", RequestCache(300_000, autotune=False))
    pool = entry.make_batch([1] * 8, seed=11)
    jobs = []
    for t in range(4):
        rows = [(t + k) % 8 for k in range(4)]
        batch = _batch(entry, pool, rows, [1 + (t + k) % 3 for k in range(4)], seed=20 + t)
        jobs.append((batch, _eager(model, batch)))
    errors, barrier = [], threading.Barrier(4)

    def work(batch, want):
        try:
            barrier.wait()
            for _ in range(15):
                _close(_call(cm, batch), want)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=job) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[0]
    stats = cm.cache_stats()
    assert stats["bytes"] <= stats["max_bytes"]
    assert stats["hits"] + stats["misses"] == 4 * 15 * 4 and stats["hits"] > stats["misses"]


@pytest.mark.parametrize("name", ["two_tower", "din", "hstu"])
def test_request_rows_are_independent_across_requests(name):
    """Non-interference: perturbing other requests' inputs leaves a request's boundary values
    bit-identical (what lets rows computed in different calls be put together)."""
    entry, _, cm = _compiled(name)
    split = split_request_region(cm.graph_module)
    program = torch.fx.GraphModule(cm.graph_module, split.request_graph)
    a = entry.make_batch([1] * 4, seed=1)
    b = entry.make_batch([1] * 4, seed=2)
    input_of = {ph: name for name, ph in cm.placeholder_of.items()}
    order = [input_of[n.name] for n in split.request_graph.nodes if n.op == "placeholder"]
    leaves = {n: get_leaf(a.kwargs, n) for n in order}
    mixed = {n: v.clone() for n, v in leaves.items()}
    for n, value in mixed.items():
        value[1:] = get_leaf(b.kwargs, n)[1:]
    with torch.no_grad():
        first = program(*[leaves[n] for n in order])
        second = program(*[mixed[n] for n in order])
    for x, y, axis in zip(first, second, split.axes):
        assert torch.equal(x.narrow(axis.dim, 0, 1), y.narrow(axis.dim, 0, 1))


@pytest.mark.parametrize("name", MODELS)
def test_the_rest_program_computes_no_request_value_but_the_recomputed(name):
    """The request region runs in the request program only (attention nodes, which FX's dead
    code elimination keeps as random ops, included)."""
    _, _, cm = _compiled(name)
    split = split_request_region(cm.graph_module)
    computed = {
        n.name
        for n in split.rest_graph.nodes
        if n.op == "call_function"
        and n.meta.get(PLACEMENT) == Role.REQUEST
        and isinstance(n.meta.get("val"), torch.Tensor)
    }
    assert computed <= set(split.recomputed)


def test_a_request_node_without_a_batch_axis_refuses_the_cache():
    entry, model, cm = _compiled("two_tower", options=NO_CHOICE)
    for node in cm.graph_module.graph.nodes:
        if node.meta.get(PLACEMENT) == Role.REQUEST and node.op == "call_function":
            node.meta.pop(BATCH_AXIS, None)
            break
    request_cache.attach(cm, RequestCache(1 << 20))
    stats = cm.cache_stats()
    assert stats["refused"] and "no batch axis" in stats["refused"]
    batch = entry.make_batch([2, 1], seed=3)
    _close(_call(cm, batch), _eager(model, batch))
    assert cm.cache_stats()["misses"] == 0  # ran without it
    assert "request cache: not used" in cm.report().note


def test_report_and_stats_show_the_cache():
    entry, model, cm = _compiled("din")
    _call(cm, entry.make_batch([2, 2], seed=1))
    note = cm.report().note
    assert "request cache: 0 hits, 2 misses" in note
    plain = rocs.compile(
        model, list(entry.request_inputs), example_kwargs=entry.make_batch([2, 2]).replicated()
    )
    assert plain.cache_stats() is None


def test_a_cache_serves_one_model_and_checks_its_budget():
    cache = RequestCache(1 << 20)
    _compiled("two_tower", cache)
    with pytest.raises(rocs.OptionsError, match="one compiled model"):
        _compiled("two_tower", cache)
    with pytest.raises(rocs.OptionsError, match="max_bytes"):
        RequestCache(0)


def test_the_choice_turns_the_cache_off_where_it_measures_slower(monkeypatch):
    """A fake clock that only the cached arm advances (hashing): the bucket drops the cache,
    says so in the report, and from then on calls run without hashing."""
    clock = [0.0]
    monkeypatch.setattr(request_cache, "call_clock", lambda: lambda: clock[0])
    real_keys = request_cache.row_keys
    hashed = []

    def slow_keys(tensors, rows):
        clock[0] += 1.0
        hashed.append(rows)
        return real_keys(tensors, rows)

    monkeypatch.setattr(request_cache, "row_keys", slow_keys)
    entry, model, cm = _compiled("two_tower", RequestCache(1 << 20))
    batch = entry.make_batch([2, 3], seed=1)
    calls = request_cache.WARMUP + 2 * request_cache.CACHE_TRIALS
    for _ in range(calls):
        _close(_call(cm, batch), _eager(model, batch))
    stats = cm.cache_stats()
    assert len(stats["off_buckets"]) == 1
    assert "off where it measured slower" in cm.report().note
    count = len(hashed)
    _close(_call(cm, batch), _eager(model, batch))
    assert len(hashed) == count


def test_the_cache_choice_is_not_decided_by_one_lucky_call():
    """The cached arm's time depends on its hits; one lucky call must not decide."""
    choice = CacheChoice(trials=4)
    key = program_choice.bucket("cache", 16, 4)
    cached = [5.0, 0.1, 5.0, 5.0]  # the first of each is discarded
    for c in cached:
        choice.record(key, program_choice.SHARED, c)
        choice.record(key, program_choice.PLAIN, 1.0)
    assert choice.decided(key) == program_choice.PLAIN


def test_the_cache_choice_weighs_calls_with_a_miss_by_how_often_they_come():
    """Most cached calls hit every row (0.4), a third have a miss (1.0): the median is an all-hit
    call and would keep the cache, but over many calls the cached arm costs more than the plain
    one (0.55), and the choice drops it."""
    choice = CacheChoice(trials=10)
    key = program_choice.bucket("cache", 16, 4)
    cached = [9.0] + [0.4, 0.4, 1.0] * 3  # the first of each arm is discarded
    for c in cached:
        choice.record(key, program_choice.SHARED, c)
        choice.record(key, program_choice.PLAIN, 0.55)
    assert choice.decided(key) == program_choice.PLAIN
    assert request_cache.trimmed_mean([0.4, 0.4, 1.0] * 3) > 0.55 > 0.4  # the median's pick


@pytest.mark.parametrize("cached, expected", [(0.97, "plain"), (0.9, "shared")])
def test_the_cache_must_lead_by_a_margin(cached, expected):
    choice = CacheChoice(trials=2)
    key = program_choice.bucket("cache", 16, 4)
    for _ in range(4):
        arm = choice.next_trial(key, margin=request_cache.CACHE_MARGIN)
        choice.record(key, arm, cached if arm == program_choice.SHARED else 1.0)
    assert choice.decided(key) == expected


# -- every layout, every state the request program reads, no replayed draws --------------------


def _mlp_with_ids(cache=None):
    """A model with a 1-D request input (``user_ids``), as TorchRec's padded id pieces are."""
    from models_for_tests import USER_ITEM_MLP

    model = USER_ITEM_MLP.build()
    cache = RequestCache(1 << 20, autotune=False) if cache is None else cache
    cm = USER_ITEM_MLP.compile(model, options=NO_CHOICE, request_cache=cache)
    return USER_ITEM_MLP, model, cm


@pytest.mark.parametrize("counts", [[3], [2, 2], [4, 1, 2], [1]])
def test_drop_in_calls_with_a_one_dimensional_request_input_use_the_cache(counts):
    """Equal-sized requests of a drop-in call are strided views of the replicated rows; a 1-D
    one (one request: a single element with its stride) is keyed like any other."""
    case, model, cm = _mlp_with_ids()
    batch = case.batch(counts, seed=4)
    replicated = batch.replicated()
    with torch.no_grad():
        first, second = cm(**replicated), cm(**replicated)
    assert _same_bits(first, second)
    assert cm.cache_stats()["hits"] == len(counts)
    _close(second, _eager(model, batch))


def test_row_keys_take_any_strides():
    ids = torch.arange(12)
    for view in (ids[::4][:1], ids[::3], ids.view(3, 4).t(), ids.view(3, 4)[:, 1:2]):
        rows = view.shape[0]
        assert row_keys([view], rows) == row_keys([view.clone().contiguous()], rows)


FAST_ZOO = ("two_tower", "mmoe")  # the zoo's 1-D request inputs


@pytest.mark.parametrize(
    "name", [n if n in FAST_ZOO else pytest.param(n, marks=pytest.mark.slow) for n in ZOO]
)
def test_every_zoo_model_uses_the_cache_in_every_layout(name):
    """Drop-in calls of one request and of equal-sized requests (strided request rows), a
    ragged drop-in call, the shared layout and ``call_replicated``: each call's second run hits
    every request and returns the first run's bits, and both equal eager."""
    entry, model, cm = _compiled(name)
    for counts in ([3], [2, 2], [1, 3, 2]):
        batch = entry.make_batch(counts, seed=len(counts))
        request_cache.attach(cm, None)
        request_cache.attach(cm, RequestCache(1 << 24, autotune=False))
        calls = {
            "drop-in": lambda: cm(**batch.replicated()),
            "shared": lambda: cm(**batch.kwargs, candidate_to_request=batch.candidate_to_request),
            "replicated": lambda: cm.call_replicated(
                **batch.replicated(), candidate_to_request=batch.candidate_to_request
            ),
        }
        want = _eager(model, batch)
        for layout, run in calls.items():
            before = cm.cache_stats()["hits"]
            with torch.no_grad():
                first, second = run(), run()
            assert _same_bits(first, second), (counts, layout)
            assert cm.cache_stats()["hits"] >= before + len(counts), (counts, layout)
            _close(second, want)


class _DroppedRequest(torch.nn.Module):
    """A dropout on the request tower's values: with ``request_dropout="per_request"`` it runs
    on the request rows, one mask per request."""

    def __init__(self):
        super().__init__()
        self.user = torch.nn.Linear(6, 16)
        self.drop = torch.nn.Dropout(0.5)
        self.item = torch.nn.Linear(4, 16)

    def forward(self, user, item):
        return self.drop(self.user(user)) * self.item(item)


def test_a_request_program_drawing_random_numbers_is_never_cached():
    """A hit would hand out the mask an earlier call drew: the cache refuses such a program at
    construction, says why, and every call draws afresh."""
    torch.manual_seed(0)
    model = _DroppedRequest().train()
    index = torch.tensor([0, 0, 1, 1, 1, 2, 3, 3])
    user, item = torch.randn(4, 6), torch.randn(8, 4)
    cm = rocs.compile(
        model, ["user"], example_kwargs={"user": user[index], "item": item}, training=True,
        options={"request_dropout": "per_request", "autotune": False},
        request_cache=RequestCache(1 << 20, autotune=False),
    )  # fmt: skip
    stats = cm.cache_stats()
    assert stats["refused"] and "random" in stats["refused"] and "replay" in stats["refused"]
    with torch.no_grad():
        first = cm(user=user, item=item, candidate_to_request=index)
        second = cm(user=user, item=item, candidate_to_request=index)
    assert not torch.equal(first != 0, second != 0), "the second call replayed the first's mask"
    assert cm.cache_stats()["hits"] == 0
    assert "request cache: not used" in cm.report().note


def _train_step(model):
    """A train-mode forward of the original: batch norm moves its running statistics in place,
    in a kernel that bumps no version counter."""
    from models_for_tests import BATCH_NORM_EVAL

    model.train()
    with torch.no_grad():
        model(**BATCH_NORM_EVAL.batch([4, 4], seed=5).replicated())
    model.eval()


def _replace_bn(model):
    """The batch norm replaced by an equal module whose statistics differ (the guards follow
    it: same class, equal attributes)."""
    bn = torch.nn.BatchNorm1d(model.bn.num_features).eval()
    bn.load_state_dict(model.bn.state_dict())
    with torch.no_grad():
        bn.running_mean.add_(0.5)
    model.bn = bn


def _load(model):
    state = {k: v * 1.25 if v.is_floating_point() else v for k, v in model.state_dict().items()}
    model.load_state_dict(state)


def _data_of(name, how):
    def change(model):
        tensor = model.get_parameter(name) if "weight" in name else model.get_buffer(name)
        if how == "copy_":
            tensor.data.copy_(tensor * 1.5 + 0.25)  # the storage written, no version bump
        else:
            tensor.data = tensor.detach() * 1.5 + 0.25  # another storage, no version bump

    return change


STATE_CHANGES = {
    "train-mode forward": _train_step,
    "running mean .data.copy_": _data_of("bn.running_mean", "copy_"),
    "running var .data =": _data_of("bn.running_var", "assign"),
    "weight .data =": _data_of("lin.weight", "assign"),
    "weight reassigned": lambda m: setattr(m.lin, "weight", torch.nn.Parameter(m.lin.weight * 2)),
    "module replaced": _replace_bn,
    "load_state_dict": _load,
    "buffer written in place": lambda m: m.bn.running_var.mul_(3.0),
}


@pytest.mark.parametrize("change", list(STATE_CHANGES))
def test_every_state_the_request_program_reads_invalidates_the_cache(change):
    """Batch norm's statistics and weights, written in every way a user or a kernel writes them:
    the next call's rows are computed again and equal eager, as without the cache."""
    from models_for_tests import BATCH_NORM_EVAL

    model = BATCH_NORM_EVAL.build()
    cm = BATCH_NORM_EVAL.compile(
        model, options=NO_CHOICE, request_cache=RequestCache(1 << 20, autotune=False)
    )
    batch = BATCH_NORM_EVAL.batch([2, 3, 1], seed=1)
    _call(cm, batch)
    _call(cm, batch)
    assert cm.cache_stats()["hits"] == 3
    STATE_CHANGES[change](model)
    _close(_call(cm, batch), _eager(model, batch))
    stats = cm.cache_stats()
    assert stats["hits"] == 3 and stats["invalidations"] == 1, stats
    again = _call(cm, batch)  # the new rows are cached
    assert cm.cache_stats()["hits"] == 6
    _close(again, _eager(model, batch))


class _Scaled(torch.nn.Module):
    """A plain tensor attribute read by the request side (lifted as a constant the graph shares
    with the model: an in-place write to it reaches the compiled graph, and bumps no weight's
    version)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.scale = torch.full((4,), 2.0)

    def forward(self, user, item):
        return self.lin(user) * self.scale + item


def test_a_constant_the_request_program_shares_with_the_model_invalidates_the_cache():
    model = _Scaled().eval()
    index = torch.tensor([0, 0, 1, 2, 2])
    user, item = torch.randn(3, 4), torch.randn(5, 4)
    cm = rocs.compile(
        model, ["user"], example_kwargs={"user": user[index], "item": item}, options=NO_CHOICE,
        request_cache=RequestCache(1 << 20, autotune=False),
    )  # fmt: skip
    with torch.no_grad():
        cm(user=user, item=item, candidate_to_request=index)
        model.scale.mul_(3.0)
        got = cm(user=user, item=item, candidate_to_request=index)
        _close(got, model(user[index], item))
    assert cm.cache_stats()["hits"] == 0 and cm.cache_stats()["invalidations"] == 1


def test_a_mask_built_from_the_historys_width_is_cached_with_the_request_side():
    """``arange(hist.shape[1]) < hist_len``: the width is a size of the call, a constant of it
    (no fallback), which the request program and the rest both read; hits give the miss's bits."""
    from padded_models import WithLengths

    model = WithLengths().eval()
    g = torch.Generator().manual_seed(3)
    hist = torch.randint(1, 50, (3, 12), generator=g)
    lengths = torch.tensor([12, 4, 7])
    index = torch.tensor([0, 0, 1, 2, 2, 2, 1])
    item = torch.randint(1, 50, (index.shape[0],), generator=g)
    example = {"hist": hist[index], "hist_len": lengths[index], "item": item}
    torch._dynamo.mark_dynamic(example["hist"], 1)
    cm = rocs.compile(
        model, ["hist", "hist_len"], example_kwargs=example, options=NO_CHOICE,
        request_cache=RequestCache(1 << 24, autotune=False),
    )  # fmt: skip
    assert not cm.report().fallbacks, cm.report().fallbacks
    assert cm._cache.refused is None, cm._cache.refused  # the graph splits at the requests
    for width in (12, 20):
        wide = torch.nn.functional.pad(hist, (0, width - 12))
        with torch.no_grad():
            want = model(wide[index], lengths[index], item)
            first = cm(hist=wide, hist_len=lengths, item=item, candidate_to_request=index)
            again = cm(hist=wide, hist_len=lengths, item=item, candidate_to_request=index)
        torch.testing.assert_close(first, want, rtol=1e-5, atol=1e-5)
        assert _same_bits(again, first)
    assert cm._cache.cache.stats()["hits"] >= 3  # the second call of each width hit