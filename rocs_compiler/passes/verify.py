"""Executable invariants of the graphs the pipeline produces."""

from __future__ import annotations

import torch
from torch import fx

from ..errors import CompileError
from ..analysis.role_rules import request_index_argument
from ..kernels import reference_for
from ..ir.graph_meta import BROADCAST, INDEX_NAME, PLACEMENT, ROLE
from .share import is_scalar_node
from ..ir.roles import Role



def verify_roles(gm: fx.GraphModule) -> None:
    """Every node has a role; roles never decrease along edges (except into row-count-free
    scalars); nothing REQUEST depends on a candidate input."""
    for node in gm.graph.nodes:
        if ROLE not in node.meta:
            raise CompileError(f"node {node.name} has no role")
        if node.op == "output":
            continue
        role = node.meta[ROLE]
        if is_scalar_node(node):
            continue  # a batch size read off a candidate tensor is evaluated per placement
        for arg in node.all_input_nodes:
            if arg.meta[ROLE] > role:
                raise CompileError(
                    f"role decreases along {arg.name} ({arg.meta[ROLE].name}) -> "
                    f"{node.name} ({role.name})"
                )


def verify_shared(gm: fx.GraphModule) -> None:
    """In the shared graph: no node reads a value placed higher than itself (REQUEST nodes never
    read CANDIDATE values, but for the index in the argument their rule names), every edge from
    a REQUEST value into a CANDIDATE node passes through a broadcast or a fused op that takes the
    index, and every fused op has a reference."""
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        placement = node.meta.get(PLACEMENT)
        if placement is None:
            raise CompileError(f"node {node.name} has no placement after sharing")
        for arg in node.all_input_nodes:
            arg_placement = arg.meta[PLACEMENT]
            if is_scalar_node(arg) and arg.meta.get(ROLE) == Role.CONST:
                continue  # a size of the call (a history's width): the same where it is read
            if arg_placement > placement and not _reads_index_on_requests(node, arg):
                raise CompileError(
                    f"{placement.name} node {node.name} reads {arg_placement.name} node {arg.name}"
                )
            crosses = (placement, arg_placement) == (Role.CANDIDATE, Role.REQUEST)
            if crosses and not _takes_index(node):
                raise CompileError(f"{node.name} reads request value {arg.name} without broadcast")
        if _is_fused(node) and reference_for(node.target) is None:
            raise CompileError(f"fused op {node.target} has no reference implementation")
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    if names[-1] != INDEX_NAME:
        raise CompileError(f"the shared graph's last input must be {INDEX_NAME}")


def _reads_index_on_requests(node: fx.Node, arg: fx.Node) -> bool:
    """``node`` is placed on request rows and reads the index in the argument its role rule
    names (``passes/share.py``: which requests the candidates reference)."""
    return (
        arg.op == "placeholder"
        and arg.name == INDEX_NAME
        and request_index_argument(node.target) is not None
    )


def _is_fused(node: fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and node.target.namespace == "rocs"


def _takes_index(node: fx.Node) -> bool:
    return node.meta.get(BROADCAST, False) or _is_fused(node)
