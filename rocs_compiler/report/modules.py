"""The report per ``nn.Module``: parameters, nodes and FLOPs per request and per candidate.

Each ATen node belongs to the module it was traced in (``head.0`` is ``model.head[0]``) and
counts toward that module and every module above it (``head``), so a row sums its subtree.
Nodes outside any submodule (the model's own ``forward``) form the row ``(top level)``.
Parameters are counted once per tensor, in the module that owns them. A module whose
parameters another module's code reads (``nn.MultiheadAttention`` applies ``out_proj.weight``
itself) has no nodes of its own; its row names the nodes that read them, so its work is found
where it is counted.
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
    read_by: str = ""  # a row without nodes: the nodes that read its parameters, "node (module)"


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


def parameter_readers(gm, param_names: dict[str, str]) -> dict[str, list[str]]:
    """Per owning module, the nodes of ``gm`` that read its parameters, as ``"node (module)"``;
    ``param_names`` maps a weight's attribute in ``gm`` to its name in the model."""
    from ..analysis.driver import source_module

    readers: dict[str, list[str]] = {}
    for node in gm.graph.nodes:
        fqn = param_names.get(node.target) if node.op == "get_attr" else None
        if fqn is None:
            continue
        owner = fqn.rsplit(".", 1)[0] if "." in fqn else ""
        seen = readers.setdefault(owner, [])
        for user in _compute_users(node):
            text = f"{user.name} ({source_module(user) or TOP})"
            if text not in seen:
                seen.append(text)
    return readers


def _compute_users(node) -> list:
    """The first nodes past ``node`` that are not views or splits of a weight (FLOPs live there)."""
    out, stack, seen = [], list(node.users), set()
    while stack:
        user = stack.pop(0)
        if user in seen:
            continue
        seen.add(user)
        if user.op == "call_function" and _weight_view(user):
            stack.extend(user.users)
        elif user.op != "output":
            out.append(user)
    return out


def _weight_view(node) -> bool:
    import operator

    name = getattr(node.target, "__name__", str(node.target))
    return node.target is operator.getitem or name.split(".")[0] in _VIEW_OPS


_VIEW_OPS = {"split_with_sizes", "split", "slice", "t", "transpose", "view", "reshape", "chunk"}


def module_rows(
    nodes: Iterable, params: dict[str, int], readers: dict[str, list[str]] | None = None
) -> list[ModuleRow]:
    """One row per module (and per ancestor), parents before children, in graph order.

    ``nodes`` are :class:`~rocs_compiler.report.build.NodeReport` (anything with ``module``, ``role``
    and ``flops``); ``params`` maps an owning module to its parameter count; ``readers`` (from
    :func:`parameter_readers`) names, for a module without nodes, where its parameters are read.
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
    for owner, read in (readers or {}).items():
        if owner in rows and not rows[owner].nodes:
            rows[owner].read_by = ", ".join(read)
    ordered: list[ModuleRow] = []

    def walk(name: str) -> None:
        for child in children.get(name, []):
            ordered.append(rows[child])
            walk(child)

    walk("")
    return ordered
