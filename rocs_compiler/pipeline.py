"""The compilation pipeline as one readable function.

capture -> analyze -> normalize + defer (one rewrite set; re-analyzes) -> verify roles -> share
-> ikbo -> cleanup -> verify the shared graph. FLOPs per node are counted on first use
(:attr:`PipelineResult.costs`), for reports and the runtime's program choice.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from torch import fx, nn

from .analysis.driver import Analysis, analyze
from .analysis.role_rules import dropout_per_request
from .capture.trace import CapturedGraph, capture
from .ir.graph_meta import ROLE
from .ir.roles import Role
from .options import Options
from .passes.share import share
from .progress import stage


@dataclass
class PipelineResult:
    captured: CapturedGraph
    analysis: Analysis  # roles of the deferred graph, before sharing
    logical_graph: fx.GraphModule  # after defer: every node at batch size (the cost model's view)
    shared_graph: fx.GraphModule  # what the runtime executes
    pass_counts: dict[str, int] = field(default_factory=dict)
    # The graph as captured, with the roles of the first analysis: the model as the user wrote
    # it, before any rewrite (for reports; it shares the logical graph's weights).
    captured_graph: fx.GraphModule | None = None
    _costs: dict | None = None
    _captured_costs: dict | None = None

    @property
    def costs(self) -> dict:
        """FLOPs per node of the logical graph (computed on first use)."""
        if self._costs is None:
            from .analysis.flops import node_costs

            self._costs = node_costs(self.logical_graph, self.captured.batch_symbol)
        return self._costs

    def unit_flops(self, lengths: Mapping[str, int] | None = None) -> tuple[float, float]:
        """(FLOPs per request, FLOPs per candidate) of the logical graph, at the history
        ``lengths`` (``{input: length}``, :meth:`costs_at`) or else the example's: what the
        runtime's program choice weighs the two programs by."""
        per_role = {Role.REQUEST: 0.0, Role.CANDIDATE: 0.0}
        costs = self.costs_at(lengths) if lengths else self.costs
        for node in self.logical_graph.graph.nodes:
            cost = costs.get(node.name)
            role = node.meta.get(ROLE)
            if cost is not None and role in per_role:
                per_role[role] += cost.per_row
        return per_role[Role.REQUEST], per_role[Role.CANDIDATE]

    def length_symbols(self) -> dict[str, Any]:
        """``{input name: size symbol}`` of each input whose example marked a dim past the batch
        dynamic (a history length): the first such dim's symbol."""
        return {name: size.node.expr for name, size in self.length_sizes().items()}

    def length_sizes(self) -> dict[str, Any]:
        """``{input name: symbolic size}`` behind :meth:`length_symbols` (its ``node.hint`` is
        the example's length)."""
        vals = {
            n.name: n.meta.get("val")
            for n in self.captured.graph_module.graph.nodes
            if n.op == "placeholder"
        }
        symbols = {}
        for name in self.captured.input_names:
            val = vals.get(self.captured.placeholder_of.get(name))
            dims = getattr(val, "shape", ())[1 if self.captured.batched.get(name) else 0 :]
            for size in dims:
                if not isinstance(size, int):
                    symbols[name] = size
                    break
        return symbols

    def costs_at(self, lengths: Mapping[str, int]) -> dict:
        """FLOPs per node of the logical graph with the inputs ``lengths`` names (``{input:
        length}``, :meth:`length_symbols`) at those lengths; raises ``ValueError`` for an input
        without a dynamic length, or two lengths of one size."""
        from .analysis.flops import node_costs

        symbols, sizes = self.length_symbols(), {}
        for name, length in lengths.items():
            if name not in symbols:
                dynamic = ", ".join(symbols) or "none: mark one with torch._dynamo.mark_dynamic"
                raise ValueError(f"{name!r} has no dynamic length; inputs that have one: {dynamic}")
            symbol = symbols[name]
            if sizes.setdefault(symbol, int(length)) != int(length):
                tied = [n for n, s in symbols.items() if s == symbol]
                raise ValueError(f"inputs {', '.join(tied)} have one length; got two: {lengths}")
        return node_costs(self.logical_graph, self.captured.batch_symbol, sizes)

    @property
    def captured_costs(self) -> dict:
        """FLOPs per node of :attr:`captured_graph` (computed on first use)."""
        if self._captured_costs is None:
            from .analysis.flops import node_costs

            graph = self.captured_graph
            self._captured_costs = (
                {} if graph is None else node_costs(graph, self.captured.batch_symbol)
            )
        return self._captured_costs


