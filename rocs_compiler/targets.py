"""What ``rocs`` commands act on: TARGET strings resolved to a model, its example inputs and its
request inputs, or to a saved export.

TARGET is ``models_zoo:NAME``, ``package.module:factory``, ``path/to/file.py:factory`` or a saved
export (``*.pt2``); the factory protocol is described in :mod:`rocs_compiler.cli`.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional


class TargetError(ValueError):
    """TARGET could not be resolved or does not follow the factory protocol."""


@dataclass
class Target:
    label: str
    model: Any = None  # nn.Module
    example_kwargs: Optional[dict] = None
    request_inputs: Optional[list[str]] = None
    make_batch: Optional[Callable] = None  # counts -> Batch-like
    program: Any = None  # a loaded ExportedProgram


def _is_entry_like(obj: Any) -> bool:
    return all(hasattr(obj, a) for a in ("build", "make_batch", "request_inputs"))


def _from_entry(label: str, entry: Any) -> Target:
    example = entry.make_batch([3, 1, 5]).replicated()
    return Target(label, entry.build(), example, list(entry.request_inputs), entry.make_batch)


def _import_module(name: str):
    if name.endswith(".py"):
        path = Path(name)
        if not path.is_file():
            raise TargetError(f"no such file: {name}")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        spec.loader.exec_module(module)
        return module
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # like `python -m`: modules next to the user resolve
    return importlib.import_module(name)


def load_target(spec: str, request: Optional[list[str]] = None) -> Target:
    """Resolve TARGET (see the module docstring)."""
    if spec.endswith(".pt2") or (Path(spec).is_file() and ":" not in spec):
        from .export import load

        if not Path(spec).is_file():
            raise TargetError(f"no such file: {spec}")
        try:
            return Target(spec, program=load(spec))
        except Exception as err:
            raise TargetError(
                f"{spec} is not a program saved with rocs.save / torch.export.save "
                f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
            ) from err
    if ":" not in spec:
        raise TargetError(
            f"cannot resolve TARGET {spec!r}: use models_zoo:NAME, package.module:factory, "
            "path/to/file.py:factory or a saved export (.pt2)"
        )
    module_name, attr = spec.rsplit(":", 1)
    if module_name == "models_zoo":
        from models_zoo import get_entry

        try:
            target = _from_entry(spec, get_entry(attr))
        except KeyError as err:
            raise TargetError(str(err.args[0])) from None
    else:
        try:
            module = _import_module(module_name)
        except ImportError as err:
            raise TargetError(f"cannot import {module_name!r}: {err}") from None
        if not hasattr(module, attr):
            raise TargetError(f"module {module_name!r} has no attribute {attr!r}")
        target = _from_factory(spec, getattr(module, attr))
    if request:
        target.request_inputs = list(request)
    if not target.request_inputs:
        raise TargetError(f"{spec}: no request inputs; pass --request NAME[,NAME...]")
    return target


def _from_factory(label: str, factory: Any) -> Target:
    if _is_entry_like(factory):
        return _from_entry(label, factory)
    if not callable(factory):
        raise TargetError(f"{label} is neither a factory function nor a zoo-entry-like object")
    made = factory()
    if _is_entry_like(made):
        return _from_entry(label, made)
    if isinstance(made, (tuple, list)) and len(made) in (2, 3):
        model, example = made[0], made[1]
        request = made[2] if len(made) == 3 else None
        request = [request] if isinstance(request, str) else (list(request) if request else None)
        if not isinstance(example, dict):
            raise TargetError(
                f"{label}: the factory's second value must be a dict of example kwargs"
            )
        return Target(label, model, example, request)
    raise TargetError(
        f"{label}: the factory must return (model, example_kwargs, request_inputs) or an object "
        "with build(), make_batch(counts) and request_inputs"
    )
