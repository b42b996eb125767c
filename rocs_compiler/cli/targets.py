"""What ``rocs`` commands act on: TARGET strings resolved to a model, its example inputs and its
request inputs, or to a saved export.

TARGET is ``models_zoo:NAME``, ``package.module:NAME``, ``path/to/file.py:NAME`` or a saved export
(``*.pt2``). NAME is

- an ``nn.Module`` subclass, constructed with no arguments;
- an ``nn.Module`` instance;
- a factory function taking no arguments, returning a model, or ``(model, example_kwargs[,
  request_inputs])``, or a zoo-entry-like object (``build()``, ``make_batch(counts)``,
  ``request_inputs``), as described in :mod:`rocs_compiler.cli.main`.

A bare model needs example inputs: ``--input`` specs (:mod:`rocs_compiler.cli.input_specs`), from
which ragged example batches are synthesized. Specs replace a target's own example inputs.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from torch import nn

from ..errors import TargetError
from .input_specs import (
    EXAMPLE_COUNTS,
    NOTATION,
    InputSpec,
    check_requests,
    check_specs,
    spec_batch,
)

__all__ = ["Target", "TargetError", "load_target"]


@dataclass
class Target:
    label: str
    model: Any = None  # nn.Module
    example_kwargs: Optional[dict] = None
    request_inputs: Optional[list[str]] = None
    make_batch: Optional[Callable] = None  # counts -> Batch-like
    program: Any = None  # a loaded ExportedProgram
    weights: str = ""  # which weights the model holds, for the output


FRESH_WEIGHTS = "freshly initialised (pass --weights state_dict.pt)"


def _is_entry_like(obj: Any) -> bool:
    return all(hasattr(obj, a) for a in ("build", "make_batch", "request_inputs"))


def _from_entry(label: str, entry: Any, weights: str) -> Target:
    example = entry.make_batch(list(EXAMPLE_COUNTS)).replicated()
    return Target(
        label, entry.build(), example, list(entry.request_inputs), entry.make_batch,
        weights=weights,
    )  # fmt: skip


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


def _candidates_in(path: str) -> str:
    """The names in a Python file a TARGET could point at, for the error that asks for one."""
    try:
        module = _import_module(path)
    except Exception as err:  # noqa: BLE001 - the listing is a courtesy; the error still stands
        return f" (importing it failed: {type(err).__name__}: {err})"
    kinds: dict[str, list[str]] = {"classes": [], "instances": [], "functions": []}
    for name, value in vars(module).items():
        if name.startswith("_"):
            continue
        if isinstance(value, type) and issubclass(value, nn.Module):
            if value.__module__ == module.__name__:
                kinds["classes"].append(name)
        elif isinstance(value, nn.Module):
            kinds["instances"].append(name)
        elif inspect.isfunction(value) and value.__module__ == module.__name__:
            kinds["functions"].append(name)
    found = "; ".join(f"{k}: {', '.join(v)}" for k, v in kinds.items() if v)
    return f" ({found})" if found else ""


def _load_program(spec: str) -> Target:
    from ..export import load

    path = Path(spec)
    if not path.is_file():
        raise TargetError(f"no such file: {spec}")
    if not zipfile.is_zipfile(path):
        raise TargetError(
            f"{spec} is not a saved program (rocs export and rocs.save write a .pt2 zip archive); "
            "a model in a Python file is named as path/to/file.py:NAME"
        )
    try:
        return Target(spec, program=load(spec).program, weights="saved in the program")
    except Exception as err:  # noqa: BLE001 - any load failure means "not a saved program"
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise TargetError(
            f"{spec} is not a program saved with rocs.save / torch.export.save "
            f"({type(err).__name__}: {first})"
        ) from err


def load_target(
    spec: str,
    request: Optional[list[str]] = None,
    inputs: Sequence[InputSpec] = (),
    weights: Optional[str] = None,
) -> Target:
    """Resolve TARGET (see the module docstring); ``inputs`` are ``--input`` specs, ``weights``
    a ``state_dict`` file loaded into the model."""
    if spec.endswith(".py") and ":" not in spec:
        if not Path(spec).is_file():
            raise TargetError(f"no such file: {spec}")
        raise TargetError(
            f"{spec}: name the model in the file, as {spec}:NAME (a class, an instance or a "
            f"factory function){_candidates_in(spec)}"
        )
    if spec.endswith(".pt2") or (Path(spec).is_file() and ":" not in spec):
        if inputs or weights:
            flag = "--input" if inputs else "--weights"
            raise TargetError(f"{flag} applies to models, not to a saved export")
        return _load_program(spec)
    if ":" not in spec:
        raise TargetError(
            f"cannot resolve TARGET {spec!r}: use models_zoo:NAME, package.module:NAME, "
            "path/to/file.py:NAME or a saved export (.pt2)"
        )
    module_name, attr = spec.rsplit(":", 1)
    if module_name == "models_zoo":
        from models_zoo import get_entry

        try:
            target = _from_entry(spec, get_entry(attr), FRESH_WEIGHTS)
        except KeyError as err:
            raise TargetError(str(err.args[0])) from None
    else:
        try:
            module = _import_module(module_name)
        except ImportError as err:
            raise TargetError(f"cannot import {module_name!r}: {err}") from None
        if not hasattr(module, attr):
            raise TargetError(
                f"{module_name} has no attribute {attr!r}"
                + (_candidates_in(module_name) if module_name.endswith(".py") else "")
            )
        target = _from_object(spec, getattr(module, attr))
    if weights:
        _load_weights(target, weights)
    if request:
        target.request_inputs = list(request)
    if inputs:
        _use_specs(target, list(inputs))
    elif target.example_kwargs is None:
        check_specs(target.model, [], spec)  # names the arguments that need an --input
    if not target.request_inputs:
        raise TargetError(f"{spec}: no request inputs; pass --request NAME[,NAME...]")
    return target


def _load_weights(target: Target, path: str) -> None:
    """Load a ``state_dict`` (``torch.save(model.state_dict(), path)``, or a checkpoint dict
    holding one under ``"state_dict"``) into the target's model, every key matching."""
    import torch

    if not Path(path).is_file():
        raise TargetError(f"--weights {path}: no such file")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any failure means "not a state_dict file"
        first = (str(err).strip().splitlines() or [""])[0]
        raise TargetError(
            f"--weights {path}: not a torch.save file ({type(err).__name__}: {first})"
        ) from err
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise TargetError(f"--weights {path}: holds a {type(state).__name__}, not a state_dict")
    try:
        target.model.load_state_dict(state)
    except RuntimeError as err:
        problems = [line.strip() for line in str(err).splitlines()[1:] if line.strip()]
        raise TargetError(
            f"--weights {path} does not fit {target.label}: {'; '.join(problems)[:300]}"
        ) from None
    target.weights = f"{path} ({len(state)} tensors)"


