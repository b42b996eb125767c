"""The ``rocs`` command line on a user's own model file: classes, factories and instances with
``--input`` specs, one-line errors, progress lines, ``-q`` and ``--options`` checks.

Commands run in-process through ``rocs_compiler.cli.main``. Structure is checked, never
generated node names or timings.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
import textwrap

import pytest
import torch

from conftest import run_cli as run
import rocs_compiler as rocs
from rocs_compiler.cli import main as cli
from rocs_compiler.cli.input_specs import parse_spec, spec_batch
from rocs_compiler.progress import listening, stage

MODEL_FILE = textwrap.dedent(
    """
    import torch
    from torch import nn


    class Ranker(nn.Module):
        def __init__(self, num_items=500, dim=8):
            super().__init__()
            torch.manual_seed(0)
            self.user = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, dim))
            self.item = nn.Embedding(num_items, dim)
            self.head = nn.Linear(2 * dim, 1)

        def forward(self, user_dense, item_id):
            u = self.user(user_dense)
            return self.head(torch.cat([u, self.item(item_id)], dim=-1)).squeeze(-1)


    class NeedsArguments(Ranker):
        def __init__(self, dim):
            super().__init__(dim=dim)


    class Branchy(Ranker):
        def forward(self, user_dense, item_id):
            u = self.user(user_dense)
            if u.sum() > 0:
                u = u * 2
            return self.head(torch.cat([u, self.item(item_id)], dim=-1)).squeeze(-1)


    def make_ranker():
        return Ranker(dim=4).eval()


    ranker = Ranker().eval()
    """
)

SPECS = ["--input", "user_dense=float32[12]", "--input", "item_id=int64[]<500"]
REQUEST = ["--request", "user_dense"]


@pytest.fixture
def model_file(tmp_path, monkeypatch):
    path = tmp_path / "own_models.py"
    path.write_text(MODEL_FILE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield path
    sys.modules.pop("own_models", None)




def _lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip()]


def _error_lines(err: str) -> list[str]:
    """stderr without progress lines: the error and its hint."""
    return [line for line in _lines(err) if not line.startswith("[rocs] ")]


# -- targets: a class, a factory, an instance -----------------------------------------------------


@pytest.mark.parametrize("name", ["Ranker", "make_ranker", "ranker"])
def test_class_factory_and_instance_with_input_specs(name, model_file, capsys):
    code, out, err = run(
        capsys, "inspect", f"own_models.py:{name}", *SPECS, *REQUEST, "--format", "json", "-q"
    )
    assert code == 0, err
    assert err == ""
    data = json.loads(out)
    assert data["request_inputs"] == ["user_dense"]
    roles = {n["name"]: n["role"] for n in data["nodes"] if n["op"] == "input"}
    assert roles == {"user_dense": "REQUEST", "item_id": "CANDIDATE"}
    assert data["totals"]["request_flops"] > 0 and data["totals"]["candidate_flops"] > 0


def test_exported_program_of_a_spec_target_equals_the_model(model_file, tmp_path, capsys):
    output = tmp_path / "ranker.pt2"
    argv = ["export", "own_models.py:ranker", *SPECS, *REQUEST, "-o", str(output)]
    code, _, err = run(capsys, *argv)
    assert code == 0, err
    program = rocs.load(output)
    model = sys.modules["own_models"].ranker
    specs = [parse_spec("user_dense=float32[12]"), parse_spec("item_id=int64[]<500")]
    batch = spec_batch(specs, ["user_dense"], [2, 1, 4], seed=3)
    with torch.no_grad():
        expected = model(**batch.replicated())
        got = program.module()(**batch.kwargs, candidate_to_request=batch.candidate_to_request)
    torch.testing.assert_close(got, expected)


def test_candidates_are_per_request_in_inspect_and_measure(model_file, capsys):
    code, out, err = run(
        capsys, "inspect", "own_models.py:Ranker", *SPECS, *REQUEST, "--format", "json",
        "--candidates", "8", "--requests", "2", "--measure", "-q",
    )  # fmt: skip
    assert code == 0, err
    data = json.loads(out)
    assert data["candidates_per_request"] == 8
    assert data["num_candidates"] == 16 and data["num_requests"] == 2
    (point,) = data["measured_speedup"]
    assert point["candidates_per_request"] == 8 and point["num_candidates"] == 16
    assert point["speedup"] > 0


# -- errors say what is missing, in one line ------------------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["own_models.py:Ranker", *REQUEST],
            "no --input for user_dense, item_id (forward takes user_dense, item_id)",
        ),
        (
            ["own_models.py:Ranker", "--input", "user_dense=float32[12]", *REQUEST],
            "no --input for item_id",
        ),
        (
            ["own_models.py:Ranker", *SPECS, "--input", "extra=float32[2]", *REQUEST],
            "--input extra: own_models.py:Ranker's forward has no such argument",
        ),
        (["own_models.py:Ranker", *SPECS], "which inputs are request-side? pass --request"),
        (
            ["own_models.py:Ranker", *SPECS, "--request", "user"],
            "--request user: no --input by that name",
        ),
        (["own_models.py:NeedsArguments", *SPECS, *REQUEST], "the class needs arguments (dim)"),
        (["own_models.py:Nope"], "has no attribute 'Nope' (classes: Ranker, NeedsArguments"),
        (["own_models.py"], "name the model in the file, as own_models.py:NAME"),
    ],
)
def test_target_errors_are_one_line(argv, message, model_file, capsys):
    code, _, err = run(capsys, "inspect", *argv)
    assert code == 1
    lines = _error_lines(err)
    assert len(lines) == 1, err
    assert lines[0].startswith("rocs: error: ") and message in lines[0]


def test_a_file_that_is_not_a_saved_program(model_file, tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("not a program")
    for target in ("own_models.py", str(notes)):
        code, _, err = run(capsys, "inspect", target, "-q")
        assert code == 1
        assert "BadZipFile" not in err and "Traceback" not in err
        assert len(_lines(err)) == 1, err
    assert "is not a saved program" in err


def test_data_dependent_branching_is_one_line_with_the_source_line(model_file, capsys):
    code, _, err = run(capsys, "inspect", "own_models.py:Branchy", *SPECS, *REQUEST)
    assert code == 1
    error, hint = _error_lines(err)  # nothing else: no graph dumps, no torch logs
    assert error.startswith("rocs: error: could not capture")
    assert "data-dependent" in error
    assert re.search(r"own_models\.py:\d+: if u\.sum\(\) > 0:", hint), hint
    assert all(line.startswith("[rocs] ") for line in _lines(err)[:-2])


def test_the_source_line_is_found_with_the_non_strict_route_alone(model_file, capsys):
    options = ["--options", '{"capture_strict": false}']
    code, _, err = run(capsys, "inspect", "own_models.py:Branchy", *SPECS, *REQUEST, *options)
    assert code == 1
    error, hint = _error_lines(err)
    assert error.startswith("rocs: error: could not capture")
    assert re.search(r"own_models\.py:\d+: if u\.sum\(\) > 0:", hint), hint


def test_debug_shows_the_traceback_of_a_target_error(model_file):
    with pytest.raises(cli.TargetError, match="no --input for"):
        cli.main(["inspect", "own_models.py:Ranker", *REQUEST, "--debug"])


@pytest.mark.parametrize(
    "spec, message",
    [
        ("user_dense", "expected NAME=DTYPE[SHAPE]"),
        ("user_dense=float33[12]", "unknown dtype 'float33'"),
        ("user_dense=float32[12]<5", "<K bounds integer ids"),
    ],
)
def test_bad_input_specs_are_usage_errors_naming_the_argument(spec, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["inspect", "models_zoo:dlrm", "--input", spec])
    assert exit_info.value.code == 2
    lines = _lines(capsys.readouterr().err)
    assert len(lines) <= 2 and "argument --input:" in lines[0] and message in lines[0]


def test_unknown_options_key_is_one_line_listing_the_valid_keys(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["inspect", "models_zoo:dlrm", "--options", '{"defr": false}'])
    assert exit_info.value.code == 2
    lines = _lines(capsys.readouterr().err)
    assert len(lines) <= 2
    assert "argument --options: unknown option 'defr' (did you mean 'defer'?)" in lines[0]
    for key in ("defer", "ikbo", "ikbo_pointwise", "capture_strict"):
        assert f"{key}: " in lines[0]


# -- progress -------------------------------------------------------------------------------------

PROGRESS = re.compile(r"^\[rocs\] (?P<stage>[\w ()/]+?) \.\.\. (\d+\.\d s|failed)$")


def test_progress_lines_and_quiet(model_file, tmp_path, capsys):
    output = tmp_path / "ranker.pt2"
    argv = ["export", "own_models.py:Ranker", *SPECS, *REQUEST, "-o", str(output)]
    code, _, err = run(capsys, *argv)
    assert code == 0
    lines = _lines(err)
    stages = [PROGRESS.match(line)["stage"] for line in lines[:-2]]
    for expected in ("capture", "analyze", "share", "cleanup", "export", "save"):
        assert expected in stages
    assert lines[-2] == f"wrote {output}", "nothing but progress and the notes: no torch noise"
    assert lines[-1].startswith("weights: freshly initialised")

    code, _, err = run(capsys, *argv, "-q")
    assert code == 0 and err == ""


def test_the_library_is_silent_and_stages_reach_a_listener(model_file, capsys):
    model = importlib.import_module("own_models")
    specs = [parse_spec("user_dense=float32[12]"), parse_spec("item_id=int64[]<500")]
    example = spec_batch(specs, ["user_dense"], [3, 1, 5]).replicated()
    rocs.compile(model.Ranker().eval(), ["user_dense"], example_kwargs=example)
    assert capsys.readouterr() == ("", "")

    events = []

    class Recorder:
        def start(self, name):
            events.append(("start", name))

        def end(self, name, seconds, ok):
            events.append(("end", name, ok))

    with listening(Recorder()):
        rocs.compile(model.Ranker().eval(), ["user_dense"], example_kwargs=example)
        with pytest.raises(ValueError), stage("failing"):
            raise ValueError
    started = [e[1] for e in events if e[0] == "start"]
    assert started[:2] == ["capture", "analyze"] and "cleanup" in started
    assert ("end", "capture", True) in events and events[-1] == ("end", "failing", False)


# -- input specs ----------------------------------------------------------------------------------


def test_spec_notation():
    spec = parse_spec("history=int64[50]<10000")
    assert (spec.name, spec.dtype, spec.shape, spec.bound) == ("history", torch.int64, (50,), 10000)
    assert parse_spec("x=[3, 4]").dtype == torch.float32 and parse_spec("x=[3, 4]").shape == (3, 4)
    assert parse_spec("features.age=bf16[]").name == "features.age"


def test_spec_batches_are_ragged_and_bounded():
    specs = [
        parse_spec("user=float32[4]"),
        parse_spec("features.age=float32[1]"),
        parse_spec("item=int64[2]<7"),
    ]
    batch = spec_batch(specs, ["user", "features"], [3, 1, 5])
    assert batch.kwargs["user"].shape == (3, 4)
    assert batch.kwargs["features"]["age"].shape == (3, 1)
    assert batch.kwargs["item"].shape == (9, 2)
    assert int(batch.kwargs["item"].min()) >= 0 and int(batch.kwargs["item"].max()) < 7
    assert batch.candidate_to_request.tolist() == [0, 0, 0, 1, 2, 2, 2, 2, 2]
    replicated = batch.replicated()
    torch.testing.assert_close(
        replicated["user"], batch.kwargs["user"][batch.candidate_to_request]
    )
    assert replicated["item"] is batch.kwargs["item"]


# -- weights: which ones, and --weights -----------------------------------------------------------


def _trained_state(path) -> dict:
    """A state_dict unlike the fresh one (the class seeds its own initialisation)."""
    model = importlib.import_module("own_models").Ranker()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    torch.save(model.state_dict(), path)
    return model.eval()


def test_export_says_which_weights_and_loads_a_state_dict(model_file, tmp_path, capsys):
    fresh, loaded = tmp_path / "fresh.pt2", tmp_path / "loaded.pt2"
    trained = _trained_state(tmp_path / "state.pt")
    code, _, err = run(capsys, "export", "own_models.py:Ranker", *SPECS, *REQUEST, "-o", str(fresh))
    assert code == 0, err
    notes = [line for line in _lines(err) if line.startswith("weights: ")]
    assert len(notes) == 1 and "freshly initialised" in notes[0] and "--weights" in notes[0]
    argv = ["export", "own_models.py:Ranker", *SPECS, *REQUEST, "--weights", "state.pt"]
    code, _, err = run(capsys, *argv, "-o", str(loaded))
    assert code == 0, err
    assert [line for line in _lines(err) if line.startswith("weights: ")] == [
        "weights: state.pt (7 tensors)"
    ]
    specs = [parse_spec("user_dense=float32[12]"), parse_spec("item_id=int64[]<500")]
    batch = spec_batch(specs, ["user_dense"], [2, 1, 4], seed=5)
    with torch.no_grad():
        expected = trained(**batch.replicated())
        got = rocs.load(loaded)(**batch.kwargs, candidate_to_request=batch.candidate_to_request)
        other = rocs.load(fresh)(**batch.kwargs, candidate_to_request=batch.candidate_to_request)
    torch.testing.assert_close(got, expected)
    assert not torch.allclose(other, expected)


def test_inspect_says_which_weights(model_file, tmp_path, capsys):
    _trained_state(tmp_path / "state.pt")
    code, out, err = run(capsys, "inspect", "own_models.py:make_ranker", *SPECS, *REQUEST, "-q")
    assert code == 0, err
    weights = [line for line in out.splitlines() if line.startswith("weights: ")]
    assert len(weights) == 1 and "make_ranker" in weights[0], out[:500]
    argv = ["inspect", "own_models.py:Ranker", *SPECS, *REQUEST, "--weights", "state.pt"]
    code, out, err = run(capsys, *argv, "--format", "json", "-q")
    assert code == 0, err
    assert json.loads(out)["weights"] == "state.pt (7 tensors)"


@pytest.mark.parametrize("make, message", [
    (lambda path: torch.save({"user.0.weight": torch.zeros(3, 3)}, path), "does not fit"),
    (lambda path: path.write_text("not a checkpoint"), "not a torch.save file"),
])  # fmt: skip
def test_weights_that_do_not_fit_are_one_line(make, message, model_file, tmp_path, capsys):
    make(tmp_path / "state.pt")
    argv = ["inspect", "own_models.py:Ranker", *SPECS, *REQUEST, "--weights", "state.pt", "-q"]
    code, _, err = run(capsys, *argv)
    assert code == 1
    lines = _error_lines(err)
    assert len(lines) == 1, err
    assert lines[0].startswith("rocs: error: --weights state.pt") and message in lines[0], err
