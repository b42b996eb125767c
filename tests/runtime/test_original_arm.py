"""A bucket settled on the plain program measures it against the original model and keeps the
faster (``runtime/call/original_arm.py``): every arm answers what the original answers, a kept original
runs the call as made before the guards (so it follows a changed model), and a kept plain program
never calls the original."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import rocs_compiler as rocs
from models_for_tests import NothingShared
from rocs_compiler.errors import CompileError
from rocs_compiler.runtime import compiled_model
from rocs_compiler.runtime.call import original_arm, plain
from rocs_compiler.runtime.call.original_arm import ARM_TRIALS, ORIGINAL, PROGRAM
from rocs_compiler.runtime.choice.program_choice import PLAIN, bucket

CALLS = 2 * ARM_TRIALS + 4  # past both arms' trials


class DictModel(NothingShared):
    def forward(self, features):
        return super().forward(features["user"], features["item"])


@dataclasses.dataclass
class Pair:
    user: torch.Tensor
    item: torch.Tensor


class BatchModel(NothingShared):
    def forward(self, batch):
        return super().forward(batch.user, batch.item)


FORMATS = {
    "tensors": (NothingShared, "user", lambda u, i: ((), {"user": u, "item": i})),
    "positional": (NothingShared, "user", lambda u, i: ((u, i), {})),
    "dict": (DictModel, "features.user", lambda u, i: ((), {"features": {"user": u, "item": i}})),
    "batch object": (BatchModel, "batch.user", lambda u, i: ((Pair(u, i),), {})),
}


def _batch(counts, seed=0):
    g = torch.Generator().manual_seed(seed)
    index = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    return torch.randn(len(counts), 8, generator=g), torch.randn(sum(counts), 8, generator=g), index


def _compiled(fmt: str, forwards: list | None = None):
    """(model, its compile, input wrapper); with ``forwards``, a forward pre-hook registered
    before compiling (so the guards hold it) appends to it on each call of the original."""
    cls, request, wrap = FORMATS[fmt]
    torch.manual_seed(0)
    model = cls().eval()
    if forwards is not None:
        model.register_forward_pre_hook(lambda *_: forwards.append(1))
    user, item, index = _batch([3, 2], seed=1)
    args, kwargs = wrap(user[index], item)
    cm = rocs.compile(model, [request], example_inputs=args, example_kwargs=kwargs)
    if forwards is not None:
        forwards.clear()  # the compile's own calls
    return model, cm, wrap


def _settle_plain(cm, counts):
    rows = sum(counts)
    cm._choice.settle(bucket("dropin", rows, len(counts)), PLAIN)
    cm._choice.settle(bucket("shared", rows, len(counts)), PLAIN)


def _kept(arm: str, forwards: list | None = None):
    """(model, its tensors compile, counts): the buckets of calls of ``counts`` kept ``arm``."""
    model, cm, _ = _compiled("tensors", forwards)
    counts = [3, 2, 6]
    _settle_plain(cm, counts)
    for key in _arm_keys(counts):
        cm._originals.settle(key, arm)
    return model, cm, counts


def _arm_keys(counts):
    rows = sum(counts)
    return bucket("dropin", rows)[:2] + (0,), bucket("shared", rows, len(counts))


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("counts", [[5, 1, 9], [1], [4, 4, 4, 4]])
def test_every_arm_answers_what_the_original_answers(fmt, counts):
    """Drop-in and shared-layout calls through both arms' trials and past their decisions, on
    ragged batches: the original's answer on the replicated call each time."""
    model, cm, wrap = _compiled(fmt)
    _settle_plain(cm, counts)
    with torch.no_grad():
        for call in range(CALLS):
            user, item, index = _batch(counts, seed=call)
            args, kwargs = wrap(user[index], item)
            expected = model(*args, **kwargs)
            torch.testing.assert_close(cm(*args, **kwargs), expected)
            args, kwargs = wrap(user, item)
            torch.testing.assert_close(cm(*args, **kwargs, candidate_to_request=index), expected)
    assert set(cm.plain_runs()) == set(_arm_keys(counts))
    assert set(cm.plain_runs().values()) <= {PROGRAM, ORIGINAL}


def _timed_arms(monkeypatch, slow: str):
    """Make the ``slow`` arm take one second more on the trial clock."""
    now = [0.0]
    monkeypatch.setattr(original_arm, "call_clock", lambda on_cpu=True: lambda: now[0])
    if slow == ORIGINAL:
        real = compiled_model.CompiledModel._call_original

        def call_original(self, args, kwargs):
            now[0] += 1.0
            return real(self, args, kwargs)

        monkeypatch.setattr(compiled_model.CompiledModel, "_call_original", call_original)
    else:
        real_plain = plain.PlainProgram.__call__

        def run_plain(self, inputs):
            now[0] += 1.0
            return real_plain(self, inputs)

        monkeypatch.setattr(plain.PlainProgram, "__call__", run_plain)


@pytest.mark.parametrize("slow,kept", [(ORIGINAL, PROGRAM), (PROGRAM, ORIGINAL)])
def test_the_faster_arm_is_kept(monkeypatch, slow, kept):
    model, cm, wrap = _compiled("tensors")
    counts = [3, 2, 6]
    _settle_plain(cm, counts)
    _timed_arms(monkeypatch, slow)
    user, item, index = _batch(counts)
    with torch.no_grad():
        for _ in range(CALLS):
            cm(user=user[index], item=item)
            cm(user=user, item=item, candidate_to_request=index)
    assert cm.plain_runs() == dict.fromkeys(_arm_keys(counts), kept)


def test_a_kept_plain_program_never_calls_the_original():
    forwards = []
    model, cm, counts = _kept(PROGRAM, forwards)
    user, item, index = _batch(counts)
    with torch.no_grad():
        cm(user=user[index], item=item)
        cm(user=user, item=item, candidate_to_request=index)
    assert not forwards


def test_a_kept_original_runs_the_call_as_made_and_follows_a_changed_model():
    """A kept original is the model as it is now: a module swapped for another class, which the
    guards refuse for a compiled program, is what such a bucket's calls run."""
    model, cm, counts = _kept(ORIGINAL)
    model.mlp[1] = nn.Tanh()
    user, item, index = _batch(counts)
    with torch.no_grad():
        expected = model(user=user[index], item=item)
        torch.testing.assert_close(cm(user=user[index], item=item), expected)
        torch.testing.assert_close(cm(user=user, item=item, candidate_to_request=index), expected)
        with pytest.raises(CompileError, match="compile the model again"):
            cm(user=user[:1].expand(4, 8), item=item[:4])  # another row class: the program's


def test_a_kept_original_is_not_taken_in_grad_mode_nor_for_a_bad_index():
    forwards = []
    model, cm, counts = _kept(ORIGINAL, forwards)
    user, item, index = _batch(counts)
    out = cm(user=user[index], item=item)  # grad mode: outside the program choice
    assert out.requires_grad and not forwards
    with torch.no_grad():
        bad = index.clone()
        bad[0] = 7
        with pytest.raises(IndexError, match="candidate_to_request"):
            cm(user=user, item=item, candidate_to_request=bad)
