"""Facts about concatenations that the normalize and defer rewrites share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import fx

from ..ir.folded import Fold
from ..ir.graph_meta import ROLE
from ..ir.roles import Role

aten = torch.ops.aten


def role_of(x: Any) -> Role:
    return x.meta.get(ROLE, Role.CANDIDATE) if isinstance(x, fx.Node) else Role.CONST


def val_of(x: Any) -> Any:
    return x.meta.get("val") if isinstance(x, fx.Node) else x


@dataclass(frozen=True)
class Concat:
    """``cat(pieces, dim)`` with static piece sizes along ``dim`` (normalized, >= 0)."""

    node: fx.Node
    pieces: tuple[fx.Node, ...]
    dim: int
    sizes: tuple[int, ...]

    @property
    def offsets(self) -> list[tuple[int, int]]:
        out, start = [], 0
        for size in self.sizes:
            out.append((start, start + size))
            start += size
        return out

    @property
    def roles(self) -> list[Role]:
        return [role_of(p) for p in self.pieces]

    @property
    def mixed(self) -> bool:
        """At least one request piece and one piece that is not: deferring pays off."""
        roles = set(self.roles)
        return Role.REQUEST in roles and len(roles) > 1

    @property
    def ndim(self) -> int:
        return self.node.meta["val"].dim()


def as_concat(node: Any) -> Optional[Concat]:
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    if node.target not in (aten.cat.default, aten.concat.default):
        return None
    pieces = tuple(node.args[0])
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or len(pieces) < 2:
        return None
    dim %= val.dim()
    sizes = []
    for piece in pieces:
        pval = val_of(piece)
        if not isinstance(pval, torch.Tensor) or pval.dim() != val.dim():
            return None
        size = pval.shape[dim]
        if not isinstance(size, int):
            return None  # a batch-dependent size along the cat dim
        sizes.append(size)
    return Concat(node, pieces, dim, tuple(sizes))


def mixed_concat(node: Any) -> Optional[Concat]:
    info = as_concat(node)
    return info if info is not None and info.mixed else None


def constant_index_entries(node: Any, *, state: bool) -> Optional[list[int]]:
    """The entries of a 1-D int64/int32 tensor of static length computed from constants only
    (literal lists, which export lifts as ``lifted_tensor_*``; with ``state``, buffers and tensor
    attributes too; through copies, casts or ``arange``), or None. A constant-role placeholder
    (an unbatched input) varies between calls; model state may be written after compile, so a
    rule that reads it must follow the writes itself."""
    val = val_of(node)
    if (
        not isinstance(node, fx.Node)
        or role_of(node) != Role.CONST
        or not isinstance(val, torch.Tensor)
        or val.dim() != 1
        or val.dtype not in (torch.int64, torch.int32)
        or not isinstance(val.shape[0], int)
    ):
        return None
    stack, seen = [node], set()
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if current.op not in ("get_attr", "call_function"):
            return None
        if current.op == "get_attr" and not state and "lifted_tensor" not in str(current.target):
            return None
        stack.extend(current.all_input_nodes)
    return Fold.of(node).evaluate(node.graph.owning_module).tolist()


def runs_in_pieces(info: Concat, positions: list[int]) -> list[tuple[int, int, int]]:
    """``(piece, first, end)``: the maximal runs of ``positions`` (along the concatenated dim)
    that fall in one piece, in order."""
    runs: list[list[int]] = []
    for at, value in enumerate(positions):
        piece = next(k for k, (lo, hi) in enumerate(info.offsets) if lo <= value < hi)
        if runs and runs[-1][0] == piece:
            runs[-1][2] = at + 1
        else:
            runs.append([piece, at, at + 1])
    return [tuple(run) for run in runs]