def _snapshot(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm``'s graph (node metadata copied, weights shared), which rewrites of ``gm``
    leave as it is."""
    graph = fx.Graph()
    output = graph.graph_copy(gm.graph, {})
    graph.output(output)
    return fx.GraphModule(gm, graph)


def plain_graph(result: PipelineResult) -> fx.GraphModule:
    """The captured graph, unshared, cleaned up as the shared graph is: every node that reads an
    input placed per candidate (on replicated inputs each candidate is its own request), every
    other one constant (``runtime/call/plain.py`` runs it)."""
    from .ir.graph_meta import PLACEMENT
    from .passes.cleanup import cleanup

    gm = _snapshot(result.captured_graph)
    reads_input: dict[fx.Node, bool] = {}
    for node in gm.graph.nodes:
        reads_input[node] = node.op == "placeholder" or any(
            reads_input[a] for a in node.all_input_nodes
        )
        if node.op != "output":
            node.meta[PLACEMENT] = Role.CANDIDATE if reads_input[node] else Role.CONST
    return cleanup(gm)


def _debug_print(stage: str, gm: fx.GraphModule) -> None:
    if os.environ.get("ROCS_PRINT_GRAPHS"):
        from .report.graph_text import graph_table

        # stderr, so that machine-readable output on stdout (``--format json``) stays intact.
        print(f"==== rocs: after {stage} ====", file=sys.stderr)
        print(graph_table(gm), file=sys.stderr)


def compile_graph(
    model: nn.Module,
    request_inputs: list[str],
    example_args: tuple,
    example_kwargs: Mapping[str, Any],
    options: Options = Options(),
    unbatched_inputs: Sequence[str] = (),
) -> PipelineResult:
    """Run the pipeline; entry points validate ``options`` (:meth:`Options.from_mapping`) first.

    Each stage is reported to the progress listener of :mod:`rocs_compiler.progress` (the CLI
    installs one; by default there is none and nothing is printed).
    """
    with dropout_per_request(options.request_dropout == "per_request"):
        return _compile_graph(model, request_inputs, example_args, example_kwargs, options,
                              unbatched_inputs)  # fmt: skip


def _compile_graph(model, request_inputs, example_args, example_kwargs, options, unbatched_inputs):
    with stage("capture"):
        captured = capture(
            model, example_args, example_kwargs, request_inputs,
            strict_fallback=options.capture_strict, unbatched_inputs=unbatched_inputs,
            training=options.training,
        )  # fmt: skip
    symbol = captured.batch_symbol
    request_placeholders = {captured.placeholder_of[n] for n in captured.request_inputs}
    gm = captured.graph_module
    if options.training:
        from .passes.random_layouts import record_random_layouts

        record_random_layouts(gm)  # eager's dropouts and their inputs' layouts, before any pass
    with stage("analyze"):
        analysis = analyze(gm, request_placeholders, symbol)
    _debug_print("capture", gm)
    as_written = _snapshot(gm)
    counts: dict[str, int] = {}

    if options.defer:
        from .passes.defer import defer

        with stage("rewrite (defer)"):
            gm, fired = defer(gm, request_placeholders, symbol, options.float32_partials)
            counts.update(fired)
            analysis = analyze(gm, request_placeholders, symbol)
        _debug_print("defer", gm)
    from .passes.verify import verify_roles

    verify_roles(gm)

    with stage("share"):
        shared = share(gm, symbol)
    _debug_print("share", shared)

    if options.ikbo:
        from .passes.ikbo import ikbo

        pointwise = options.ikbo_pointwise
        if pointwise is None:
            pointwise = any(t.is_cuda for t in model.parameters())
        with stage("fuse (ikbo)"):
            shared, fired = ikbo(shared, pointwise=pointwise)
        counts.update(fired)
        _debug_print("ikbo", shared)

    from .passes.cleanup import cleanup

    with stage("cleanup"):
        # Training: no folded weight copies, so the backward reaches the parameters themselves.
        shared = cleanup(shared, fold=not options.training)
    _debug_print("cleanup", shared)
    if options.training:
        from .passes.random_layouts import restore_random_layouts

        restore_random_layouts(shared)  # last: no pass after it sees the layout nodes
    from .passes.verify import verify_shared

    verify_shared(shared)
    return PipelineResult(captured, analysis, gm, shared, counts, as_written)
