"""Portable programs: the rewritten graph with every ``rocs::`` op replaced by plain torch.

Each :class:`~rocs_compiler.kernels.rocs_op.RocsOp` carries a ``reference``: the op's value
computed by materializing the broadcast ``x[candidate_to_request]`` and running the unfused op.
Interpreting the rewritten graph with every ``rocs::`` node called through its portable form (the
reference, or the op's own ``portable`` where materializing costs more than the op: attention,
whose reference would copy each request's keys and values once per candidate,
``kernels/attention_portable.py``), under ``torch.export``, gives a program of ATen ops only, which
loads with ``torch.export.load`` in a process without this package, compiles with AOTInductor into
a package that a C++ program runs, and exports to ONNX. The sharing is kept: the request side
still runs at R rows, and reaches the candidates by gathers (``index``/``index_select`` of R rows
with the index); attention reads its keys and values per request.

The same forms are what Inductor compiles in the ``torch.compile`` door
(:func:`portable_graph_module`): written in ATen ops, a request term's gather and its add fuse into
the kernels around them, where an opaque ``rocs::`` call would stand between Inductor's kernels and
check its index again on every call.

Identity: ``rocs::<name>(*args) == ROCS_OPS[name].portable_form(*args)`` for every argument the op
accepts (the op registry's tests check each op and each portable form against the reference).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from ..kernels import rocs_op_for


def _positional(target: Any, args: tuple, kwargs: dict) -> tuple:
    """``args`` and ``kwargs`` of a call of the op ``target`` as positional arguments in its
    schema's order, defaults filled in (the references take positional arguments)."""
    if not kwargs:
        return tuple(args)
    values = list(args)
    for argument in target._schema.arguments[len(args):]:
        if argument.name in kwargs:
            values.append(kwargs[argument.name])
        else:
            values.append(argument.default_value if argument.has_default_value() else None)
    return tuple(values)


class PortableInterpreter(fx.Interpreter):
    """Runs a rewritten graph with each ``rocs::`` op replaced by its portable form."""

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        op = rocs_op_for(target)
        if op is None:
            return super().call_function(target, args, kwargs)
        return op.portable_form(*_positional(target, args, kwargs))


def portable_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose ``rocs::`` nodes call their portable forms (plain Python functions
    of torch ops, which dynamo traces into the graph it hands Inductor). The index is not checked
    by the forms: the caller checks it once per call, as the runtime does."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        op = rocs_op_for(node.target) if node.op == "call_function" else None
        if op is None:
            env[node] = graph.node_copy(node, env.__getitem__)
            continue
        args = fx.map_arg(_positional(node.target, node.args, node.kwargs), env.__getitem__)
        env[node] = graph.call_function(op.portable_form, args)
        env[node].meta = dict(node.meta)
    return fx.GraphModule(gm, graph)


def rocs_ops_in(program: torch.export.ExportedProgram) -> list[str]:
    """The ``rocs::`` ops a program calls (empty for a portable program)."""
    names = {
        str(node.target)
        for node in program.graph.nodes
        if node.op == "call_function" and getattr(node.target, "namespace", None) == "rocs"
    }
    return sorted(names)
