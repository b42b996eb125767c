"""Reports: what runs per request, per candidate, and why.

The cost model counts FLOPs on the logical graph (after *defer*, before *share*), where every
node still has the batch size: ``F_req`` is the per-row cost of REQUEST nodes and ``F_cand`` of
CANDIDATE nodes. The original model costs ``(F_req + F_cand) * N``; the compiled one
``F_req * R + F_cand * N``; their ratio is the ideal speedup.

A report of a compiled model also draws itself: :meth:`Report.to_html` writes one
self-contained page (the graph as written and after rewrites, switchable, with zoom, search,
module grouping and a detail panel per node), and notebooks show that page
(:meth:`Report._repr_html_`).
"""

from __future__ import annotations

import collections
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import torch

from ..analysis.driver import Fallback, op_name, source_module
from ..analysis.flops import NodeCost
from ..ir.graph_meta import ROLE
from .modules import ModuleRow, module_rows, parameter_counts, parameter_readers
from ..ir.roles import Role


@dataclass
class NodeReport:
    name: str
    op: str
    module: str
    role: str
    flops: float  # per request (REQUEST), per candidate (CANDIDATE), once (CONST)
    broadcast: bool  # a REQUEST value that candidate computation reads
    shape: str  # with the batch symbol named: "[B, 13]"
    grows: bool = False  # its FLOPs grow with a history length (a dim marked dynamic)


