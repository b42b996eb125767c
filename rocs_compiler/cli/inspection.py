"""``rocs inspect``'s view of a TARGET: an :class:`Inspection` (report, drawing, compiled model)
built from a model (compiled here) or from a saved export (costs read from its graph).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .command_kit import compile_target, num_candidates
from .output import Console
from ..progress import stage

if TYPE_CHECKING:  # targets import torch, which `rocs --help` and usage errors do without
    from .targets import Target


@dataclass
class Inspection:
    report: Any
    view: Any
    compiled: Any = None  # CompiledModel when one was built


def inspect_model(target: Target, args) -> Inspection:
    from ..report.render import view_from_exported, view_from_pipeline
    from ..report.build import build_report
    from ..runtime.call.jagged import jagged_summary

    specs = getattr(args, "length", None) or []
    distribution = getattr(args, "length_distribution", None)
    marked = [*specs, distribution] if distribution else specs
    compiled = compile_target(target, args, _marked_example(target, marked) if marked else None)
    result = compiled.pipeline_result
    with stage("costs"):
        at = {names[0]: lengths[0] for names, lengths in specs}
        if distribution:  # one length per request: the report's mean over them
            at[distribution[0][0]] = list(distribution[1])
        report = build_report(result, num_candidates(args), args.requests, target.model, at)
        report.jagged = jagged_summary(compiled._jagged, compiled.jagged_refused)
        if specs:
            report.by_length = _by_length(result, target, args, specs)
    _warn_mislabel(compiled, target, report, args.console)
    if args.graph == "shared":
        import rocs_compiler as rocs

        with stage("export"):
            program = rocs.export(compiled)
        view = view_from_exported(program, title=f"{target.label} (shared layout)")
    else:
        view = view_from_pipeline(result, graph=args.graph)
    return Inspection(report, view, compiled)


def _marked_example(target: Target, specs) -> dict:
    """The target's example with dim 1 of every input ``--length`` names marked dynamic (copies:
    the target's own tensors stay unmarked)."""
    import torch

    from ..errors import TargetError

    example = dict(target.example_kwargs or {})
    for names, _ in specs:
        for name in names:
            value = example.get(name)
            if not isinstance(value, torch.Tensor) or value.dim() < 2:
                have = ", ".join(n for n, v in example.items() if getattr(v, "dim", lambda: 0)() >= 2)
                raise TargetError(
                    f"--length or --length-distribution names {name!r}, which is not an example "
                    f"input with a dim past its rows (inputs with one: {have or 'none'})"
                )
            example[name] = value.clone()
            torch._dynamo.mark_dynamic(example[name], 1)
    return example


def _by_length(result, target: Target, args, specs) -> list[dict]:
    """FLOPs per request and per candidate at each length of the first ``--length`` (the others
    at their first length)."""
    from ..report.build import build_report

    (names, lengths), rest = specs[0], specs[1:]
    fixed = {other[0]: values[0] for other, values in rest}
    rows = []
    for length in lengths:
        at = build_report(result, num_candidates(args), args.requests, target.model,
                          {names[0]: length, **fixed})  # fmt: skip
        rows.append({
            "input": names[0], "length": length, "request_flops": at.request_flops,
            "candidate_flops": at.candidate_flops, "ideal_speedup": at.ideal_speedup(),
        })  # fmt: skip
    return rows


def _warn_mislabel(compiled, target: Target, report, console: Console) -> None:
    """A declared request input that varies on every row of the example batch while the others
    repeat: said on stderr and in the report (``runtime/follow/mislabel.py``)."""
    from ..runtime.follow.mislabel import add_note, example_finding

    finding = example_finding(compiled.contract, (), target.example_kwargs or {})
    if finding:
        add_note(report, finding)
        console.say(finding)


def inspect_program(target: Target, args) -> Inspection:
    from ..report.render import exported_costs, view_from_exported
    from ..report.build import NodeReport, Report

    program = target.program
    with stage("costs"):
        costs = exported_costs(program)
    view = view_from_exported(program, costs, title=f"{target.label} (saved export)")
    nodes = [
        NodeReport(n.name, n.op, n.module, n.role, n.flops, n.broadcast, n.shape)
        for n in view.nodes
        if n.op != "output"
    ]
    fused = sorted({n.op for n in view.nodes if n.fused})
    report = Report(
        nodes,
        [],
        sum(costs.per_request.values()),
        sum(costs.per_candidate.values()),
        sum(costs.fixed.values()),
        num_candidates(args),
        args.requests,
        {},
        fused,
        "saved export",
        "From a saved export: roles come from row counts (R or N) of the shared-layout graph, "
        "FLOPs are those of the rewritten graph, and fallback reasons are not recorded.",
    )
    return Inspection(report, view)
