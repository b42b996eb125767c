"""Bad inputs and untraceable models give clear errors, before any compute runs."""

from __future__ import annotations

import warnings

import pytest
import torch
from models_for_tests import (
    DICT_FEATURES,
    OPTIONS,
    USER_ITEM_MLP,
    D,
    assert_outputs_match,
    eager,
)
from torch import nn

import rocs_compiler as rocs

R, N = 3, 7
INDEX = torch.tensor([0, 2, 2, 1, 0, 2, 1])


class Spy(nn.Module):
    """Stands in for the compiled graph and counts how often it runs."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, *args):
        self.calls += 1
        return self.inner(*args)


@pytest.fixture(scope="module")
def compiled():
    model = USER_ITEM_MLP.build()
    return model, USER_ITEM_MLP.compile(model)


@pytest.fixture
def spied(compiled):
    _model, cm = compiled
    graph = cm.graph_module
    spy = Spy(graph)
    cm.graph_module = spy
    try:
        yield cm, spy
    finally:
        cm.graph_module = graph


def shared_inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return {
        "user": torch.randn(R, D, generator=g),
        "user_ids": torch.randint(0, 50, (R,), generator=g),
        "item": torch.randn(N, D, generator=g),
    }


def replicated_inputs(seed: int = 0):
    kw = shared_inputs(seed)
    return {"user": kw["user"][INDEX], "user_ids": kw["user_ids"][INDEX], "item": kw["item"]}


# ------------------------------------------------------------------------------------------
# Compile-time errors


def test_unknown_request_input_lists_valid_names():
    model = USER_ITEM_MLP.build()
    example = replicated_inputs()
    with pytest.raises(rocs.InputError) as err:
        rocs.compile(model, ["usr"], example_kwargs=example, options=OPTIONS)
    message = str(err.value)
    assert "usr" in message
    for name in ("user", "user_ids", "item"):
        assert name in message, f"valid name {name!r} not listed: {message}"


def test_unknown_dotted_request_input_lists_valid_names():
    example = DICT_FEATURES.batch([2, 1]).replicated()
    with pytest.raises(rocs.InputError) as err:
        rocs.compile(
            DICT_FEATURES.build(), ["features.user_nope"], example_kwargs=example, options=OPTIONS
        )
    assert "features.user_nope" in str(err.value)
    assert "features.user_age" in str(err.value)


def test_training_mode_is_rejected():
    model = USER_ITEM_MLP.build().train()
    with pytest.raises(rocs.InputError, match=r"eval"):
        rocs.compile(
            model, ["user", "user_ids"], example_kwargs=replicated_inputs(), options=OPTIONS
        )


def test_unknown_fallback_mode():
    with pytest.raises(ValueError, match="fallback"):
        rocs.compile(
            USER_ITEM_MLP.build(), ["user"], example_kwargs=replicated_inputs(), fallback="maybe"
        )


# ------------------------------------------------------------------------------------------
# Call-time errors: each must raise InputError with a clear message and run nothing


def _without(d, name):
    return {k: v for k, v in d.items() if k != name}


def _bad_calls():
    sh, rep = shared_inputs(), replicated_inputs()
    idx = INDEX
    return {
        "missing_input_dropin": (_without(rep, "item"), r"missing.*item"),
        "missing_input_shared": (
            {**_without(sh, "user_ids"), "candidate_to_request": idx},
            r"missing.*user_ids",
        ),
        "unknown_extra_input": ({**rep, "extra": torch.zeros(N)}, r"extra"),
        "index_too_large": (
            {**sh, "candidate_to_request": torch.tensor([0, 1, 2, 3, 0, 0, 1])},
            r"candidate_to_request.*\[0, 3\)",
        ),
        "index_negative": (
            {**sh, "candidate_to_request": torch.tensor([0, 1, 2, -1, 0, 0, 1])},
            r"candidate_to_request",
        ),
        "index_int32": (
            {**sh, "candidate_to_request": idx.to(torch.int32)},
            r"candidate_to_request.*int64",
        ),
        "index_float": (
            {**sh, "candidate_to_request": idx.float()},
            r"candidate_to_request.*int64",
        ),
        "index_bool": ({**sh, "candidate_to_request": idx > 0}, r"candidate_to_request.*int64"),
        "index_too_long": (
            {**sh, "candidate_to_request": torch.cat([idx, idx[:1]])},
            r"candidate_to_request.*8.*7",
        ),
        "index_too_short": (
            {**sh, "candidate_to_request": idx[:-1]},
            r"candidate_to_request.*6.*7",
        ),
        "index_2d": ({**sh, "candidate_to_request": idx.view(1, -1)}, r"candidate_to_request.*1-D"),
        "index_list": (
            {**sh, "candidate_to_request": idx.tolist()},
            r"candidate_to_request.*Tensor",
        ),
        "request_rows_below_R": (
            {
                **sh,
                "user": sh["user"][:2],
                "user_ids": sh["user_ids"][:2],
                "candidate_to_request": idx,
            },
            r"\[0, 2\)",
        ),
        "request_inputs_disagree_on_R": (
            {**sh, "user": torch.randn(R + 1, D), "candidate_to_request": idx},
            r"user.*user_ids|disagree",
        ),
        "candidate_inputs_disagree": (
            {**sh, "item": torch.randn(N + 1, D), "candidate_to_request": idx},
            r"candidate_to_request|rows",
        ),
        "dropin_rows_disagree": ({**rep, "item": torch.randn(N - 1, D)}, r"unbatched_inputs"),
        "dropin_rows_disagree_as_if_shared": (
            {**rep, "item": torch.randn(N + 1, D)},
            r"missing.*or give every input 8 rows",
        ),
        # R request rows and N > R candidate rows: a shared-layout call that forgot the index.
        "shared_layout_without_the_index": (sh, r"candidate_to_request is missing.*int64 \[7\]"),
        "replicated_request_inputs_with_an_index": (
            {**rep, "candidate_to_request": idx},
            r"one row per request.*call_replicated",
        ),
    }


BAD_CALLS = list(_bad_calls())


@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_call_raises_before_compute(spied, case):
    cm, spy = spied
    kwargs, pattern = _bad_calls()[case]
    with pytest.raises(rocs.InputError, match=pattern):
        cm(**kwargs)
    assert spy.calls == 0, "the graph ran before the inputs were checked"


def test_good_calls_reach_the_graph(spied, compiled):
    model, _ = compiled
    cm, spy = spied
    expected = eager(model, replicated_inputs())
    assert_outputs_match(cm(**replicated_inputs()), expected, "drop-in")
    assert_outputs_match(cm(**shared_inputs(), candidate_to_request=INDEX), expected, "shared")
    assert spy.calls == 2


def test_missing_and_unknown_dict_keys():
    model = DICT_FEATURES.build()
    cm = DICT_FEATURES.compile(model)
    features = DICT_FEATURES.batch([2, 2]).replicated()["features"]
    partial = {k: v for k, v in features.items() if k != "item_dense"}
    with pytest.raises(rocs.InputError, match=r"features\.item_dense"):
        cm(features=partial)
    extra = {**features, "bogus": torch.zeros(4)}
    with pytest.raises(rocs.InputError) as err:
        cm(features=extra)
    assert "features.bogus" in str(err.value) and "features.user_age" in str(err.value)


# ------------------------------------------------------------------------------------------
# call_replicated: replicated request inputs with a known grouping


def test_call_replicated_names_a_request_input_that_varies_within_a_request(compiled):
    _, cm = compiled
    rep = replicated_inputs()
    rep["user_ids"] = rep["user_ids"].clone()
    rep["user_ids"][4] += 1  # candidate 4 belongs to request 0, like candidate 0
    with pytest.raises(rocs.InputError, match="user_ids"):
        cm.call_replicated(**rep, candidate_to_request=INDEX)
    rep = replicated_inputs()
    rep["user"] = rep["user"].clone()
    rep["user"][5, 2] = float("nan")
    with pytest.raises(rocs.InputError, match="'user'"):
        cm.call_replicated(**rep, candidate_to_request=INDEX)


def test_call_replicated_passes_when_constant_within_requests(compiled):
    model, cm = compiled
    expected = eager(model, replicated_inputs())
    got = cm.call_replicated(**replicated_inputs(), candidate_to_request=INDEX)
    assert_outputs_match(got, expected, "call_replicated")


def test_call_replicated_refuses_request_inputs_with_one_row_per_request(compiled):
    _, cm = compiled
    with pytest.raises(rocs.InputError, match="one row per candidate"):
        cm.call_replicated(**shared_inputs(), candidate_to_request=INDEX)


def test_shared_layout_accepts_a_request_without_candidates(compiled):
    """A shared batch may hold a request with no candidates (here the last one)."""
    model, cm = compiled
    sh = shared_inputs()
    index = torch.tensor([0, 1, 1, 0, 0, 1, 1])  # request 2 has no candidates
    rep = {"user": sh["user"][index], "user_ids": sh["user_ids"][index], "item": sh["item"]}
    assert_outputs_match(cm(**sh, candidate_to_request=index), eager(model, rep), "shared")
    got = cm.call_replicated(**rep, candidate_to_request=index)
    assert_outputs_match(got, eager(model, rep), "call_replicated")


def test_one_candidate_per_request_is_the_shared_layout():
    """R = N is legal when every candidate is its own request, in any order."""
    model = USER_ITEM_MLP.build()
    cm = USER_ITEM_MLP.compile(model)
    batch = USER_ITEM_MLP.batch([1, 1, 1, 1])
    order = torch.tensor([2, 0, 3, 1])
    replicated = batch.replicated()
    shared = {k: (v[order] if k in USER_ITEM_MLP.request_inputs else v) for k, v in replicated.items()}
    index = torch.argsort(order)
    got = cm(**shared, candidate_to_request=index)
    assert_outputs_match(got, eager(model, replicated), "R = N shared")


# ------------------------------------------------------------------------------------------
# Non-tensor inputs are fixed at compile time


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, user, item, scale: float = 1.0):
        return self.lin(user) * scale + item


def _scaled_inputs():
    g = torch.Generator().manual_seed(3)
    return torch.randn(N, D, generator=g)[INDEX], torch.randn(N, D, generator=g)


def test_non_tensor_input_differing_from_compile_time_is_rejected():
    model = Scaled().eval()
    user, item = _scaled_inputs()
    cm = rocs.compile(
        model, ["user"], example_kwargs={"user": user, "item": item, "scale": 2.0}, options=OPTIONS
    )
    assert_outputs_match(
        cm(user=user, item=item, scale=2.0),
        eager(model, {"user": user, "item": item, "scale": 2.0}),
    )
    with pytest.raises(rocs.InputError, match=r"scale"):
        cm(user=user, item=item, scale=3.0)


def test_non_tensor_input_given_at_call_but_defaulted_at_compile_time():
    """Compiled with ``scale`` left at its default 1.0, called with scale=3.0: must not silently
    compute with 1.0."""
    model = Scaled().eval()
    user, item = _scaled_inputs()
    cm = rocs.compile(model, ["user"], example_kwargs={"user": user, "item": item}, options=OPTIONS)
    expected = eager(model, {"user": user, "item": item, "scale": 3.0})
    try:
        got = cm(user=user, item=item, scale=3.0)
    except rocs.InputError:
        return  # a clear error is fine
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-5), (
        "scale=3.0 was silently ignored: the compiled model kept the default scale=1.0 it saw at "
        "compile time (defaults are not bound when comparing non-tensor inputs)"
    )


def test_non_tensor_input_omitted_at_call_but_given_at_compile_time():
    """Compiled with scale=2.0, called without ``scale`` (the model's default is 1.0)."""
    model = Scaled().eval()
    user, item = _scaled_inputs()
    cm = rocs.compile(
        model, ["user"], example_kwargs={"user": user, "item": item, "scale": 2.0}, options=OPTIONS
    )
    expected = eager(model, {"user": user, "item": item})
    try:
        got = cm(user=user, item=item)
    except rocs.InputError:
        return
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-5), (
        "calling without scale (default 1.0) silently used scale=2.0 from compile time"
    )


