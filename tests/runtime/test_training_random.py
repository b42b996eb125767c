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


@pytest.mark.parametrize(
    "build",
    [_TransposedRequest, lambda: _TransposedRequest(in_place=True), _TransposedCandidate],
    ids=["transposed_request", "functionalized", "transposed_candidate"],
)
def test_dropout_masks_are_eagers(build):
    torch.manual_seed(0)
    model = build().train()
    gen = torch.Generator().manual_seed(1)
    hist, item = torch.randn(3, L, D, generator=gen), torch.randn(len(INDEX), D, generator=gen)
    cm = rocs.compile(
        model, ["hist"], example_kwargs=dict(hist=hist[INDEX], item=item), training=True,
        options={"autotune": False},
    )  # fmt: skip
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
