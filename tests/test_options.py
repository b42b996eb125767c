"""Options are a typed, frozen value checked at every entry point before any compile work.

An unknown key or a wrongly typed value is an error naming the entry point and listing every
valid option; a valid ``rocs.Options`` and the equivalent dict compile alike.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import rocs_compiler as rocs
from rocs_compiler.cli import main as cli
from rocs_compiler.options import BackendOptions

D = 4
ROOT = Path(__file__).resolve().parents[1]


class ConcatTower(nn.Module):
    """``linear(cat(user, item))``: the defer pass splits the first linear."""

    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(2 * D, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, user, item):
        return self.mlp(torch.cat([user, item], dim=1))


def _model_and_example():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    user = torch.randn(2, D, generator=g)[torch.tensor([0, 0, 1, 1, 1])]
    return ConcatTower().eval(), {"user": user, "item": torch.randn(5, D, generator=g)}


def _assert_lists_valid_options(message: str, cls=rocs.Options) -> None:
    assert "valid options:" in message
    for f in dataclasses.fields(cls):
        assert re.search(rf"{f.name}: [\w ]+ = {f.default!r}", message), (f.name, message)


BAD = [
    ({"nosuchopt": 1}, r"unknown option 'nosuchopt'"),
    ({"defr": False}, r"unknown option 'defr' \(did you mean 'defer'\?\)"),
    ({"defer": "maybe"}, r"option 'defer' must be bool, got 'maybe' \(str\)"),
    ({"defer": 1}, r"option 'defer' must be bool, got 1 \(int\)"),
    ({"ikbo": None}, r"option 'ikbo' must be bool, got None"),
    ({"ikbo_pointwise": 0}, r"option 'ikbo_pointwise' must be bool or None, got 0"),
]


# -- the value ------------------------------------------------------------------------------------


def test_options_are_frozen_and_hashable():
    options = rocs.Options(defer=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.defer = True
    assert options == rocs.Options(defer=False) and options != rocs.Options()
    assert hash(options) == hash(rocs.Options(defer=False))
    assert len({options, rocs.Options(defer=False), rocs.Options()}) == 2


def test_from_mapping_defaults_and_values():
    assert rocs.Options.from_mapping(None) == rocs.Options()
    assert rocs.Options.from_mapping({}) == rocs.Options()
    options = rocs.Options(ikbo=False)
    assert rocs.Options.from_mapping(options) is options
    assert rocs.Options.from_mapping({"ikbo_pointwise": True}).ikbo_pointwise is True


@pytest.mark.parametrize("mapping, message", BAD)
def test_from_mapping_rejects_with_the_valid_options(mapping, message):
    with pytest.raises(rocs.OptionsError, match=message) as info:
        rocs.Options.from_mapping(mapping, where="somewhere")
    assert str(info.value).startswith("somewhere: ")
    _assert_lists_valid_options(str(info.value))


def test_every_problem_is_reported_at_once():
    with pytest.raises(rocs.OptionsError) as info:
        rocs.Options.from_mapping({"defer": "maybe", "nosuchopt": 1})
    assert len(info.value.problems) == 2


def test_the_constructor_checks_types_too():
    with pytest.raises(rocs.OptionsError, match="'defer' must be bool"):
        rocs.Options(defer="maybe")
    with pytest.raises(rocs.OptionsError, match="must be a dict or Options, got list"):
        rocs.Options.from_mapping([("defer", False)])


def test_backend_options_add_inductor_and_keep_strict_capture_off():
    assert BackendOptions().inductor is True and BackendOptions().capture_strict is False
    assert "inductor" not in {f.name for f in dataclasses.fields(rocs.Options)}
    with pytest.raises(rocs.OptionsError, match="unknown option 'inductor'"):
        rocs.Options.from_mapping({"inductor": False})


# -- rocs.compile ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mapping, message", BAD)
def test_rocs_compile_rejects_before_capture(mapping, message, monkeypatch):
    def no_capture(*args, **kwargs):
        raise AssertionError("capture ran before the options were checked")

    monkeypatch.setattr("rocs_compiler.pipeline.capture", no_capture)
    model, example = _model_and_example()
    for fallback in ("error", "eager"):  # a bad option is not a compile failure to fall back from
        with pytest.raises(rocs.OptionsError, match=message) as info:
            rocs.compile(
                model, ["user"], example_kwargs=example, options=mapping, fallback=fallback
            )
        assert str(info.value).startswith("rocs.compile: ")
        _assert_lists_valid_options(str(info.value))


def test_options_value_and_dict_compile_alike():
    model, example = _model_and_example()

    def counts(options):
        cm = rocs.compile(model, ["user"], example_kwargs=example, options=options)
        return {k: v for k, v in cm.report().pass_counts.items() if v}

    default = counts(None)
    assert default.get("split_linear"), default
    off = counts(rocs.Options(defer=False))
    assert off == counts({"defer": False}) and "split_linear" not in off


# -- torch.compile --------------------------------------------------------------------------------


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize(
    "extra, message",
    [({"nosuchopt": 1}, "unknown option 'nosuchopt'"), ({"inductor": "no"}, "'inductor' must")],
)
def test_torch_compile_options_are_checked(extra, message, fresh_dynamo):
    model, example = _model_and_example()
    options = {"request_inputs": ["user"], **extra}
    compiled = torch.compile(model, backend="rocs", options=options)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info, torch.no_grad():
        compiled(**example)
    cause = info.value.inner_exception
    assert isinstance(cause, rocs.OptionsError), cause
    assert message in str(cause) and str(cause).startswith("torch.compile(backend='rocs'): ")
    _assert_lists_valid_options(str(cause), BackendOptions)


def test_rocs_backend_checks_options_when_built():
    with pytest.raises(rocs.OptionsError, match=r"^rocs.backend: unknown option 'defr'") as info:
        rocs.backend(["user"], defr=False)
    _assert_lists_valid_options(str(info.value), BackendOptions)


def test_backend_passes_options_to_the_pipeline(fresh_dynamo):
    model, example = _model_and_example()
    backend = rocs.backend(["user"], inductor=False, defer=False)
    with torch.no_grad():
        out = torch.compile(model, backend=backend, dynamic=True)(**example)
        torch.testing.assert_close(out, model(**example))
    (subgraph,) = backend.subgraphs
    assert subgraph.options == BackendOptions(inductor=False, defer=False)
    # Without defer, linear(cat(user, item)) meets the candidate at once: nothing is shared,
    # and the graph runs as Inductor compiled it (with defer it splits the linear and shares).
    assert subgraph.compiled_model is None
    assert subgraph.fallback_reason.startswith("nothing to share")


# -- the CLI --------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", [["inspect"], ["export", "-o", "unused.pt2"]])
@pytest.mark.parametrize(
    "text, message",
    [
        ('{"nosuchopt": 1}', "unknown option 'nosuchopt'"),
        ('{"defer": "maybe"}', "option 'defer' must be bool, got 'maybe'"),
        ('["defer"]', "must be a JSON object"),
    ],
)
def test_cli_options_are_a_usage_error(command, text, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*command, "models_zoo:two_tower", "--options", text])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"rocs {command[0]}: error: argument --options: {message}" in err
    if "JSON" not in message:
        _assert_lists_valid_options(err)


def test_cli_options_reach_the_pipeline(capsys):
    counts = {}
    for text in ("{}", '{"defer": false}'):
        argv = ["inspect", "models_zoo:two_tower", "--format", "json", "--options", text]
        assert cli.main(argv) == 0
        counts[text] = json.loads(capsys.readouterr().out)["pass_counts"]
    assert "split_linear" in counts["{}"] and "split_linear" not in counts['{"defer": false}']


# -- docs -----------------------------------------------------------------------------------------


def test_readme_table_lists_every_option():
    text = (ROOT / "README.md").read_text()
    for cls in (rocs.Options, BackendOptions):
        for f in dataclasses.fields(cls):
            assert re.search(rf"^\| `{f.name}` \|", text, re.M), f"README lacks option {f.name}"
