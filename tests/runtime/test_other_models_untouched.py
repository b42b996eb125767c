"""What the runtime installs process-wide leaves models it did not compile as they were.

The weight refresh counts module and parameter registrations with process-wide hooks, and follows
optimizer steps with a process-wide hook (``runtime/follow/weights.py``, ``runtime/follow/optimizer_writes.py``).
``torch.compile`` traces such hooks when a compiled forward makes a module (``self.seq[:2]``
makes a new ``nn.Sequential`` per call): they must add no guard that fails on the next call, and
no graph break.
"""

from __future__ import annotations

import torch
import torch._dynamo.utils
from torch import nn
from torch._dynamo.testing import CompileCounter

import rocs_compiler as rocs

torch.set_num_threads(1)


class _SlicedSequential(nn.Module):
    def __init__(self):
        super().__init__()
        self.seq = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))

    def forward(self, x):
        return self.seq[:2](x)


class _Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.h = nn.Linear(8, 3)

    def forward(self, u, c):
        return self.h(torch.cat([u, c], -1))


def _rocs_model():
    model = _Head().eval()
    u, c = torch.randn(2, 4)[[0, 0, 1]], torch.randn(3, 4)
    cm = rocs.compile(model, request_inputs=["u"], example_kwargs=dict(u=u, c=c))
    cm(u=u, c=c)
    return model, cm


def _graph_breaks() -> int:
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def test_a_torch_compiled_model_making_modules_per_call_compiles_once():
    _, cm = _rocs_model()  # installs the runtime's hooks, and keeps a model they follow alive
    counter = CompileCounter()
    other = torch.compile(_SlicedSequential(), backend=counter)
    x = torch.randn(2, 8)
    breaks = _graph_breaks()
    for _ in range(4):
        torch.testing.assert_close(other(x), other._orig_mod(x))
    assert counter.frame_count == 1, "recompiled on every call"
    assert _graph_breaks() == breaks
    assert cm is not None


def test_a_weight_reassigned_inside_compiled_code_is_still_followed():
    """The registration hook counts nothing under ``torch.compile``; the guards find it."""
    model, cm = _rocs_model()
    new_weight = torch.randn(3, 8) * 3

    @torch.compile(backend="eager")
    def reassign(weight):
        model.h.weight = nn.Parameter(weight)
        return weight + 1

    reassign(new_weight)
    assert model.h.weight is not None and torch.equal(model.h.weight, new_weight)
    u, c = torch.randn(2, 4)[[0, 1, 1, 1]], torch.randn(4, 4)
    with torch.no_grad():
        torch.testing.assert_close(cm(u=u, c=c), model(u, c))
