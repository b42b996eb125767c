"""Jagged calls of an exported program: a padded call run as groups of requests cut to their
history lengths, outside the program, as the compiled model runs it (``runtime/call/jagged.py``).

An exported program (``rocs.export``; saved, packaged with AOTInductor, or converted to ONNX) of a
model whose history length is dynamic takes any width, and the compiled model's truncation proof
holds for it: it computes the same graph. ``rocs.export`` puts the compiled model's jagged plan
(``jagged.plan_of``: the histories and their dims, where each request's length is read, the
grouping's unit costs, the caps) in the program's graph metadata (:data:`JAGGED_META`);
``rocs.save`` writes it into the archive, ``rocs.load`` reads it back (``LoadedProgram`` then cuts
its calls), ``rocs.aoti_package`` puts it in the package's metadata and ``rocs.export_onnx`` in the
model's metadata properties, each under the same key (``rocs.jagged_plan`` reads any of them).
:class:`JaggedProgram` wraps any callable that takes the program's shared-layout call by keywords
(``program.module()``, an AOTInductor runner, an ONNX Runtime session adapter) and runs each padded
call as the compiled model would: requests grouped by length, each group's histories cut to its
widest, the groups' outputs put back in the candidates' order. Histories given as jagged nested
tensors (``torch.nested``, layout ``torch.jagged``) are padded first, as the compiled model pads
them (``runtime/call/nested_histories.py``).

Identity: as ``runtime/call/jagged.py``: every output row of the call is the same at any width at
or past its request's length, and no row reads another.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..runtime.call.input_checks import refuse_past_caps
from ..runtime.call.jagged import NOT_SPLIT, from_plan

JAGGED_META = "rocs.jagged"  # the key of the plan, in every place a program carries it


def plan_of_program(program: Any) -> dict | None:
    """The jagged plan an ``ExportedProgram`` carries (None: its calls keep their width)."""
    graph_module = getattr(program, "graph_module", None)
    meta = getattr(graph_module, "meta", None) or {}
    return meta.get(JAGGED_META)


def read_plan(text: str | None) -> dict | None:
    """A plan as metadata stores it (JSON text, or empty)."""
    return json.loads(text) if text else None


def jagged_plan(source: Any) -> dict | None:
    """The jagged plan of ``source``: an ``ExportedProgram`` or a ``LoadedProgram``, or a
    metadata mapping (an AOTInductor runner's ``get_metadata()``, an ONNX Runtime session's
    ``get_modelmeta().custom_metadata_map``); None where the calls keep their width."""
    program = getattr(source, "program", source)
    if hasattr(program, "graph_module"):
        return plan_of_program(program)
    if isinstance(source, Mapping):
        return read_plan(source.get(JAGGED_META))
    raise TypeError(
        f"jagged_plan takes an exported or loaded program or a metadata mapping, got "
        f"{type(source).__name__}"
    )


class JaggedProgram:
    """``run`` (the program's shared-layout call by keywords, ``candidate_to_request`` included)
    with each padded call cut to its requests' history lengths, by ``plan``."""

    def __init__(self, run: Callable[..., Any], plan: Mapping[str, Any]):
        self._run = run
        self._calls = from_plan(dict(plan))
        self._caps = [tuple(cap) for cap in plan.get("caps", ())]

    @property
    def split_calls(self) -> int:
        """How many calls ran as more than one group."""
        return self._calls.split_calls

    def __call__(self, *args: Any, candidate_to_request: torch.Tensor, **kwargs: Any) -> Any:
        try:
            bound = dict(self._calls.signature.bind(*args, **kwargs).arguments)
        except TypeError:  # the program names the mistake
            return self._run(*args, candidate_to_request=candidate_to_request, **kwargs)
        bound = self._calls.padded(bound)  # histories given as jagged nested tensors
        refuse_past_caps(self._caps, bound)  # before any group is cut below a cap
        run = self._run
        result = self._calls.split(
            lambda inputs, index: run(**inputs, candidate_to_request=index),
            bound,
            candidate_to_request,
        )
        if result is NOT_SPLIT:
            return self._run(**bound, candidate_to_request=candidate_to_request)
        return result