def _use_specs(target: Target, specs: list[InputSpec]) -> None:
    check_specs(target.model, specs, target.label)
    if not target.request_inputs:
        raise TargetError(
            f"{target.label}: which inputs are request-side? pass --request NAME[,NAME...] "
            f"(inputs: {', '.join(s.name for s in specs)})"
        )
    check_requests(specs, target.request_inputs)
    requests = list(target.request_inputs)
    target.make_batch = lambda counts: spec_batch(specs, requests, counts)
    target.example_kwargs = target.make_batch(EXAMPLE_COUNTS).replicated()


def _call_without_arguments(label: str, fn: Callable, kind: str) -> Any:
    try:
        inspect.signature(fn).bind()
    except TypeError:
        needed = [
            p.name
            for p in inspect.signature(fn).parameters.values()
            if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        raise TargetError(
            f"{label}: the {kind} needs arguments ({', '.join(needed)}); rocs calls it with none. "
            "Point TARGET at a no-argument factory function that builds the model, or at an "
            "instance"
        ) from None
    except ValueError:
        pass  # no signature (a builtin): just call it
    return fn()


def _from_object(label: str, obj: Any) -> Target:
    built = f"as {label} holds them (pass --weights state_dict.pt to load others)"
    if isinstance(obj, nn.Module):
        return Target(label, obj, weights=built)
    if isinstance(obj, type) and issubclass(obj, nn.Module):
        # Built here, so in eval mode here: a fresh module is in training mode.
        model = _call_without_arguments(label, obj, "class").eval()
        return Target(label, model, weights=FRESH_WEIGHTS)
    if _is_entry_like(obj):
        return _from_entry(label, obj, built)
    if not callable(obj):
        raise TargetError(
            f"{label} is a {type(obj).__name__}, not a model class, a model instance or a factory "
            "function"
        )
    made = _call_without_arguments(label, obj, "factory")
    built = f"as {label}() builds them (pass --weights state_dict.pt to load others)"
    if isinstance(made, nn.Module):
        return Target(label, made, weights=built)
    if _is_entry_like(made):
        return _from_entry(label, made, built)
    if isinstance(made, (tuple, list)) and len(made) in (2, 3):
        model, example = made[0], made[1]
        request = made[2] if len(made) == 3 else None
        request = [request] if isinstance(request, str) else (list(request) if request else None)
        if not isinstance(example, dict):
            raise TargetError(
                f"{label}: the factory's second value must be a dict of example kwargs"
            )
        return Target(label, model, example, request, weights=built)
    raise TargetError(
        f"{label}: the factory returned a {type(made).__name__}; it must return a model, "
        "(model, example_kwargs[, request_inputs]) or an object with build(), make_batch(counts) "
        f"and request_inputs (a bare model needs --input {NOTATION} per forward argument)"
    )
