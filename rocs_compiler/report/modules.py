"""The report per ``nn.Module``: parameters, nodes and FLOPs per request and per candidate.

Each ATen node belongs to the module it was traced in (``head.0`` is ``model.head[0]``) and
counts toward that module and every module above it (``head``), so a row sums its subtree.
Nodes outside any submodule (the model's own ``forward``) form the row ``(top level)``.
Parameters are counted once per tensor, in the module that owns them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from torch import nn

TOP = "(top level)"


@dataclass
class ModuleRow:
    module: str
    depth: int  # 0 for top-level modules, 1 for their children, ...
    params: int
    request_flops: float  # per request, summed over the REQUEST nodes of the subtree
    candidate_flops: float  # per candidate, over its CANDIDATE nodes
    request_nodes: int
    candidate_nodes: int
    nodes: int  # all nodes, CONST included


def _prefixes(module: str) -> list[str]:
    if not module:
        return [TOP]
    parts = module.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def parameter_counts(model: nn.Module) -> dict[str, int]:
    """Parameters per owning module (``head.0``; ``""`` for the model itself), each tensor once."""
    counts: dict[str, int] = {}
    for fqn, param in model.named_parameters():
        owner = fqn.rsplit(".", 1)[0] if "." in fqn else ""
        counts[owner] = counts.get(owner, 0) + param.numel()
    return counts


def module_rows(nodes: Iterable, params: dict[str, int]) -> list[ModuleRow]:
    """One row per module (and per ancestor), parents before children, in graph order.

    ``nodes`` are :class:`~rocs_compiler.report.build.NodeReport` (anything with ``module``, ``role``
    and ``flops``); ``params`` maps an owning module to its parameter count.
    """
    rows: dict[str, ModuleRow] = {}
    children: dict[str, list[str]] = {"": []}

    def row(name: str) -> ModuleRow:
        if name not in rows:
            parent = name.rsplit(".", 1)[0] if "." in name and name != TOP else ""
            if parent:
                row(parent)
            children.setdefault(parent, []).append(name)
            children.setdefault(name, [])
            depth = 0 if name == TOP else name.count(".")
            rows[name] = ModuleRow(name, depth, 0, 0.0, 0.0, 0, 0, 0)
        return rows[name]

    for node in nodes:
        if node.op == "input":
            continue
        for name in _prefixes(node.module):
            r = row(name)
            r.nodes += 1
            if node.role == "REQUEST":
                r.request_flops += node.flops
                r.request_nodes += 1
            elif node.role == "CANDIDATE":
                r.candidate_flops += node.flops
                r.candidate_nodes += 1
    for owner, count in params.items():
        for name in _prefixes(owner):
            row(name).params += count
    ordered: list[ModuleRow] = []

    def walk(name: str) -> None:
        for child in children.get(name, []):
            ordered.append(rows[child])
            walk(child)

    walk("")
    return ordered
