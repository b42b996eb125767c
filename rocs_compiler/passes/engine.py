"""The rewrite engine: patterns with pure replacements and guards, applied to a fixpoint.

A :class:`Rewrite` names the ops its anchor may have, and a ``apply(builder, node)`` function
that either returns ``None`` (the guard failed: nothing was built) or the node that replaces the
anchor. Replacements create nodes only through the :class:`Builder`, which infers each new
node's fake value; the engine alone splices the graph (``replace_all_uses_with``), removes the
nodes the splice left dead, keeps roles current node by node and counts what fired.

Cost: a sweep infers each node's role once and tries its rewrites once, plus the same for the
nodes a fired rewrite built; the zoo reaches its fixpoint in one sweep and confirms it in a
second, where re-analysing the whole graph after every rewrite was quadratic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Union

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
    # The ops the anchor node may have: a set of OpOverloadPackets (or functions), or a
    # predicate on the node's target (say, "every elementwise op"). Rewrites that anchor on the
    # same node are tried in list order; the first that builds a replacement wins.
    anchors: Union[frozenset, Callable[[Any], bool]]
    apply: Callable[[Builder, fx.Node], Optional[fx.Node]]
    doc: str = ""

    def anchors_on(self, target: Any) -> bool:
        if callable(self.anchors):
            return bool(self.anchors(target))
        return getattr(target, "overloadpacket", target) in self.anchors


class _Candidates:
    """The rewrites that may anchor on a target, in list order, looked up once per target."""

    def __init__(self, rewrites: list[Rewrite]):
        self.rewrites = rewrites
        self.memo: dict[Any, list[Rewrite]] = {}

    def __call__(self, target: Any) -> list[Rewrite]:
        if target not in self.memo:
            self.memo[target] = [rw for rw in self.rewrites if rw.anchors_on(target)]
        return self.memo[target]


def rewrite_to_fixpoint(
    gm: fx.GraphModule,
    rewrites: Iterable[Rewrite],
    infer_node: Callable[[fx.Node], None],
    max_rewrites: int = 5000,
) -> dict[str, int]:
    """Apply ``rewrites`` until none fires; returns how often each fired.

    ``infer_node(node)`` (re)computes one node's role (or placement) from its inputs' roles.
    A sweep walks the graph in topological order and calls it on every node before trying the
    rewrites anchored there, so the inputs a guard reads are always current and one sweep is
    also one analysis pass. When a rewrite fires, the sweep goes on from the first node the
    replacement built (they sit just before the anchor), so the earliest rewritable node is
    always rewritten first, as if the walk restarted from the top, without re-walking the nodes
    before it. Only a guard that reads users (a single-user check) can change its answer on a
    node already passed; sweeps repeat until one fires nothing, which leaves every role current.
    """
    rewrites = list(rewrites)
    candidates = _Candidates(rewrites)
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    fake_mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    counts = {rw.name: 0 for rw in rewrites}
    gm.graph.eliminate_dead_code()  # from here on, only what a rewrite orphans can be dead
    while _sweep(gm, candidates, infer_node, fake_mode, counts, max_rewrites):
        pass
    gm.recompile()
    return counts


def _sweep(gm, candidates, infer_node, fake_mode, counts, max_rewrites) -> bool:
    """One pass over the graph in topological order; True when a rewrite fired."""
    fired = False
    total = sum(counts.values())
    node = next(iter(gm.graph.nodes))
    while node.op != "root":  # the graph's sentinel, after the output node
        infer_node(node)
        following = node.next
        if node.op == "call_function":
            for rw in candidates(node.target):
                builder = Builder(gm, node, fake_mode)
                new = rw.apply(builder, node)
                if new is None:
                    builder.discard()
                    continue
                erased = _splice(gm, node, new, builder.created)
                counts[rw.name] += 1
                total += 1
                if total > max_rewrites:
                    _no_fixpoint(counts, max_rewrites)
                fired = True
                built = [n for n in builder.created if n not in erased]
                following = built[0] if built else following
                break
        node = following
    return fired


def _no_fixpoint(counts: dict[str, int], max_rewrites: int) -> None:
    busiest = sorted(counts.items(), key=lambda item: -item[1])[:3]
    raise CompileError(
        f"rewrites did not reach a fixpoint after {max_rewrites} rewrites (most often: "
        + ", ".join(f"{name} {count}x" for name, count in busiest)
        + "); two rewrites probably undo each other"
    )


def _splice(gm, anchor, new, created) -> set[fx.Node]:
    inputs = anchor.all_input_nodes
    anchor.replace_all_uses_with(new)
    gm.graph.erase_node(anchor)  # also ops that DCE keeps (tagged random, e.g. sdpa)
    return _erase_dead(gm, [*inputs, *created])


def _erase_dead(gm: fx.GraphModule, roots: list[fx.Node]) -> set[fx.Node]:
    """Erase the pure nodes among ``roots`` that have no users, and what only they used: the
    graph was free of dead code before the rewrite, so nothing else can have become dead."""
    stack = list(roots)
    erased: set[fx.Node] = set()
    while stack:
        node = stack.pop()
        if node in erased or node.users or node.is_impure():
            continue
        stack.extend(node.all_input_nodes)
        gm.graph.erase_node(node)
        erased.add(node)
    return erased
