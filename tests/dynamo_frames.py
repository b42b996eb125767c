"""What the tests of the compiled frames share (``backend/compiled_frame.py`` and its users): a
fresh dynamo around each test, and a small scorer with its inputs."""

from __future__ import annotations

import pytest
import torch
from torch import nn


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches emptied before and after the test."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Scorer(nn.Module):
    """Request rows through two linears, gathered to candidates:
    ``(head(relu(hidden(x)))[index],)``."""

    def __init__(self):
        super().__init__()
        self.hidden, self.head = nn.Linear(6, 16), nn.Linear(16, 1)

    def forward(self, x, index):
        return (self.head(torch.relu(self.hidden(x))).index_select(0, index),)


def scorer_inputs(rows: int, candidates: int, dtype=torch.float32, seed: int = 0):
    """``x`` [rows, 6] and an index [candidates] into its rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 6, generator=g).to(dtype)
    return x, torch.randint(0, rows, (candidates,), generator=g)