# ------------------------------------------------------------------------------------------
# Untraceable models


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.calls = 0

    def forward(self, user, item):
        self.calls += 1
        if user.sum() > 0:
            return self.lin(user) + item
        return self.lin(user) - item


def test_untraceable_model_raises_compile_error_naming_the_route():
    user, item = _scaled_inputs()
    with pytest.raises(rocs.CompileError) as err:
        rocs.compile(
            DataDependent().eval(),
            ["user"],
            example_kwargs={"user": user, "item": item},
            options=OPTIONS,
        )
    message = str(err.value)
    assert "export (non-strict)" in message and "export (strict)" in message, message
    assert "data-dependent" in message.lower(), message


def test_eager_fallback_warns_once_and_matches_the_original():
    model = DataDependent().eval()
    user, item = _scaled_inputs()
    with pytest.warns(UserWarning, match="rocs"):
        cm = rocs.compile(
            model,
            ["user"],
            example_kwargs={"user": user, "item": item},
            fallback="eager",
            options=OPTIONS,
        )
    assert cm.is_fallback
    g = torch.Generator().manual_seed(9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for sign in (1.0, -1.0, 1.0):
            u_shared = sign * torch.randn(R, D, generator=g).abs()
            c = torch.randn(N, D, generator=g)
            expected = eager(model, {"user": u_shared[INDEX], "item": c})
            assert_outputs_match(cm(user=u_shared[INDEX], item=c), expected, "fallback drop-in")
            got = cm(user=u_shared, item=c, candidate_to_request=INDEX)
            assert_outputs_match(got, expected, "fallback shared layout")
    rocs_warnings = [w for w in caught if "rocs" in str(w.message)]
    assert len(rocs_warnings) == 1, [str(w.message) for w in rocs_warnings]


def test_eager_fallback_still_checks_inputs():
    model = DataDependent().eval()
    user, item = _scaled_inputs()
    with pytest.warns(UserWarning):
        cm = rocs.compile(
            model, ["user"], example_kwargs={"user": user, "item": item}, fallback="eager"
        )
    calls = model.calls
    with pytest.raises(rocs.InputError, match="candidate_to_request"):
        cm(user=user[:R], item=item, candidate_to_request=INDEX.to(torch.int32))
    with pytest.raises(rocs.InputError, match="missing"):
        cm(user=user)
    assert model.calls == calls, "the original model ran on bad inputs"


# ------------------------------------------------------------------------------------------
# Impure models and reserved names


class CountingBuffer(nn.Module):
    """Mutates a buffer in forward: its output changes from call to call."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, user, item):
        self.calls += 1
        return self.lin(user) + item + self.calls


def test_model_mutating_a_buffer_is_rejected():
    user, item = _scaled_inputs()
    try:
        cm = rocs.compile(
            CountingBuffer().eval(),
            ["user"],
            example_kwargs={"user": user, "item": item},
            options=OPTIONS,
        )
    except rocs.CompileError as err:
        assert "mutat" in str(err)
        return
    raise AssertionError(
        "a forward that mutates a buffer compiled (capture.py checks buffers_to_mutate, which the "
        "non-functional export graph leaves empty; the in-place add_ stays in the graph and "
        f"updates the compiled model's own copy of the buffer):\n{cm.graph_module.code}"
    )


class InPlaceOnInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, user, item):
        user.mul_(2)
        return self.lin(user) + item


def test_model_mutating_an_input_is_rejected_or_exact():
    user, item = _scaled_inputs()
    model = InPlaceOnInput().eval()
    try:
        cm = rocs.compile(
            model, ["user"], example_kwargs={"user": user.clone(), "item": item}, options=OPTIONS
        )
    except rocs.CompileError:
        return
    expected = eager(model, {"user": user.clone(), "item": item})
    assert_outputs_match(cm(user=user.clone(), item=item), expected, "drop-in")
    got = cm(
        user=user[:R].clone(),
        item=item[: len(INDEX)],
        candidate_to_request=torch.zeros(len(INDEX), dtype=torch.long),
    )
    expected = eager(
        model, {"user": user[:1].clone().expand(len(INDEX), -1).clone(), "item": item[: len(INDEX)]}
    )
    assert_outputs_match(got, expected, "shared layout")


class RenormingEmbedding(nn.Module):
    """A request-side table with ``max_norm``: every lookup renormalizes its rows in place (the
    functionalized write became a graph output, returned as a [20, 8] tensor instead of [N])."""

    def __init__(self, functional: bool = False):
        super().__init__()
        self.functional = functional
        self.user = nn.Embedding(20, D, max_norm=None if functional else 1.0)
        self.item = nn.Embedding(30, D)
        with torch.no_grad():
            self.user.weight.mul_(5)  # rows exceed the norm

    def forward(self, user_id, item_id):
        if self.functional:
            u = torch.nn.functional.embedding(user_id, self.user.weight, max_norm=1.0)
        else:
            u = self.user(user_id)
        return (u * self.item(item_id)).sum(-1)


def _renorm_example():
    gen = torch.Generator().manual_seed(0)
    users = torch.randint(0, 20, (R,), generator=gen)
    return {"user_id": users[INDEX], "item_id": torch.randint(0, 30, (N,), generator=gen)}


def test_embedding_with_max_norm_is_refused_naming_the_module_before_it_runs():
    model = RenormingEmbedding().eval()
    before = model.user.weight.detach().clone()
    named = r"module 'user' \(Embedding\(max_norm=1.0\)\)"
    with pytest.raises(rocs.CompileError, match=named) as err:
        rocs.compile(model, ["user_id"], example_kwargs=_renorm_example(), options=OPTIONS)
    assert "torch.renorm(model.user.weight" in str(err.value)  # the fix
    assert torch.equal(model.user.weight, before), "compiling renormalized the caller's weights"


def test_functional_embedding_with_max_norm_is_refused_naming_the_parameter():
    model = RenormingEmbedding(functional=True).eval()
    with pytest.raises(rocs.CompileError, match=r"mutates parameter 'user.weight'.*max_norm"):
        rocs.compile(model, ["user_id"], example_kwargs=_renorm_example(), options=OPTIONS)


def test_the_suggested_fix_compiles_and_matches_the_renorming_model():
    model, fixed = RenormingEmbedding().eval(), RenormingEmbedding().eval()
    fixed.load_state_dict(model.state_dict())
    table = fixed.user
    with torch.no_grad():
        table.weight.copy_(torch.renorm(table.weight, table.norm_type, 0, table.max_norm))
    table.max_norm = None
    example = _renorm_example()
    cm = rocs.compile(fixed, ["user_id"], example_kwargs=example, options=OPTIONS)
    with torch.no_grad():
        expected = model(**example)
        assert_outputs_match(cm(**example), expected, "drop-in")
        shared = {"user_id": example["user_id"][[0, 3, 1]], "item_id": example["item_id"]}
        assert_outputs_match(cm(**shared, candidate_to_request=INDEX), expected, "shared layout")


class ReservedName(nn.Module):
    def forward(self, user, item, candidate_to_request):
        return user + item * candidate_to_request


def test_input_named_like_the_index_is_a_clear_error():
    user, item = _scaled_inputs()
    example = {"user": user, "item": item, "candidate_to_request": item.clone()}
    try:
        rocs.compile(ReservedName().eval(), ["user"], example_kwargs=example, options=OPTIONS)
    except (rocs.CompileError, rocs.InputError) as err:
        assert "candidate_to_request" in str(err)
    except Exception as err:  # noqa: BLE001
        raise AssertionError(
            f"an input named candidate_to_request raises {type(err).__name__} from the share pass "
            "instead of rocs.CompileError / rocs.InputError"
        ) from None
    else:
        raise AssertionError("an input named candidate_to_request was accepted")


@pytest.mark.parametrize("shape", [(3, D), (3,), ()], ids=["rows_not_n", "1d_not_n", "scalar"])
def test_request_input_without_batch_dim_is_rejected(shape):
    _, item = _scaled_inputs()
    with pytest.raises(rocs.InputError, match="user"):
        rocs.compile(
            Scaled().eval(),
            ["user"],
            example_kwargs={"user": torch.randn(shape), "item": item},
            options=OPTIONS,
        )


def test_the_eager_fallback_warning_does_not_advise_the_fallback_it_took():
    """The capture error's advice to pass ``fallback="eager"`` is left out of what a model
    compiled with it says: the warning, the call-time warning and the report."""
    user, item = _scaled_inputs()
    with pytest.warns(UserWarning) as compiled:
        cm = rocs.compile(
            DataDependent().eval(), ["user"], example_kwargs={"user": user, "item": item},
            fallback="eager", options=OPTIONS,
        )  # fmt: skip
    with pytest.warns(UserWarning) as called:
        cm(user=user, item=item)
    said = [str(w.message) for w in [*compiled, *called]] + [str(cm.report().fallbacks)]
    for text in said:
        assert "fallback" not in text.replace('(fallback="eager")', ""), text
    assert "data-dependent" in said[0] and "torch.where" in said[0], said[0]
    assert 'fallback="eager"' in said[0]  # says why it runs eagerly