@dataclass
class Report:
    nodes: list[NodeReport]
    fallbacks: list[Fallback]
    request_flops: float
    candidate_flops: float
    const_flops: float
    num_candidates: int
    num_requests: int
    pass_counts: dict[str, int] = field(default_factory=dict)
    fused_ops: list[str] = field(default_factory=list)
    route: str = ""
    note: str = ""
    modules: list[ModuleRow] = field(default_factory=list)
    # History lengths counted, by input: one length, or each request's (a distribution).
    lengths: dict[str, int | list[int]] = field(default_factory=dict)
    jagged: str = ""  # whether calls cut each history to its length, and why not
    by_length: list[dict] = field(default_factory=list)  # FLOPs at several history lengths
    # The pipeline result the report describes, for drawings (not part of the data).
    _pipeline: Any = field(default=None, repr=False, compare=False)

    @classmethod
    def for_fallback(cls, reason: str) -> "Report":
        return cls([], [], 0.0, 0.0, 0.0, 0, 0, note=f"eager fallback: {reason}")

    @property
    def totals(self) -> dict[str, float]:
        return {
            "request_flops": self.request_flops,
            "candidate_flops": self.candidate_flops,
            "const_flops": self.const_flops,
        }

    @property
    def request_share(self) -> float:
        total = self.request_flops + self.candidate_flops
        return self.request_flops / total if total else 0.0

    def ideal_speedup(self, num_candidates: int | None = None, num_requests: int | None = None) -> float:
        n = self.num_candidates if num_candidates is None else num_candidates
        r = self.num_requests if num_requests is None else num_requests
        before = (self.request_flops + self.candidate_flops) * n
        after = self.request_flops * r + self.candidate_flops * n
        return before / after if after else 1.0

    def amortized_flops(self, num_candidates: int) -> float:
        """FLOPs per candidate when one request scores ``num_candidates`` candidates."""
        return self.candidate_flops + self.request_flops / max(num_candidates, 1)

    def to_dict(self) -> dict[str, Any]:
        return {
            "nodes": [asdict(n) for n in self.nodes],
            "fallbacks": [asdict(f) for f in self.fallbacks],
            "totals": self.totals,
            "request_share": self.request_share,
            "num_candidates": self.num_candidates,
            "num_requests": self.num_requests,
            "ideal_speedup": self.ideal_speedup(),
            "pass_counts": dict(self.pass_counts),
            "fused_ops": list(self.fused_ops),
            "route": self.route,
            "note": self.note,
            "modules": [asdict(m) for m in self.modules],
            "lengths": dict(self.lengths),
            "jagged": self.jagged,
            "by_length": [dict(row) for row in self.by_length],
        }

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def summary(self) -> str:
        n, r = self.num_candidates, self.num_requests
        per = f" ({n / r:g} per request)" if r > 1 else ""
        lines = [
            f"FLOPs per request  : {_fmt(self.request_flops)}",
            f"FLOPs per candidate: {_fmt(self.candidate_flops)}",
            f"request share      : {self.request_share:.1%}",
            f"ideal speedup      : {self.ideal_speedup():.2f}x at N={n} candidates{per}, "
            f"R={r} requests",
        ]
        if self.lengths:
            at = ", ".join(f"{name}={_length_text(v)}" for name, v in self.lengths.items())
            grows = sum(node.grows for node in self.nodes)
            lines.append(f"history lengths    : {at} ({grows} nodes grow with them)")
        if self.jagged:
            lines.append(f"jagged calls       : {self.jagged}")
        if self.by_length:
            lines.append(f"by history length  : {self.by_length[0]['input']}")
            lines.append(f"  {'length':>8} {'FLOPs/request':>14} {'FLOPs/candidate':>16} {'ideal':>8}")
            for row in self.by_length:
                lines.append(
                    f"  {row['length']:>8} {_fmt(row['request_flops']):>14} "
                    f"{_fmt(row['candidate_flops']):>16} {row['ideal_speedup']:>7.2f}x"
                )
        if self.pass_counts:
            fired = ", ".join(f"{k}={v}" for k, v in sorted(self.pass_counts.items()) if v)
            lines.append(f"rewrites fired     : {fired or 'none'}")
        if self.fused_ops:
            lines.append(f"fused ops          : {', '.join(self.fused_ops)}")
        if self.fallbacks:
            lines.append(f"per-candidate fallbacks ({len(self.fallbacks)}):")
            for fb in self.fallbacks:
                where = f" in {fb.module}" if fb.module else ""
                lines.append(f"  {fb.node} ({fb.op}){where}: {fb.reason}")
        if self.note:
            lines.append(self.note)
        return "\n".join(lines)

    def to_text(self, max_rows: int | None = None) -> str:
        header = f"{'node':<30} {'op':<38} {'role':<9} {'FLOPs':>10}  {'module'}"
        rows = [header, "-" * len(header)]
        nodes = self.nodes if max_rows is None else self.nodes[:max_rows]
        for node in nodes:
            unit = {"REQUEST": "/req", "CANDIDATE": "/cand", "CONST": ""}[node.role]
            mark = " *" if node.broadcast else ""
            flops = f"{_fmt(node.flops)}{unit}" if node.flops else "-"
            rows.append(
                f"{node.name[:30]:<30} {node.op[:38]:<38} {node.role:<9} {flops:>10}  "
                f"{node.module or '-'}{mark}"
            )
        if max_rows is not None and len(self.nodes) > max_rows:
            rows.append(f"... {len(self.nodes) - max_rows} more nodes")
        rows.append("(* = request value broadcast to candidates)")
        return "\n".join(rows) + "\n\n" + self.summary()

    def __str__(self) -> str:
        return self.to_text()

    def views(self) -> list:
        """Drawings of the graph: as written (captured) and after rewrites; none without a
        compiled model behind the report."""
        if self._pipeline is None:
            return []
        from .render.view import view_from_pipeline

        return [
            view_from_pipeline(self._pipeline, graph="captured"),
            view_from_pipeline(self._pipeline, graph="logical"),
        ]

    def to_html(
        self,
        path: Optional[str | Path] = None,
        title: str = "compiled model",
        measured: Sequence[tuple[int, float]] = (),
        views: Optional[list] = None,
    ) -> str:
        """The report as one self-contained HTML page; written to ``path`` when given.

        ``measured`` adds measured speedups ``(N, speedup)`` next to the ideal ones.
        """
        from .render import html_page, speedup_svg

        views = self.views() if views is None else views
        plot = speedup_svg(self.request_flops, self.candidate_flops, self.num_requests, measured)
        page = html_page(
            title, views, self, plot, self.num_candidates, self.num_requests, measured
        )
        if path is not None:
            Path(path).write_text(page)
        return page

    def _repr_html_(self) -> str:
        """Notebooks: the page in an isolated frame (its script and styles stay inside)."""
        import html

        page = self.to_html()
        return (
            f'<iframe srcdoc="{html.escape(page, quote=True)}" '
            'style="width: 100%; height: 820px; border: 1px solid #ddd"></iframe>'
        )


