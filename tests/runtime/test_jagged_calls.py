"""Jagged calls (``runtime/call/jagged.py``): a shared-layout call whose histories are padded
past most requests' lengths runs as groups of requests cut to their own lengths, exact against
the original model on the padded batch; misused lengths are refused naming the input."""

from __future__ import annotations

import pytest
import torch

import rocs_compiler as rocs
from models_zoo import din
from rocs_compiler.errors import InputError

from dynamic_histories import assert_eagers_gradients, din_model, marked_example, replicated
from padded_models import VOCAB, Pooled, WithLengths

WIDTH = 256


def heavy_tailed(batch, seed: int, width: int = WIDTH, empty: bool = True) -> dict:
    """``batch``'s shared-layout inputs with DIN histories padded to ``width``: one request at
    the full width, most at a few dozen events, some without any (``empty``)."""
    g = torch.Generator().manual_seed(seed)
    kwargs = dict(batch.kwargs)
    rows = kwargs["hist_item_ids"].shape[0]
    lengths = torch.randint(1, 40, (rows,), generator=g)
    lengths[int(torch.randint(0, rows, (1,), generator=g))] = width
    if empty and rows > 2:
        lengths[int(torch.randint(0, rows, (1,), generator=g))] = 0
    for name, vocab in zip(("hist_item_ids", "hist_cat_ids"), (din.NUM_ITEMS, din.NUM_CATS)):
        ids = torch.randint(1, vocab, (rows, width), generator=g)
        kwargs[name] = ids.masked_fill(torch.arange(width) >= lengths[:, None], 0)
    return kwargs


@pytest.fixture(scope="module")
def compiled():
    model = din_model()
    return model, rocs.compile(model, list(din.REQUEST_INPUTS), example_kwargs=marked_example())


def test_din_is_proven_to_cut_its_histories_at_the_padding_id(compiled):
    _, cm = compiled
    assert cm.jagged_refused is None
    proof = cm._jagged.truncation
    assert proof.source.input == "hist_item_ids" and proof.source.pad == 0
    assert proof.inputs == {"hist_item_ids": (1,), "hist_cat_ids": (1,)}
    report = cm.report(candidates=16, requests=2)
    assert (
        "jagged calls       : on: each request's history cut to its length, read from "
        "'hist_item_ids' past its last id other than 0" in report.summary()
    )
    assert report.to_dict()["jagged"].startswith("on:")


@pytest.mark.parametrize("seed", range(4))
def test_a_heavy_tailed_call_runs_in_groups_exact_against_the_padded_original(compiled, seed):
    model, cm = compiled
    counts = [7, 1, 12, 3, 5, 2, 9, 4][: 3 + seed]
    batch = din.make_batch(counts, seed=seed, shuffle=True)
    kwargs = heavy_tailed(batch, seed)
    index = batch.candidate_to_request
    before = cm._jagged.split_calls
    with torch.no_grad():
        want = model(**replicated(kwargs, index))
        got = cm(**kwargs, candidate_to_request=index)
    assert want.std() > 1e-2
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert cm._jagged.split_calls == before + 1


def test_a_call_whose_requests_fill_the_width_runs_as_it_is(compiled):
    model, cm = compiled
    batch = din.make_batch([3, 2], seed=5)
    kwargs = heavy_tailed(batch, 5, width=16, empty=False)
    for name in ("hist_item_ids", "hist_cat_ids"):
        kwargs[name] = kwargs[name].clamp(min=1)  # every position holds an event
    before = cm._jagged.split_calls
    with torch.no_grad():
        got = cm(**kwargs, candidate_to_request=batch.candidate_to_request)
        want = model(**replicated(kwargs, batch.candidate_to_request))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert cm._jagged.split_calls == before


def test_groups_reuse_the_one_compiled_program(compiled):
    _, cm = compiled
    runners = set()
    with torch.no_grad():
        for seed in range(3):
            batch = din.make_batch([4, 2, 6], seed=10 + seed)
            cm(**heavy_tailed(batch, 10 + seed), candidate_to_request=batch.candidate_to_request)
            runners.add((id(cm._runner), id(cm._plain._runner)))
    assert len({r for r, _ in runners} - {id(None)}) <= 1
    assert len({p for _, p in runners} - {id(None)}) <= 1


