"""A model capture cannot follow: from Python, one first line that names the user's source line
and what to do (``fallback="eager"``), torch's detail after it, and nothing on stderr; with the
eager fallback, that first line is the warning's reason."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import rocs_compiler as rocs

D = 4


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, user, item):
        if user.sum() > 0:
            return self.lin(user) + item
        return user - item


class OneHot(nn.Module):
    """Its output width is read from the batch's largest id: no graph holds for every batch."""

    def forward(self, user, item):
        return F.one_hot(user[:, 0]).sum(-1).float() + item.sum(-1)


def _example():
    return {"user": torch.ones(4, D), "item": torch.ones(4, D)}


def _first_line(err: Exception) -> str:
    return str(err).splitlines()[0]


@pytest.mark.parametrize("strict", [True, False])
def test_branching_names_the_source_line_and_the_fallback_and_prints_nothing(strict, capfd):
    with pytest.raises(rocs.CompileError) as info:
        rocs.compile(
            Branchy().eval(), ["user"], example_kwargs=_example(),
            options={"capture_strict": strict},
        )  # fmt: skip
    first = _first_line(info.value)
    assert re.match(r"at \S*test_capture_errors\.py:\d+: if user\.sum\(\) > 0:", first), first
    assert 'fallback="eager"' in first and "data-dependent" in first, first
    rest = str(info.value).split("\n", 1)[1]
    assert "export (non-strict)" in rest and "GuardOnDataDependentSymNode" in rest, rest
    out, err = capfd.readouterr()
    assert out == "" and err == "", err[:2000]


def test_the_fallback_warnings_give_the_first_line_as_the_reason(capfd):
    model = Branchy().eval()
    with pytest.raises(rocs.CompileError) as info:
        rocs.compile(model, ["user"], example_kwargs=_example())
    # Without the advice to pass fallback="eager", which this model did.
    advice = ', or pass fallback="eager" to run the model uncompiled'
    first = _first_line(info.value).replace(advice, "")
    assert first != _first_line(info.value)
    with pytest.warns(UserWarning) as compile_warnings:
        cm = rocs.compile(model, ["user"], example_kwargs=_example(), fallback="eager")
    assert first in str(compile_warnings[0].message)
    with warnings.catch_warnings(record=True) as call_warnings:
        warnings.simplefilter("always")
        cm(**_example())
    reasons = [re.search(r"eagerly \((.*)\)$", str(w.message)) for w in call_warnings]
    assert [r[1] for r in reasons if r] == [first]
    assert capfd.readouterr().err == ""


def test_a_failure_that_is_not_a_branch_still_leads_with_what_to_do():
    user = torch.randint(0, 3, (4, 2))
    with pytest.raises(rocs.CompileError, match="one_hot") as info:
        example = {"user": user, "item": torch.ones(4, D)}
        rocs.compile(OneHot().eval(), ["user"], example_kwargs=example)
    first = _first_line(info.value)
    assert first.strip() and 'fallback="eager"' in first, first
    assert "could not capture the model with a dynamic batch dimension" in str(info.value)