def _fmt(flops: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(flops) >= scale:
            return f"{flops / scale:.2f}{unit}"
    return f"{flops:.0f}"


def _broadcast(node, role: Role) -> bool:
    """A REQUEST tensor that a candidate node or the output reads. Sizes are not broadcast: the
    rewrite derives each batch size from the role of the node it shapes."""
    if role != Role.REQUEST or not isinstance(node.meta.get("val"), torch.Tensor):
        return False
    return any(u.op == "output" or u.meta.get(ROLE) == Role.CANDIDATE for u in node.users)


def build_report(
    result,
    num_candidates: int = 1024,
    num_requests: int = 1,
    model: Any = None,
    lengths: Mapping[str, Any] | None = None,
) -> Report:
    """Report for a :class:`~rocs_compiler.pipeline.PipelineResult`; ``model`` (the original
    ``nn.Module``) gives the parameter counts of the per-module table; ``lengths`` (``{input:
    length}``) counts the FLOPs at those history lengths (inputs with a dynamic length), else at
    the example's, and marks the nodes whose FLOPs grow with them. A length given as a sequence
    is a distribution, each request's length: FLOPs per request and per candidate are then the
    mean over those requests (each request's candidates at its length)."""
    from .render.view import shape_text

    gm = result.logical_graph
    lengths = {name: _length_value(name, v) for name, v in (lengths or {}).items()}
    costs = _mean_costs(result, lengths) if lengths else result.costs
    longest = {name: max(v) if isinstance(v, list) else v for name, v in lengths.items()}
    grows = _growing(result, costs, longest)
    names = {result.captured.batch_symbol: "B"}
    nodes, per_role = [], {Role.CONST: 0.0, Role.REQUEST: 0.0, Role.CANDIDATE: 0.0}
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "placeholder"):
            continue
        role = node.meta[ROLE]
        cost = costs.get(node.name)
        flops = 0.0
        if cost is not None:
            if role == Role.CONST:
                flops = cost.fixed
                per_role[Role.CONST] += cost.fixed
            else:
                flops = cost.per_row
                per_role[role] += cost.per_row
                per_role[Role.CONST] += cost.fixed
        broadcast = _broadcast(node, role)
        nodes.append(
            NodeReport(
                node.name,
                op_name(node.target) if node.op == "call_function" else "input",
                source_module(node),
                role.name,
                flops,
                broadcast,
                shape_text(node.meta.get("val"), names),
                node.name in grows,
            )
        )
    fused = sorted(
        {str(n.target) for n in result.shared_graph.graph.nodes if getattr(n.target, "namespace", "") == "rocs"}
    )
    return Report(
        nodes,
        list(result.analysis.fallbacks),
        per_role[Role.REQUEST],
        per_role[Role.CANDIDATE],
        per_role[Role.CONST],
        num_candidates,
        num_requests,
        dict(result.pass_counts),
        fused,
        result.captured.route,
        modules=module_rows(
            nodes,
            parameter_counts(model) if model is not None else {},
            parameter_readers(gm, result.captured.param_names),
        ),
        lengths=lengths,
        _pipeline=result,
    )


def _length_value(name: str, value: Any) -> int | list[int]:
    """A length as given (an int, or a sequence or 1-D tensor of each request's), checked."""
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        values = [int(v) for v in value]
        if not values or min(values) < 0:
            raise ValueError(f"lengths[{name!r}] must be non-negative lengths, one per request")
        return values
    return int(value)


def _mean_costs(result, lengths: dict) -> dict:
    """The graph's costs at ``lengths`` (``result.costs_at``); where they are distributions (of
    equal size: each request's lengths), the mean over the requests of the costs at each one's."""
    sizes = {len(v) for v in lengths.values() if isinstance(v, list)}
    if not sizes:
        return result.costs_at(lengths)
    if len(sizes) > 1:
        raise ValueError("length distributions give one length per request: give them one size")
    (count,) = sizes
    per_request = collections.Counter(
        tuple((name, v[i] if isinstance(v, list) else v) for name, v in sorted(lengths.items()))
        for i in range(count)
    )
    sums: dict = {}
    for at, requests in per_request.items():
        for name, cost in result.costs_at(dict(at)).items():
            total = sums.setdefault(name, [0.0, 0.0])
            total[0] += requests * cost.per_row
            total[1] += requests * cost.fixed
    return {name: NodeCost(p / count, f / count) for name, (p, f) in sums.items()}


def _length_text(length: int | list[int]) -> str:
    if not isinstance(length, list):
        return str(length)
    return f"mean {sum(length) / len(length):.1f} over {len(length)} requests (max {max(length)})"


def _growing(result, costs: dict, lengths: dict) -> set[str]:
    """Names of the nodes whose FLOPs grow with a history length: those counted higher with
    every dynamic length doubled (from ``lengths``, else from the example's value)."""
    sizes = result.length_sizes()
    doubled_at, seen = {}, set()
    for name, size in sizes.items():  # one input names each size: tied inputs share it
        symbol = size.node.expr
        if symbol in seen:
            continue
        seen.add(symbol)
        given = [lengths[n] for n, s in sizes.items() if s.node.expr == symbol and n in lengths]
        doubled_at[name] = 2 * max(given[0] if given else int(size.node.hint), 1)
    if not doubled_at:
        return set()
    doubled = result.costs_at(doubled_at)
    return {
        name
        for name, cost in costs.items()
        if (doubled[name].per_row, doubled[name].fixed) != (cost.per_row, cost.fixed)
    }
