"""A candidate feature declared request-side is named: once per compiled model at the first
degenerate drop-in call, in the report, and by ``rocs inspect`` (``runtime/follow/mislabel.py``)."""

from __future__ import annotations

import warnings

import pytest
import torch
from models_for_tests import assert_outputs_match

import rocs_compiler as rocs
from models_zoo import ZOO
from rocs_compiler.cli import main as cli
from rocs_compiler.runtime.follow.mislabel import MIN_ROWS, varying_inputs

TWO_TOWER = ZOO["two_tower"]
MISLABELLED = [*TWO_TOWER.request_inputs, "item_id"]


def _compile(request_inputs, counts=(3, 1, 5)):
    model = TWO_TOWER.build()
    example = TWO_TOWER.make_batch(list(counts)).replicated()
    return model, rocs.compile(model, list(request_inputs), example_kwargs=example)


def _dropin_calls(cm, model, calls: int, counts=(6, 10)) -> list[warnings.WarningMessage]:
    """``calls`` drop-in calls (outputs checked against the model); the warnings they raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in range(calls):
            batch = TWO_TOWER.make_batch(list(counts), seed=seed).replicated()
            with torch.no_grad():
                assert_outputs_match(cm(**batch), model(**batch), f"drop-in call {seed}")
    return [w for w in caught if "rocs: request input" in str(w.message)]


def test_mislabelled_candidate_input_warns_once_and_is_in_the_report():
    model, cm = _compile(MISLABELLED, counts=(1,))  # the example cannot tell: one row
    assert "item_id" not in cm.report().note
    found = _dropin_calls(cm, model, calls=13)
    assert len(found) == 1, [str(w.message) for w in found]
    message = str(found[0].message)
    assert "'item_id'" in message and "16 requests in 16 rows" in message
    assert "'user_id'" not in message
    assert "'item_id'" in cm.report().note and "'item_id'" in cm.report().summary()


def test_example_batch_shows_the_mislabel_in_the_report_before_any_call():
    _, cm = _compile(MISLABELLED)
    note = cm.report().note
    assert "'item_id'" in note and "the example batch" in note


def test_correct_labels_never_warn_even_with_one_candidate_per_request():
    model, cm = _compile(TWO_TOWER.request_inputs)
    assert not _dropin_calls(cm, model, calls=4)
    assert not _dropin_calls(cm, model, calls=4, counts=(1,) * 16)  # degenerate, nothing varies
    assert "rocs: request input" not in cm.report().note


def test_varying_inputs_needs_rows_and_another_input_that_groups():
    rows = MIN_ROWS * 2
    user = torch.arange(2).repeat_interleave(MIN_ROWS)  # two requests
    item = torch.arange(rows)  # a new value on every row
    leaves = {"user": user, "item": item}
    assert varying_inputs(leaves, ["user", "item"], rows) == ["item"]
    assert varying_inputs(leaves, ["item"], rows) == []  # one input: all distinct users is fine
    assert varying_inputs(leaves, ["user"], rows) == []  # not degenerate
    short = {k: v[: MIN_ROWS - 1] for k, v in leaves.items()}
    assert varying_inputs(short, ["user", "item"], MIN_ROWS - 1) == []
    unique = {"user": torch.arange(rows), "item": item}  # every row its own request: no sign
    assert varying_inputs(unique, ["user", "item"], rows) == []


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_cli_inspect_names_the_mislabelled_input(fmt, capsys):
    request = ",".join([*ZOO["mmoe"].request_inputs, "features.item_id"])
    code = cli.main(["inspect", "models_zoo:mmoe", "--request", request, "--format", fmt, "-q"])
    out, err = capsys.readouterr()
    assert code == 0
    assert "'features.item_id'" in err and "'features.item_id'" in out


def test_cli_inspect_correct_labels_say_nothing(capsys):
    code = cli.main(["inspect", "models_zoo:mmoe", "-q"])
    out, err = capsys.readouterr()
    assert code == 0 and "rocs: request input" not in err + out
