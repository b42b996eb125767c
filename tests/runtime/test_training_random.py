"""Dropout in a training compile draws eager's masks from the same generator state.

A CPU dropout's mask depends on its input's memory order (``passes/random_layouts.py``): these
models hand a dropout a transposed value (request-side and candidate-side), once with an
in-place op that makes capture functionalize (``native_dropout``). The oracle is eager on the
replicated batch, seeded the same way: outputs equal, and the generator state after the call.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import rocs_compiler as rocs

D, L = 8, 5
INDEX = torch.tensor([2, 0, 1, 0, 1, 2, 2, 2])


class _TransposedRequest(nn.Module):
    """Dropout on a request value held transposed, ``[B, D, L]`` with ``L`` innermost in memory."""

    def __init__(self, in_place: bool = False):
        super().__init__()
        self.in_place = in_place
        self.enc, self.item, self.head = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(2 * D, 1)
        self.drop = nn.Dropout(0.5)

    def forward(self, hist, item):
        h = self.enc(hist).transpose(1, 2)
        if self.in_place:
            h = h.clone()
            h[:, 0] = 0.0
        h = self.drop(torch.relu(h)).mean(-1)
        return self.head(torch.cat([h, self.item(item)], -1))


class _TransposedCandidate(nn.Module):
    """Dropout on a candidate value computed in ``[L, B, D]`` and read as ``[B, L, D]``."""

    def __init__(self):
        super().__init__()
        self.enc, self.item, self.head = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, 1)
        self.drop = nn.Dropout(0.5)

    def forward(self, hist, item):
        x = self.enc(hist).transpose(0, 1) * self.item(item)[None]
        return self.head(self.drop(x.transpose(0, 1)).mean(1))


def _compiled(build, **options):
    """(model in training mode, its training compile, history [3, L, D], items [N, D])."""
    torch.manual_seed(0)
    model = build().train()
    gen = torch.Generator().manual_seed(1)
    hist, item = torch.randn(3, L, D, generator=gen), torch.randn(len(INDEX), D, generator=gen)
    cm = rocs.compile(
        model, ["hist"], example_kwargs=dict(hist=hist[INDEX], item=item), training=True,
        options={"autotune": False, **options},
    )  # fmt: skip
    return model, cm, hist, item


@pytest.mark.parametrize(
    "build",
    [_TransposedRequest, lambda: _TransposedRequest(in_place=True), _TransposedCandidate],
    ids=["transposed_request", "functionalized", "transposed_candidate"],
)
def test_dropout_masks_are_eagers(build):
    model, cm, hist, item = _compiled(build)
    torch.manual_seed(7)
    want = model(hist[INDEX], item)
    state = torch.get_rng_state()
    for call in (
        lambda: cm(hist=hist, item=item, candidate_to_request=INDEX),
        lambda: cm(hist=hist[INDEX], item=item),
    ):
        torch.manual_seed(7)
        got = call()
        assert torch.equal(torch.get_rng_state(), state)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


class _HistoryEncoder(nn.Module):
    """torch's encoder (attention dropout 0.1, its default) over the history, scored against the
    candidate; the pooled history is an output too."""

    def __init__(self, dropout: float = 0.1):
        super().__init__()
        layer = nn.TransformerEncoderLayer(D, 2, 2 * D, dropout=dropout, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.item, self.head = nn.Linear(D, D), nn.Linear(2 * D, 1)

    def forward(self, hist, item):
        h = self.enc(hist).mean(1)
        return self.head(torch.cat([h, self.item(item)], -1)), h


def test_attention_dropout_falls_back_per_impression_with_one_warning():
    """Default: the attention with dropout runs per impression (eager's draws), the request-side
    projections before it stay shared, and the compile warns once naming the layer."""
    with pytest.warns(UserWarning, match=r"enc\.layers\.0\.self_attn \(attention dropout") as seen:
        model, cm, hist, item = _compiled(_HistoryEncoder)
    assert len([w for w in seen if "draw random numbers" in str(w.message)]) == 1
    report = cm.report()
    assert [(f.module, f.reason) for f in report.fallbacks] == [
        ("enc.layers.0.self_attn", "attention dropout is random")
    ]
    shared = {n.op for n in report.nodes if n.role == "REQUEST" and "layers.0" in n.module}
    assert "aten.linear.default" in shared  # the packed q/k/v projection
    torch.manual_seed(3)
    want = model(hist[INDEX], item)
    torch.manual_seed(3)
    got = cm(hist=hist, item=item, candidate_to_request=INDEX)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def _shares_the_whole_encoder(cm) -> None:
    report = cm.report()
    assert report.fallbacks == []
    assert all(n.role == "REQUEST" for n in report.nodes if n.module.startswith("enc."))


def test_a_dropout_of_zero_draws_nothing_and_is_shared():
    """``p=0`` in training mode returns its input without drawing: row-wise, no warning."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model, cm, hist, item = _compiled(lambda: _HistoryEncoder(dropout=0.0))
    _shares_the_whole_encoder(cm)
    want = model(hist[INDEX], item)
    got = cm(hist=hist, item=item, candidate_to_request=INDEX)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_per_request_dropout_covers_attention_dropout():
    """``request_dropout="per_request"``: the whole encoder runs once per request, so every
    impression of a request sees one mask; no fallback, no warning."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model, cm, hist, item = _compiled(_HistoryEncoder, request_dropout="per_request")
    _shares_the_whole_encoder(cm)
    torch.manual_seed(3)
    _, pooled = cm(hist=hist, item=item, candidate_to_request=INDEX)
    for r in range(3):
        rows = pooled[INDEX == r]
        torch.testing.assert_close(rows, rows[:1].expand_as(rows), rtol=0, atol=0)
    torch.manual_seed(3)
    _, again = cm(hist=hist, item=item, candidate_to_request=INDEX)
    torch.testing.assert_close(again, pooled)  # the same draws from the same seed
