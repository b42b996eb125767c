"""Facts about concatenations that the normalize and defer rewrites share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import fx

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
