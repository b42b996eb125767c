"""ONNX export of a portable program: ``rocs.export_onnx(program, path)``.

``torch.onnx.export(program, dynamo=True)`` translates a portable program (ATen ops only) into
an ONNX graph that ONNX Runtime runs with dynamic R and N. ONNX has no assert, so the exporter
drops the program's ``_assert_async`` checks; the data-flow guards (``input_checks.py``: a
gather out of bounds exactly when a check fails, of the index and of each batch norm's input)
stay, and this module names their ONNX nodes after the checks, so ONNX Runtime's refusal reads
``... running Gather node. Name:'rocs input check failed: ...'``.

Masked attention is written out in plain ops first (``onnx_attention.py``), so that a query that
sees no key gets eager's zeros; embedding bags as a gather and a scatter-add, which ONNX Runtime
runs as kernels where the exporter's translation is a ``Loop`` over the bags (``onnx_bags.py``);
and the inputs and their dynamic dims are named (``R``, ``N``,
``L_<input>``: ``size_names.py``).

A program that still calls ``rocs::`` ops (exported without ``portable=True``), or an ATen op
the ONNX exporter cannot translate, is refused with a :class:`CompileError` naming the ops.
"""

from __future__ import annotations

import json
import os
import re

import torch
from torch import fx

from ..errors import CompileError
from . import symbolic_signature
from .onnx_attention import with_eager_attention
from .onnx_bags import with_gathered_bags
from .jagged_program import JAGGED_META, plan_of_program
from .portable import rocs_ops_in
from .size_names import size_names

CHECK_NODE_NAME = (
    "rocs input check failed: candidate_to_request must lie in [0, R), request inputs must have "
    "one row per request, KeyedJaggedTensor lengths must fit their ids, sizes the model caps "
    "(a history past a positional table's rows) must be at most the cap"
)


VALUES_PER_CHANNEL_NODE_NAME = (
    "rocs input check failed: a batch norm with batch statistics needs more than 1 value per "
    "channel"
)


def _guard_nodes(program: torch.export.ExportedProgram) -> dict[fx.Node, str]:
    """The guards' gathers ``zeros(1).index_select(0, failed)`` (``input_checks.py``), each with
    the name its ONNX node gets: the index's reads an int64 zero, a batch norm's an int32 one."""
    names = {torch.int64: CHECK_NODE_NAME, torch.int32: VALUES_PER_CHANNEL_NODE_NAME}
    guards = {}
    for node in program.graph.nodes:
        if getattr(node.target, "_opname", None) != "index_select":
            continue
        source = node.args[0]
        if isinstance(source, fx.Node) and getattr(source.target, "_opname", None) == "zeros":
            val = source.meta.get("val")
            if val is not None and tuple(val.shape) == (1,) and val.dtype in names:
                guards[node] = names[val.dtype]
    return guards


def _unsupported_ops(message: str) -> list[str]:
    return sorted(set(re.findall(r"\b(?:aten|prims|rocs)\.\w+(?:\.\w+)?", message)))


def export_onnx(program: torch.export.ExportedProgram, path: str | os.PathLike) -> str:
    """Write ``program`` (a portable program, ``rocs.export(cm, portable=True)``) as an ONNX model
    at ``path`` with dynamic R and N; return the path. Inputs are the program's flat inputs in
    call order, named by their leaf names as ``input_signature(program)`` lists them (the model's
    arguments, ``features.user_age`` inside a dict, ``X.0:2`` for a column piece, then
    ``candidate_to_request``), their dynamic dims ``R``, ``N`` and ``L_<input>``."""
    fused = rocs_ops_in(program)
    if fused:
        raise CompileError(
            f"ONNX has no operator for {', '.join(fused)}: export the model with "
            "rocs.export(cm, portable=True) (rocs export --portable), which computes them in "
            "plain torch"
        )
    plan = plan_of_program(program)  # before the rewrites, which make new programs
    program = with_gathered_bags(with_eager_attention(program))
    guards = _guard_nodes(program)
    signature = symbolic_signature(program)
    try:
        onnx_program = torch.onnx.export(
            program, (), dynamo=True, verbose=False, input_names=list(signature)
        )
    except Exception as err:  # the exporter's own error types vary between torch versions
        ops = _unsupported_ops(str(err))
        named = f" (ops: {', '.join(ops)})" if ops else ""
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CompileError(f"ONNX export failed{named}: {first}") from err
    onnx_program.rename_axes(size_names(signature))
    model = onnx_program.model_proto
    markers, taken = {}, set()
    for guard, name in guards.items():  # ONNX node names are unique: number a second check
        numbered, k = name, 1
        while numbered in taken:
            k += 1
            numbered = f"{name} ({k})"
        taken.add(numbered)
        markers[f"%{guard.name} :"] = numbered
    for node in model.graph.node:
        fx_node = {p.key: p.value for p in node.metadata_props}.get("pkg.torch.onnx.fx_node")
        if node.op_type == "Gather" and fx_node is not None:
            name = markers.get(fx_node.split(" ", 2)[0] + " :")
            if name is not None:
                node.name = name
    if plan is not None:  # ``jagged_program.py``: a caller may cut its calls
        entry = model.metadata_props.add()
        entry.key, entry.value = JAGGED_META, json.dumps(plan)
    import onnx

    onnx.save(model, os.fspath(path))
    return os.fspath(path)

