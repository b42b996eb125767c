"""The rewrite engine: patterns with pure replacements and guards, applied to a fixpoint.

A :class:`Rewrite` names the ops its anchor may have, and a ``apply(builder, node)`` function
that either returns ``None`` (the guard failed: nothing was built) or the node that replaces the
anchor. Replacements create nodes only through the :class:`Builder`, which infers each new
node's fake value; the engine alone splices the graph (``replace_all_uses_with``), removes dead
nodes, re-runs the role analysis and counts what fired.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch
from torch import fx
from torch._guards import detect_fake_mode

from ..errors import CompileError


class Builder:
    """Creates nodes before an anchor, with ``meta["val"]`` inferred on fake tensors."""

    def __init__(self, gm: fx.GraphModule, anchor: fx.Node, fake_mode: Any):
        self.gm = gm
        self.anchor = anchor
        self.fake_mode = fake_mode
        self.created: list[fx.Node] = []

    def call(self, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        with self.gm.graph.inserting_before(self.anchor):
            node = self.gm.graph.call_function(target, args, kwargs)
        vals = fx.map_arg((args, kwargs), lambda n: n.meta["val"])
        with self.fake_mode:
            node.meta["val"] = target(*vals[0], **vals[1])
        for key in ("nn_module_stack", "stack_trace"):
            if key in self.anchor.meta:
                node.meta[key] = self.anchor.meta[key]
        self.created.append(node)
        return node

    def discard(self) -> None:
        for node in reversed(self.created):
            if not node.users:
                self.gm.graph.erase_node(node)
        self.created.clear()


@dataclass(frozen=True)
class Rewrite:
    name: str
    anchors: frozenset  # OpOverloadPackets (or functions) the anchor node may have
    apply: Callable[[Builder, fx.Node], Optional[fx.Node]]
    doc: str = ""


def _packet(target: Any) -> Any:
    return getattr(target, "overloadpacket", target)


def rewrite_to_fixpoint(
    gm: fx.GraphModule,
    rewrites: Iterable[Rewrite],
    reanalyze: Callable[[fx.GraphModule], None],
    max_rewrites: int = 5000,
) -> dict[str, int]:
    rewrites = list(rewrites)
    by_anchor: dict[Any, list[Rewrite]] = collections.defaultdict(list)
    for rw in rewrites:
        if callable(rw.anchors):
            by_anchor[None].append(rw)
            continue
        for anchor in rw.anchors:
            by_anchor[anchor].append(rw)
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    fake_mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    counts = {rw.name: 0 for rw in rewrites}
    total = 0
    reanalyze(gm)
    while True:
        fired = _sweep(gm, by_anchor, fake_mode, counts)
        if not fired:
            break
        total += 1
        if total > max_rewrites:
            raise CompileError(f"rewrites did not reach a fixpoint after {max_rewrites} steps")
        gm.graph.eliminate_dead_code()
        reanalyze(gm)
    gm.recompile()
    return counts


def _sweep(gm, by_anchor, fake_mode, counts) -> bool:
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        predicates = [rw for rw in by_anchor.get(None, ()) if rw.anchors(node.target)]
        for rw in [*by_anchor.get(_packet(node.target), ()), *predicates]:
            builder = Builder(gm, node, fake_mode)
            new = rw.apply(builder, node)
            if new is None:
                builder.discard()
                continue
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)  # also ops that DCE keeps (tagged random, e.g. sdpa)
            counts[rw.name] += 1
            return True
    return False
