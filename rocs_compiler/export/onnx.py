"""ONNX export of a portable program: ``rocs.export_onnx(program, path)``.

``torch.onnx.export(program, dynamo=True)`` translates a portable program (ATen ops only) into
an ONNX graph that ONNX Runtime runs with dynamic R and N. ONNX has no assert, so the exporter
drops the program's ``_assert_async`` checks; the data-flow guard of the index
(``input_checks.py``: a gather out of bounds exactly when a check fails) stays, and this module
names its ONNX node after the checks, so ONNX Runtime's refusal reads
``... running Gather node. Name:'rocs input check failed: ...'``.

A program that still calls ``rocs::`` ops (exported without ``portable=True``), or an ATen op
the ONNX exporter cannot translate, is refused with a :class:`CompileError` naming the ops.
"""

from __future__ import annotations

import os
import re
from typing import Optional

import torch
from torch import fx

from ..errors import CompileError
from .portable import rocs_ops_in

CHECK_NODE_NAME = (
    "rocs input check failed: candidate_to_request must lie in [0, R), request inputs must have "
    "one row per request, KeyedJaggedTensor lengths must fit their ids"
)


def _guard_node(program: torch.export.ExportedProgram) -> Optional[fx.Node]:
    """The index guard's gather ``zeros(1).index_select(0, failed)`` (``input_checks.py``)."""
    for node in program.graph.nodes:
        if getattr(node.target, "_opname", None) != "index_select":
            continue
        source = node.args[0]
        if isinstance(source, fx.Node) and getattr(source.target, "_opname", None) == "zeros":
            val = source.meta.get("val")
            if val is not None and tuple(val.shape) == (1,) and val.dtype == torch.int64:
                return node
    return None


def _unsupported_ops(message: str) -> list[str]:
    return sorted(set(re.findall(r"\b(?:aten|prims|rocs)\.\w+(?:\.\w+)?", message)))


def export_onnx(program: torch.export.ExportedProgram, path: str | os.PathLike) -> str:
    """Write ``program`` (a portable program, ``rocs.export(cm, portable=True)``) as an ONNX model
    at ``path`` with dynamic R and N; return the path. Inputs are the program's flat inputs in
    call order (the model's arguments by their leaf names, then ``candidate_to_request``)."""
    fused = rocs_ops_in(program)
    if fused:
        raise CompileError(
            f"ONNX has no operator for {', '.join(fused)}: export the model with "
            "rocs.export(cm, portable=True) (rocs export --portable), which computes them in "
            "plain torch"
        )
    guard = _guard_node(program)
    try:
        onnx_program = torch.onnx.export(program, (), dynamo=True, verbose=False)
    except Exception as err:  # the exporter's own error types vary between torch versions
        ops = _unsupported_ops(str(err))
        named = f" (ops: {', '.join(ops)})" if ops else ""
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CompileError(f"ONNX export failed{named}: {first}") from err
    model = onnx_program.model_proto
    if guard is not None:
        marker = f"%{guard.name} :"
        for node in model.graph.node:
            fx_node = {p.key: p.value for p in node.metadata_props}.get("pkg.torch.onnx.fx_node")
            if node.op_type == "Gather" and fx_node is not None and fx_node.startswith(marker):
                node.name = CHECK_NODE_NAME
    import onnx

    onnx.save(model, os.fspath(path))
    return os.fspath(path)

