"""Capture produces a functional graph: in-place ops and writes through views become value ops,
so no pass reasons about aliasing. Each model once gave a silent wrong answer (role analysis,
CSE and the linear split treated the writes as side-effect free) or lost all sharing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import rocs_compiler as rocs

INDEX = torch.tensor([0, 0, 1, 2, 2, 2, 1])


def _linear(i: int, o: int) -> nn.Linear:
    return nn.Linear(i, o)


def filled_by_slices(s, u, c):
    """A preallocated buffer filled by slices."""
    out = torch.zeros(u.shape[0], 8)
    out[:, :4] = s.a(u)
    out[:, 4:] = s.b(c)
    return s.h(out).squeeze(-1)


def multiplied_through_a_view(s, u, c):
    h = s.a(u)
    h[:, :2].mul_(c[:, :2])
    return h.relu().sum(-1)


def written_after_a_read(s, u, c):
    """Two relu(g) around a write to g: CSE must not merge them."""
    g = s.a(c)
    r1 = g.relu()
    g[:, 0] = 5.0
    return ((r1 + g.relu()) * u).sum(-1)


def two_filled_constants(s, u, c):
    """Two zeros() buffers written differently: CSE must not merge them."""
    m1 = torch.zeros(4)
    m1[:2] = 1.0
    m2 = torch.zeros(4)
    m2[2:] = 3.0
    return (u * m1 + c * m2).sum(-1)


def written_concatenation(s, u, c):
    x = torch.cat([s.a(u), c], -1)
    x[:, 0] = 0.0
    return s.h(x).squeeze(-1)


def history_updated_in_place(s, u, c):
    h = s.a(u)
    h += 1.0
    h.masked_fill_(h > 1.5, 0.0)
    return (h * c).sum(-1)


def detached_offsets(s, u, c):
    """Per-field offsets built in forward and detach_()-ed, as some libraries do."""
    offsets = u.new_tensor([0.0, 1.0, 2.0, 3.0])
    offsets.detach_()
    return (s.a(u + offsets) * c).sum(-1)


CASES = {
    "filled_by_slices": (filled_by_slices, dict(a=(4, 4), b=(4, 4), h=(8, 1)), 0.3),
    "multiplied_through_a_view": (multiplied_through_a_view, dict(a=(4, 4)), 0.9),
    "written_after_a_read": (written_after_a_read, dict(a=(4, 4)), 0.0),
    "two_filled_constants": (two_filled_constants, {}, 0.0),
    "written_concatenation": (written_concatenation, dict(a=(4, 4), h=(8, 1)), 0.5),
    "history_updated_in_place": (history_updated_in_place, dict(a=(4, 4)), 0.9),
    "detached_offsets": (detached_offsets, dict(a=(4, 4)), 0.9),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_in_place_code_is_exact_and_keeps_its_sharing(name):
    forward, children, min_share = CASES[name]
    torch.manual_seed(0)
    model = type("InPlace", (nn.Module,), {"forward": forward})()
    for child, shape in children.items():
        setattr(model, child, _linear(*shape))
    model.eval()
    u, c = torch.randn(3, 4), torch.randn(7, 4)
    cm = rocs.compile(model, ["u"], example_kwargs={"u": u[[0, 0, 1]], "c": c[:3]})
    mutating = [
        n for n in cm.pipeline_result.logical_graph.graph.nodes
        if isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable
    ]
    assert not mutating, mutating
    assert cm.report().request_share >= min_share
    with torch.no_grad():
        want = model(u[INDEX], c)
        torch.testing.assert_close(cm(u=u, c=c, candidate_to_request=INDEX), want)
        torch.testing.assert_close(cm(u=u[INDEX], c=c), want)