def test_a_call_under_autograd_keeps_its_width(compiled):
    model, cm = compiled
    batch = din.make_batch([3, 4], seed=7)
    kwargs = heavy_tailed(batch, 7)
    before = cm._jagged.split_calls
    got = cm(**kwargs, candidate_to_request=batch.candidate_to_request)
    with torch.no_grad():
        want = model(**replicated(kwargs, batch.candidate_to_request))
    torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=1e-5)
    assert cm._jagged.split_calls == before


def _compiled_pooled(model, **options):
    """``model`` (a :class:`Pooled`) compiled from a small example, its history marked."""
    hist, _, item, index = _pooled_call([2, 3, 1], 0, 8)
    example = {"hist": hist[index], "item": item}
    torch._dynamo.mark_dynamic(example["hist"], 1)
    return rocs.compile(model, ["hist"], example_kwargs=example, **options)


def _pooled_call(rows_counts, seed, width, empty_every=0):
    g = torch.Generator().manual_seed(seed)
    R = len(rows_counts)
    lengths = torch.randint(1, 6, (R,), generator=g)
    lengths[0] = width
    if empty_every:
        lengths[1::empty_every] = 0
    hist = torch.randint(1, VOCAB, (R, width), generator=g)
    hist = hist.masked_fill(torch.arange(width) >= lengths[:, None], 0)
    index = torch.repeat_interleave(torch.arange(R), torch.tensor(rows_counts))
    index = index[torch.randperm(index.shape[0], generator=g)]
    item = torch.randint(1, VOCAB, (index.shape[0],), generator=g)
    return hist, lengths, item, index


@pytest.fixture
def free_calls(monkeypatch):
    """Groups cost nothing more than their work: small models split as a large one would."""
    from rocs_compiler.runtime.call import jagged_groups

    monkeypatch.setattr(jagged_groups, "CALL_FLOPS", 0.0)


def test_a_small_model_keeps_its_width_when_a_call_costs_more_than_it_saves():
    model = Pooled("masked_sum").eval()
    cm = _compiled_pooled(model)
    hist, _, item, index = _pooled_call([3, 1, 4, 2, 5], 1, 64)
    with torch.no_grad():
        got = cm(hist=hist, item=item, candidate_to_request=index)
        torch.testing.assert_close(got, model(hist[index], item), rtol=1e-5, atol=1e-5)
    assert cm._jagged.split_calls == 0


@pytest.mark.parametrize("pool", ["softmax", "large_negative", "max", "masked_sum"])
def test_a_model_that_normalizes_over_the_history_is_exact_with_empty_histories(pool, free_calls):
    model = Pooled(pool).eval()
    cm = _compiled_pooled(model)
    hist, _, item, index = _pooled_call([3, 1, 4, 2, 5, 1, 2], 1, 64, empty_every=3)
    with torch.no_grad():
        want = model(hist[index], item)
        got = cm(hist=hist, item=item, candidate_to_request=index)
    assert cm._jagged.split_calls == 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_a_model_that_reads_its_padding_keeps_the_width_and_says_why():
    model = Pooled("mean").eval()
    cm = _compiled_pooled(model)
    assert cm._jagged.truncation is None and "mean" in cm.jagged_refused
    assert f"jagged calls       : off: {cm.jagged_refused}" in cm.report().summary()
    hist, _, item, index = _pooled_call([3, 1, 4, 2], 1, 64)
    with torch.no_grad():
        torch.testing.assert_close(
            cm(hist=hist, item=item, candidate_to_request=index), model(hist[index], item),
            rtol=1e-5, atol=1e-5,
        )  # fmt: skip


@pytest.fixture(scope="module")
def with_lengths():
    model = WithLengths().eval()
    hist, lengths, item, index = _pooled_call([2, 3, 1], 0, 8)
    example = {"hist": hist[index], "hist_len": lengths[index], "item": item}
    torch._dynamo.mark_dynamic(example["hist"], 1)
    return model, rocs.compile(model, ["hist", "hist_len"], example_kwargs=example)


