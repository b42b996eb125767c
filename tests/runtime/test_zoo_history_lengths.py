"""Histories of any length in the zoo: target attention and HSTU, compiled once from an example
whose history length is marked dynamic, serve every length from 1 to their cap (the rows of
their positional table) exact against the original model in both layouts on ragged batches, for
inference and training compiles; a longer history is refused at call time naming the input, its
length and the cap (``runtime/call/input_checks.py``), never a deep error or a silent truncation.
DIN, whose length nothing caps, and BST, whose head reads a fixed number of positions (marking its
length is refused at compile time): ``test_dynamic_lengths.py``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import rocs_compiler as rocs
from models_zoo import hstu, target_attention
from rocs_compiler.errors import InputError

from dynamic_histories import CAPPED, marked


@pytest.fixture(scope="module", params=sorted(CAPPED))
def compiled(request):
    zoo = CAPPED[request.param]
    model = zoo.model()
    return zoo, model, zoo.compile(model)


def test_the_caps_are_the_tables_rows():
    assert CAPPED["target_attention"].cap == target_attention.HIST_LEN == 64
    assert CAPPED["hstu"].cap == hstu.HIST_LEN == hstu.build().position.num_embeddings - 1


@pytest.mark.parametrize("layout", ["shared", "dropin"])
def test_one_compile_serves_every_length_up_to_the_cap(compiled, layout):
    zoo, model, cm = compiled
    runners = set()
    with torch.no_grad():
        for i, length in enumerate(zoo.lengths()):
            kwargs, index, as_replicated = zoo.call(length, seed=i)
            want = model(**as_replicated)
            got = (
                cm(**kwargs, candidate_to_request=index)
                if layout == "shared"
                else cm(**as_replicated)
            )
            assert want.std() > 1e-1 or want.numel() < 2
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"length {length}")
            runners.add((id(cm._runner), id(cm._plain._runner)))
    # One program for every length: neither the shared nor the plain program was built again
    # after the first call that ran it (None, until a lane first runs, then the one program).
    assert len({shared for shared, _ in runners} - {id(None)}) <= 1
    assert len({plain for _, plain in runners} - {id(None)}) <= 1
    assert runners != {(id(None), id(None))}


@pytest.mark.parametrize("past", [1, 40])
def test_a_history_past_the_cap_is_refused_naming_the_input_its_length_and_the_cap(compiled, past):
    zoo, model, cm = compiled
    length = zoo.cap + past
    kwargs, index, as_replicated = zoo.call(length, seed=3)
    message = rf"'hist_item_ids' has size {length} at dim 1.*at most {zoo.cap}"
    with torch.no_grad():
        with pytest.raises(InputError, match=message):
            cm(**kwargs, candidate_to_request=index)
        with pytest.raises(InputError, match=message):
            cm(**as_replicated)
        # The plain program's own checks, which a call settled on it makes instead.
        with pytest.raises(InputError, match=message):
            cm._plain.input_specs.check(as_replicated)
        # The cap itself is served.
        kwargs, index, as_replicated = zoo.call(zoo.cap, seed=3)
        torch.testing.assert_close(cm(**kwargs, candidate_to_request=index), model(**as_replicated))


def test_histories_the_model_ties_are_refused_when_they_disagree():
    zoo = CAPPED["hstu"]
    cm = zoo.compile(zoo.model())
    kwargs, index, _ = zoo.call(9, seed=4)
    kwargs["hist_actions"] = kwargs["hist_actions"][:, :5]
    with (
        torch.no_grad(),
        pytest.raises(InputError, match=r"'hist_item_ids' dim 1: 9.*'hist_actions' dim 1: 5"),
    ):
        cm(**kwargs, candidate_to_request=index)


@pytest.mark.parametrize("name", sorted(CAPPED))
def test_a_training_compile_gives_eagers_gradients_at_two_lengths(name):
    zoo = CAPPED[name]
    model, twin = zoo.model(), zoo.model()
    cm = zoo.compile(model, training=True)
    for layout in ("shared", "dropin"):
        for i, length in enumerate((5, zoo.cap)):
            kwargs, index, as_replicated = zoo.call(length, seed=10 + i)
            model.zero_grad(), twin.zero_grad()
            want = twin(**as_replicated)
            got = (
                cm(**kwargs, candidate_to_request=index)
                if layout == "shared"
                else cm(**as_replicated)
            )
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            (want * torch.linspace(-1, 1, want.shape[0])).sum().backward()
            (got * torch.linspace(-1, 1, got.shape[0])).sum().backward()
            for (p_name, p), q in zip(model.named_parameters(), twin.parameters()):
                if q.grad is None:
                    assert p.grad is None or not p.grad.any(), p_name
                    continue
                torch.testing.assert_close(
                    p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=f"{p_name} at {length}, {layout}"
                )
    kwargs, index, _ = zoo.call(zoo.cap + 1, seed=12)
    with pytest.raises(InputError, match=rf"'hist_item_ids'.*at most {zoo.cap}"):
        cm(**kwargs, candidate_to_request=index)


class SlicedTable(nn.Module):
    """A history plus the first L rows of a 6-row positional table: capped at 6."""

    def __init__(self):
        super().__init__()
        self.items = nn.Embedding(100, 8)
        self.position = nn.Parameter(torch.randn(6, 8))
        self.out = nn.Linear(8, 1)

    def forward(self, hist, item):
        pooled = (self.items(hist) + self.position[: hist.size(1)]).mean(1)
        return self.out(pooled * self.items(item)).squeeze(-1)


def test_a_size_the_model_caps_is_checked_in_every_call():
    model = SlicedTable().eval()
    example = marked(
        {"hist": torch.randint(1, 100, (4, 3)), "item": torch.randint(1, 100, (4,))}, ["hist"]
    )
    cm = rocs.compile(model, ["hist"], example_kwargs=example)
    index, item = torch.tensor([0, 0, 1, 1, 1]), torch.randint(1, 100, (5,))
    with torch.no_grad():
        for length in (1, 4, 6):
            hist = torch.randint(1, 100, (2, length))
            want = model(hist.index_select(0, index), item)
            torch.testing.assert_close(cm(hist, item, candidate_to_request=index), want)
        for length in (7, 50):
            hist = torch.randint(1, 100, (2, length))
            with pytest.raises(InputError, match=rf"'hist' has size {length} at dim 1.*at most 6"):
                cm(hist, item, candidate_to_request=index)


def test_hstus_dca_form_takes_every_length_up_to_the_cap_and_refuses_a_longer_one():
    """The DCA form reads its positions as a slice of the table (``models_zoo/dca_conversions.py``),
    so its graph caps the length where the table does: 24 events, the candidate's the 25th."""
    zoo = CAPPED["hstu"]
    with torch.no_grad():
        dca = rocs.apply_dca(zoo.model())
    cm = rocs.compile(dca, list(hstu.REQUEST_INPUTS), example_kwargs=zoo.example())
    with torch.no_grad():
        for i, length in enumerate((1, 7, zoo.cap)):
            kwargs, index, as_replicated = zoo.call(length, seed=40 + i)
            want = dca(**as_replicated)
            assert want.std() > 1e-1 or want.numel() < 2
            torch.testing.assert_close(
                cm(**kwargs, candidate_to_request=index), want, rtol=1e-5, atol=1e-5
            )
        kwargs, index, _ = zoo.call(zoo.cap + 1, seed=44)
        with pytest.raises(InputError, match=r"'hist_item_ids' has size 25 at dim 1.*at most 24"):
            cm(**kwargs, candidate_to_request=index)
