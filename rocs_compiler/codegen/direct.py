"""Direct calls of the ``rocs::`` ops for running a compiled graph.

A compiled graph keeps ``torch.ops.rocs.*`` nodes: that is what export, the reports and the
verifier read. Calling them through the dispatcher costs each call the custom-op machinery
plus the op's argument checks, about 50 us on a CPU, which for the small GEMMs of a ranking
model is as much as the GEMM itself. Inside the runtime those checks are redundant: shapes
and dtypes were fixed when the graph was traced (fake-tensor propagation through each op's
fake kernel), and ``candidate_to_request`` is checked once per call by the runtime before
the graph runs. ``direct_module(gm)`` is a copy of the graph whose op nodes call each op's
device dispatch (``run_*``: Triton on CUDA, the torch path on the CPU) with no checks.

Identity relied on: ``torch.ops.rocs.X(*args) == run_X(*args)`` whenever the op's checks
pass; the op body is ``checks; return run_X(*args)``.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import fx

from rocs_compiler.codegen import attention, interaction, linear, pointwise

RUNNERS: dict[object, Callable[..., torch.Tensor]] = {
    torch.ops.rocs.broadcast_linear.default: linear.run_broadcast_linear,
    torch.ops.rocs.broadcast_linear_compression.default: linear.run_broadcast_linear_compression,
    torch.ops.rocs.broadcast_attention.default: attention.run_broadcast_attention,
    torch.ops.rocs.broadcast_interaction.default: interaction.run_broadcast_interaction,
    torch.ops.rocs.broadcast_pointwise.default: pointwise.run_broadcast_pointwise,
}


def direct_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` calling the ops' ``run_*`` functions; it shares ``gm``'s tensors.

    Returns ``gm`` itself when it has no ``rocs::`` op. The copy holds references to the
    same parameters and buffers, so it must be rebuilt if ``gm``'s tensors are replaced
    (``Module.to`` replaces buffers).
    """
    if not any(n.op == "call_function" and n.target in RUNNERS for n in gm.graph.nodes):
        return gm
    graph = fx.Graph()
    values: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, values))
    for node in graph.nodes:
        if node.op == "call_function" and node.target in RUNNERS:
            node.target = RUNNERS[node.target]
    return fx.GraphModule(gm, graph, class_name=type(gm).__name__ + "Direct")