def test_a_lengths_input_groups_the_requests(with_lengths, free_calls):
    model, cm = with_lengths
    hist, lengths, item, index = _pooled_call([3, 1, 4, 2, 2, 5], 2, 128)
    hist = torch.randint(1, VOCAB, hist.shape)  # past each length: ids the mask hides
    with torch.no_grad():
        want = model(hist[index], lengths[index], item)
        got = cm(hist=hist, hist_len=lengths, item=item, candidate_to_request=index)
    assert cm._jagged.truncation.source.input == "hist_len"
    assert cm._jagged.split_calls == 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "bad, message",
    [(-1, r"'hist_len' holds a negative length \(-1\) at row 2"),
     (129, r"'hist_len' holds length 129 at row 2, past the histories' width 128")],
)  # fmt: skip
def test_misused_lengths_are_refused_naming_the_input(with_lengths, bad, message):
    _, cm = with_lengths
    hist, lengths, item, index = _pooled_call([3, 1, 4, 2], 3, 128)
    lengths[2] = bad
    with torch.no_grad(), pytest.raises(InputError, match=message):
        cm(hist=hist, hist_len=lengths, item=item, candidate_to_request=index)


@pytest.mark.parametrize("seed", range(2))
def test_a_dropin_call_runs_its_rows_in_groups(compiled, seed):
    model, cm = compiled
    batch = din.make_batch([5, 2, 8, 1, 3][: 3 + seed], seed=20 + seed, shuffle=True)
    kwargs = replicated(heavy_tailed(batch, 20 + seed), batch.candidate_to_request)
    before = cm._jagged.split_calls
    with torch.no_grad():
        want = model(**kwargs)
        got = cm(**kwargs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert cm._jagged.split_calls == before + 1


def _nested(padded: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    values = torch.cat([row[:n] for row, n in zip(padded, lengths.tolist())])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    return torch.nested.nested_tensor_from_jagged(values, offsets)


def _din_lengths(kwargs) -> torch.Tensor:
    ids = kwargs["hist_item_ids"]
    return ((ids != 0) * torch.arange(1, ids.shape[1] + 1)).amax(1)


def test_histories_given_as_nested_tensors_are_exact(compiled):
    model, cm = compiled
    batch = din.make_batch([4, 1, 6, 2], seed=30, shuffle=True)
    kwargs = heavy_tailed(batch, 30)
    lengths = _din_lengths(kwargs)
    nested = dict(kwargs)
    for name in ("hist_item_ids", "hist_cat_ids"):
        nested[name] = _nested(kwargs[name], lengths)
    index = batch.candidate_to_request
    with torch.no_grad():
        want = model(**replicated(kwargs, index))
        got = cm(**nested, candidate_to_request=index)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # under autograd the call is not cut: padded to the longest history, still exact
    torch.testing.assert_close(
        cm(**nested, candidate_to_request=index).detach(), want, rtol=1e-5, atol=1e-5
    )


def test_nested_histories_a_model_reads_padded_are_padded_to_the_longest():
    model = Pooled("mean").eval()
    cm = _compiled_pooled(model)
    hist, lengths, item, index = _pooled_call([3, 1, 4, 2], 1, 16)
    with torch.no_grad():
        want = model(hist[index], item)  # padded to the longest (16, row 0)
        got = cm(hist=_nested(hist, lengths), item=item, candidate_to_request=index)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_misused_nested_histories_are_refused_naming_the_input(compiled, with_lengths):
    _, cm = compiled
    batch = din.make_batch([2, 3, 1], seed=31)
    kwargs = heavy_tailed(batch, 31, width=32)
    index = batch.candidate_to_request
    lengths = _din_lengths(kwargs)
    nested = {n: _nested(kwargs[n], lengths) for n in ("hist_item_ids", "hist_cat_ids")}
    values = nested["hist_item_ids"].values()
    shuffled = torch.tensor([0, int(lengths[0]) + 1, int(lengths[0]), int(lengths.sum())])
    bad = {
        **kwargs,
        **nested,
        "hist_item_ids": torch.nested.nested_tensor_from_jagged(values, shuffled),
    }
    with (
        torch.no_grad(),
        pytest.raises(InputError, match="'hist_item_ids' has offsets that are not monotone"),
    ):
        cm(**bad, candidate_to_request=index)
    shorter = lengths.clone()
    shorter[1] = max(int(shorter[1]) - 1, 0)
    cats = _nested(kwargs["hist_cat_ids"], shorter)
    with (
        torch.no_grad(),
        pytest.raises(
            InputError,
            match="'hist_cat_ids' disagrees with the lengths of 'hist_item_ids' at row 1",
        ),
    ):
        cm(**{**kwargs, **nested, "hist_cat_ids": cats}, candidate_to_request=index)
    with torch.no_grad(), pytest.raises(InputError, match="nested tensors and .*'hist_cat_ids'"):
        cm(**{**kwargs, "hist_item_ids": nested["hist_item_ids"]}, candidate_to_request=index)
    # a lengths input that disagrees with the nested ids
    model, cm = with_lengths
    hist, hist_len, item, index = _pooled_call([3, 1, 4], 4, 16)
    wrong = hist_len.clone()
    wrong[2] += 1
    with (
        torch.no_grad(),
        pytest.raises(InputError, match="'hist_len' disagrees with the lengths of 'hist' at row 2"),
    ):
        cm(hist=_nested(hist, hist_len), hist_len=wrong, item=item, candidate_to_request=index)


def test_target_attention_runs_jagged_up_to_its_cap(free_calls):
    """A transformer over the history with a key-padding mask, then target attention: each
    request's encoded history is the same cut to its length (softmax over masked keys)."""
    from dynamic_histories import CAPPED

    zoo = CAPPED["target_attention"]
    model = zoo.model()
    cm = zoo.compile(model)
    assert cm._jagged.truncation is not None, cm.jagged_refused
    for seed in range(2):
        kwargs, index, as_replicated = zoo.call(zoo.cap, seed=50 + seed)
        ids = kwargs["hist_item_ids"]
        lengths = torch.randint(
            1, 9, (ids.shape[0],), generator=torch.Generator().manual_seed(seed)
        )
        lengths[0] = zoo.cap
        kwargs["hist_item_ids"] = ids.clamp(min=1).masked_fill(
            torch.arange(zoo.cap) >= lengths[:, None], 0
        )
        as_replicated = replicated(kwargs, index)
        before = cm._jagged.split_calls
        with torch.no_grad():
            want = model(**as_replicated)
            got = cm(**kwargs, candidate_to_request=index)
        assert want.std() > 1e-1
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert cm._jagged.split_calls == before + (ids.shape[0] > 1)


def test_hstu_keeps_its_width_because_its_candidate_sits_at_position_L():
    """HSTU places the candidate after the padded history (position L): cutting the history
    moves it, and the proof refuses; eager's own answer does change when cut."""
    from dynamic_histories import CAPPED

    zoo = CAPPED["hstu"]
    model = zoo.model()
    cm = zoo.compile(model)
    assert cm._jagged.truncation is None and "slice" in cm.jagged_refused
    kwargs, index, as_replicated = zoo.call(12, seed=3)
    wider = {
        n: torch.nn.functional.pad(v, (0, 4)) if n in ("hist_item_ids", "hist_actions") else v
        for n, v in as_replicated.items()
    }  # the same histories, four more padded positions
    with torch.no_grad():
        assert not torch.allclose(model(**wider), model(**as_replicated), atol=1e-4)


def test_an_example_with_nested_histories_compiles_a_model_of_every_length():
    """No mark needed: an example whose histories are jagged nested tensors is padded with 0 and
    its length made dynamic; calls then take nested or padded histories of any length."""
    model = din_model()
    batch = din.make_batch([4, 3])
    example = batch.replicated()
    lengths = _din_lengths(example)
    for name in ("hist_item_ids", "hist_cat_ids"):
        example[name] = _nested(example[name], lengths)
    cm = rocs.compile(model, list(din.REQUEST_INPUTS), example_kwargs=example)
    assert cm._jagged.truncation is not None
    batch = din.make_batch([3, 5, 1], seed=60, shuffle=True)
    kwargs = heavy_tailed(batch, 60, width=100)
    index = batch.candidate_to_request
    with torch.no_grad():
        want = model(**replicated(kwargs, index))
        torch.testing.assert_close(
            cm(**kwargs, candidate_to_request=index), want, rtol=1e-5, atol=1e-5
        )
        lengths = _din_lengths(kwargs)
        nested = {
            **kwargs,
            **{n: _nested(kwargs[n], lengths) for n in ("hist_item_ids", "hist_cat_ids")},
        }
        torch.testing.assert_close(
            cm(**nested, candidate_to_request=index), want, rtol=1e-5, atol=1e-5
        )


@pytest.mark.parametrize("layout", ["shared", "dropin"])
def test_a_training_compile_gives_eagers_gradients_on_jagged_calls(layout):
    """Under autograd a training compile's call splits too: each group's call backpropagates
    into the model's parameters, and their sum is eager's gradient on the padded batch."""
    model, twin = din_model(), din_model()
    cm = rocs.compile(
        model, list(din.REQUEST_INPUTS), example_kwargs=marked_example(), training=True
    )
    assert cm._jagged.truncation is not None, cm.jagged_refused
    for seed in range(2):
        batch = din.make_batch([5, 1, 7, 3][: 3 + seed], seed=70 + seed, shuffle=True)
        kwargs = heavy_tailed(batch, 70 + seed)
        index = batch.candidate_to_request
        as_replicated = replicated(kwargs, index)
        model.zero_grad(), twin.zero_grad()
        before = cm._jagged.split_calls
        want = twin(**as_replicated)
        got = (
            cm(**kwargs, candidate_to_request=index) if layout == "shared" else cm(**as_replicated)
        )
        assert cm._jagged.split_calls == before + 1
        assert_eagers_gradients(model, twin, got, want)


def test_a_model_that_draws_random_numbers_keeps_its_width():
    """Dropout in training mode: a group's draws would not be the padded call's."""
    model = Pooled("masked_sum").train()
    model.proj = torch.nn.Sequential(model.proj, torch.nn.Dropout(0.1))
    with pytest.warns(UserWarning, match="draw random numbers"):
        cm = _compiled_pooled(model, training=True)
    assert cm._jagged.truncation is None and "draws random numbers" in cm.jagged_refused


class _DictPooled(torch.nn.Module):
    """:class:`Pooled` taking its inputs in one dict, as batch-dict models do."""

    def __init__(self):
        super().__init__()
        self.pooled = Pooled("softmax")

    def forward(self, batch: dict):
        return self.pooled(batch["hist"], batch["item"])


@pytest.mark.parametrize("layout", ["shared", "dropin"])
def test_a_history_inside_a_dict_input_runs_in_groups(layout, free_calls):
    """The history is a leaf of a dict argument (``batch.hist``): the call is cut on its leaves
    and each group's call rebuilt as a dict, exact against the original."""
    model = _DictPooled().eval()
    hist, _, item, index = _pooled_call([2, 3, 1], 0, 8)
    example = {"hist": hist[index], "item": item}
    torch._dynamo.mark_dynamic(example["hist"], 1)
    cm = rocs.compile(model, ["batch.hist"], example_kwargs={"batch": example})
    assert cm._jagged.truncation is not None, cm.jagged_refused
    hist, _, item, index = _pooled_call([3, 1, 4, 2, 5], 1, 64)
    with torch.no_grad():
        want = model({"hist": hist[index], "item": item})
        before = cm._jagged.split_calls
        if layout == "shared":
            got = cm({"hist": hist, "item": item}, candidate_to_request=index)
        else:
            got = cm({"hist": hist[index], "item": item})
    assert cm._jagged.split_calls == before + 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
