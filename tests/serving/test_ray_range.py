"""The serving layer reaches into two private modules of Ray: the ``serve`` extra pins the Ray
range they are tested with, and a Ray without them is refused in one line naming its version,
on import of ``launch`` and by ``rocs serve``, before Ray starts (simulated by hiding the
private module or its attribute)."""

from __future__ import annotations

import importlib
import sys
import tomllib
from pathlib import Path

import pytest

pytest.importorskip("ray.serve", reason="the serving layer needs the serve extra (ray[serve])")
import ray  # noqa: E402

from rocs_compiler.errors import DependencyError  # noqa: E402
from rocs_compiler.serving import ray_private  # noqa: E402

# On the worker that runs test_ray_serve.py, which imports Ray anyway.
pytestmark = pytest.mark.xdist_group("ray")

REPLICA = "ray.serve._private.replica"
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def _assert_one_line_naming_the_version(message: str, module: str) -> None:
    assert "\n" not in message
    assert module in message
    assert f"ray {ray.__version__} does not have" in message
    assert f"ray[serve]{ray_private.TESTED_RAY}" in message


def test_the_serve_extra_pins_the_tested_range_and_the_installed_ray_is_in_it():
    from packaging.specifiers import SpecifierSet

    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    assert extras["serve"] == [f"ray[serve]{ray_private.TESTED_RAY}"]
    assert ray.__version__ in SpecifierSet(ray_private.TESTED_RAY)


def test_the_installed_ray_has_every_private_piece():
    ray_private.check()
    for name, attribute in ray_private.NEEDED.items():
        assert hasattr(ray_private.private_module(name), attribute)


def test_a_missing_private_module_is_refused_in_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, REPLICA, None)  # import of it raises ImportError
    with pytest.raises(DependencyError) as caught:
        ray_private.check()
    _assert_one_line_naming_the_version(str(caught.value), REPLICA)


def test_a_missing_private_attribute_is_refused_in_one_line(monkeypatch):
    constants = importlib.import_module("ray._private.ray_constants")
    monkeypatch.delattr(constants, "ENABLE_RAY_CLUSTER")
    with pytest.raises(DependencyError) as caught:
        ray_private.private_module("ray._private.ray_constants")
    _assert_one_line_naming_the_version(str(caught.value), "ENABLE_RAY_CLUSTER")


def _without_launch(monkeypatch) -> None:
    """``launch`` and ``deployment`` imported afresh (restored afterwards), Ray's start refused,
    and the replica module hidden."""
    import rocs_compiler.serving as serving

    for name in ("launch", "deployment"):  # imported by another test: the package holds them
        monkeypatch.delitem(sys.modules, f"rocs_compiler.serving.{name}", raising=False)
        monkeypatch.delattr(serving, name, raising=False)
    monkeypatch.setitem(sys.modules, REPLICA, None)

    def no_start(*args, **kwargs):
        raise AssertionError("Ray must not start with a Ray outside the tested range")

    monkeypatch.setattr(ray, "init", no_start)


def test_importing_launch_refuses_a_ray_without_the_private_module(monkeypatch):
    _without_launch(monkeypatch)
    with pytest.raises(DependencyError) as caught:
        importlib.import_module("rocs_compiler.serving.launch")
    _assert_one_line_naming_the_version(str(caught.value), REPLICA)


def test_rocs_serve_refuses_a_ray_without_the_private_module(tmp_path, monkeypatch, capsys):
    from rocs_compiler.cli import main as cli

    _without_launch(monkeypatch)
    artifact = tmp_path / "model.pt2"
    artifact.write_bytes(b"")
    assert cli.main(["serve", str(artifact)]) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("rocs: error:")]
    assert len(lines) == 1, err
    _assert_one_line_naming_the_version(lines[0], REPLICA)
