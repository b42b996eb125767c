"""What forward reads beyond its modules' own attributes: followed as eager, or refused.

A module-level global, a field of a config object a module holds, a class attribute, and the
forward hooks of the modules called are baked into the compiled graph. After each changes, the
compiled model must answer what the eager model answers, or raise a ``CompileError`` naming the
value ("compile the model again") in both call layouts; never the old computation. And
``torch.nn.utils.weight_norm``'s pre-hook, which recomputes ``weight`` from ``weight_g`` and
``weight_v`` on every eager call, is followed: the graph computes the weight itself. Oracle: the
eager model after the same change, on ragged batches (requests of 2 and 1 candidates).
"""

from __future__ import annotations

import dataclasses
import types
import warnings

import pytest
import torch
from models_for_tests import assert_outputs_match, eager
from torch import nn

import rocs_compiler as rocs

GAIN = 2.0  # a module-level global read by forward (``_global_gain``)
INDEX = torch.tensor([0, 0, 1])  # two requests, of 2 and 1 candidates


def _inputs(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 8, generator=g)[INDEX], torch.randn(3, 8, generator=g)


class _Tower(nn.Module):
    """A request tower and a head; weights large enough that rows differ far beyond tolerance."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.h = nn.Linear(8, 8), nn.Linear(16, 2)
        with torch.no_grad():
            self.h.weight.mul_(4.0)

    def scores(self, u, c):
        return self.h(torch.cat([torch.relu(self.a(u)), c], -1))


def _compile(model: nn.Module):
    # Without the program choice every call runs the compiled program behind the guards.
    u, c = _inputs(0)
    return rocs.compile(model.eval(), ["u"], example_kwargs=dict(u=u, c=c),
                        options={"autotune": False})  # fmt: skip


def _matches(model, cm, what: str) -> None:
    """Both layouts equal eager, on a ragged batch."""
    u, c = _inputs()
    expected = eager(model, dict(u=u, c=c))
    assert expected.std(0).min() > 1e-2, "rows must differ far beyond the tolerance"
    with torch.no_grad():
        assert_outputs_match(cm(u=u, c=c), expected, f"{what}, drop-in")
        shared = cm(u=u[[0, 2]], c=c, candidate_to_request=INDEX)
        assert_outputs_match(shared, expected, f"{what}, shared layout")


def _refused(cm, match: str) -> None:
    u, c = _inputs()
    with torch.no_grad(), pytest.raises(rocs.CompileError, match=match) as drop_in:
        cm(u=u, c=c)
    with torch.no_grad(), pytest.raises(rocs.CompileError, match=match):
        cm(u=u[[0, 2]], c=c, candidate_to_request=INDEX)
    assert "compile the model again" in str(drop_in.value)


# ---------------------------------------------------------------------------------------------
# Globals


class _GlobalGain(_Tower):
    def forward(self, u, c):
        return self.scores(u, c) * GAIN


def test_a_global_read_by_forward_is_guarded_by_type_and_value():
    global GAIN
    model = _GlobalGain()
    cm = _compile(model)
    _matches(model, cm, "compiled")
    try:
        GAIN = 5.0
        _refused(cm, r"global GAIN \(module .*test_guards_reads\) changed since compile "
                     r"\(float 2\.0 -> float 5\.0\)")  # fmt: skip
        GAIN = 2  # the same value, another type
        _refused(cm, r"global GAIN .* \(float 2\.0 -> int 2\)")
    finally:
        GAIN = 2.0
    _matches(model, cm, "global set back")


# ---------------------------------------------------------------------------------------------
# Fields of a config object held by identity


@dataclasses.dataclass
class _Config:
    scale: float
    head: types.SimpleNamespace


class _Configured(_Tower):
    def __init__(self):
        super().__init__()
        self.cfg = _Config(scale=1.5, head=types.SimpleNamespace(bias=0.25))

    def forward(self, u, c):
        return self.scores(u, c) * self.cfg.scale + self.cfg.head.bias


def test_fields_of_a_held_config_object_are_guarded():
    model = _Configured()
    cm = _compile(model)
    _matches(model, cm, "compiled")
    model.cfg.scale = 7.0
    _refused(cm, r"model\.cfg\.scale changed since compile \(float 1\.5 -> float 7\.0\)")
    model.cfg.scale = 1.5
    _matches(model, cm, "field set back")
    model.cfg.head.bias = -3.0  # a plain object, two attributes deep
    _refused(cm, r"model\.cfg\.head\.bias changed since compile \(float 0\.25 -> float -3\.0\)")
    model.cfg.head.bias = 0.25
    # A config built again with equal fields is followed, and watched from then on.
    model.cfg = _Config(scale=1.5, head=model.cfg.head)
    _matches(model, cm, "an equal config")
    model.cfg.scale = 3.0
    _refused(cm, r"model\.cfg changed since compile \(_Config\(scale=1\.5.* -> _Config\(scale=3\.0")


# ---------------------------------------------------------------------------------------------
# Class attributes


class _ClassScaled(_Tower):
    K = 3.0

    def __init__(self, through: str):
        super().__init__()
        self.through = through

    def forward(self, u, c):
        k = type(self).K if self.through == "type(self)" else self.K
        return self.scores(u, c) * k


@pytest.mark.parametrize("through", ["type(self)", "self"])
def test_a_class_attribute_read_by_forward_is_guarded(through, monkeypatch):
    model = _ClassScaled(through)
    cm = _compile(model)
    _matches(model, cm, "compiled")
    monkeypatch.setattr(_ClassScaled, "K", 9.0)
    _refused(cm, r"class attribute _ClassScaled\.K changed since compile "
                 r"\(float 3\.0 -> float 9\.0\)")  # fmt: skip
    monkeypatch.undo()
    _matches(model, cm, "class attribute set back")


# ---------------------------------------------------------------------------------------------
# Forward hooks


class _Plain(_Tower):
    def forward(self, u, c):
        return self.scores(u, c)


def _double_output(module, args, output):
    return output * 2.0


def _shift_input(module, args):
    return (args[0] + 1.0,)


def test_a_hook_traced_at_compile_then_removed_is_refused():
    model = _Plain()
    handle = model.a.register_forward_hook(_double_output)
    cm = _compile(model)
    _matches(model, cm, "hook traced")
    handle.remove()
    _refused(cm, r"the forward hooks of model\.a changed since compile "
                 r"\(_double_output -> none\)")  # fmt: skip
    model.a.register_forward_hook(_double_output)  # the same function, a new registration
    _refused(cm, r"the forward hooks of model\.a changed since compile")


@pytest.mark.parametrize("hook", ["forward hook", "forward pre-hook", "global forward hook"])
def test_a_hook_added_after_compile_is_refused_until_removed(hook):
    model = _Plain()
    cm = _compile(model)
    _matches(model, cm, "compiled")
    torch.randn(2, requires_grad=True).register_hook(lambda g: g)  # a tensor's: not ours
    _matches(model, cm, "a tensor hook registered elsewhere")
    if hook == "forward hook":
        handle = model.h.register_forward_hook(_double_output)
        where = r"forward hooks of model\.h"
    elif hook == "forward pre-hook":
        handle = model.a.register_forward_pre_hook(_shift_input)
        where = r"forward pre-hooks of model\.a"
    else:
        handle = nn.modules.module.register_module_forward_hook(_double_output)
        where = "global forward hooks"
    try:
        _refused(cm, rf"the {where} changed since compile \(none -> _")
    finally:
        handle.remove()
    _matches(model, cm, "hook removed again")


# ---------------------------------------------------------------------------------------------
# Old-style weight_norm: a pre-hook that assigns ``weight`` on every call


class _WeightNormed(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # deprecated for parametrizations
            self.sq = nn.utils.weight_norm(nn.Linear(16, 2))
        with torch.no_grad():
            self.sq.weight_g.mul_(4.0)

    def forward(self, u, c):
        return self.sq(torch.cat([torch.relu(self.a(u)), c], -1))


def test_weight_norm_is_followed_in_inference():
    model = _WeightNormed()
    cm = _compile(model)
    for step in range(3):  # each eager call assigns a new ``weight`` tensor
        _matches(model, cm, f"call {step}")
    with torch.no_grad():
        model.sq.weight_g.mul_(0.5)  # the graph computes the weight from weight_g and weight_v
    _matches(model, cm, "weight_g changed in place")


def test_weight_norm_is_followed_in_training():
    model, twin = _WeightNormed().train(), _WeightNormed().train()  # seeded: equal weights
    u, c = _inputs(0)
    cm = rocs.compile(model, ["u"], example_kwargs=dict(u=u, c=c), training=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    twin_optimizer = torch.optim.SGD(twin.parameters(), lr=0.1)
    u, c = _inputs()
    for step in range(2):
        with torch.no_grad():
            model(u, c)  # the original called too: its pre-hook assigns a new ``weight``
        shared = cm(u=u[[0, 2]], c=c, candidate_to_request=INDEX)
        expected = twin(u, c)
        assert_outputs_match(shared, expected, f"step {step}, shared layout")
        assert_outputs_match(cm(u=u, c=c), expected, f"step {step}, drop-in")
        (shared**2).sum().backward()
        (expected**2).sum().backward()
        for name in ("weight_g", "weight_v"):
            got, want = getattr(model.sq, name).grad, getattr(twin.sq, name).grad
            torch.testing.assert_close(got, want, msg=f"step {step}: gradient of sq.{name}")
        for opt in (optimizer, twin_optimizer):
            opt.step()
            opt.zero_grad()
    assert not torch.equal(model.sq.weight_g, _WeightNormed().sq.weight_g)  # steps moved it
