"""How ``rocs inspect`` writes an :class:`~.inspection.Inspection`: text, JSON, Graphviz dot,
SVG and HTML, one function per ``--format`` (:data:`FORMATTERS`).
"""

from __future__ import annotations

import json
import textwrap
from typing import TYPE_CHECKING

from .command_kit import MissingTool, num_candidates
from .inspection import Inspection

if TYPE_CHECKING:  # targets import torch, which `rocs --help` and usage errors do without
    from .targets import Target


def _as_text(target: Target, inspection: Inspection, measured, args) -> str:
    head = f"rocs inspect {target.label}"
    if target.request_inputs:
        head += f"  (request inputs: {', '.join(target.request_inputs)})"
    head += f"\nweights: {target.weights}"
    text = head + "\n\n" + inspection.report.to_text()
    if measured:
        from ..report.render.html import measured_note
        from .measure import describe

        text += "\n" + describe(measured, args.requests)

        pairs = [(m.num_candidates, m.speedup) for m in measured]
        text += "\n" + textwrap.fill(measured_note(inspection.report, pairs, args.requests), 100)
    return text


def _as_json(target: Target, inspection: Inspection, measured, args) -> str:
    view = inspection.view
    names = {n.id: n.name for n in view.nodes}
    data = inspection.report.to_dict()
    data["target"] = target.label
    data["request_inputs"] = target.request_inputs
    data["weights"] = target.weights
    data["candidates_per_request"] = args.candidates
    data["graph"] = {
        "kind": view.kind,
        "edges": [
            {"src": names[e.src], "dst": names[e.dst], "broadcast": e.broadcast}
            for e in view.edges
            if not e.shape_only
        ],
    }
    if measured:
        data["measured_speedup"] = [
            {"candidates_per_request": m.per_request, "num_candidates": m.num_candidates,
             "speedup": m.speedup, "speedup_min": m.low, "speedup_median": m.speedup,
             "speedup_max": m.high, "trials": m.trials, "settled": m.settled}
            for m in measured
        ]  # fmt: skip
    return json.dumps(data, indent=2)


def _as_dot(target: Target, inspection: Inspection, measured, args) -> str:
    from ..report.render import to_dot

    return to_dot(inspection.view)


def _as_svg(target: Target, inspection: Inspection, measured, args) -> str:
    from ..report.render import DotNotFound, run_dot, to_dot

    try:
        return run_dot(to_dot(inspection.view))
    except DotNotFound as err:
        raise MissingTool(str(err)) from None


def _as_html(target: Target, inspection: Inspection, measured, args) -> str:
    report = inspection.report
    views = report.views()  # as written and after rewrites (none for a saved export)
    if inspection.view.kind == "shared":
        views.append(inspection.view)
    points = [(m.num_candidates, m.speedup) for m in measured]  # the plot's axis is N
    from ..report.render import html_page, speedup_svg

    plot = speedup_svg(report.request_flops, report.candidate_flops, args.requests, points)
    return html_page(
        target.label, views or [inspection.view], report, plot, num_candidates(args),
        args.requests, points, default_view=inspection.view.kind,
    )  # fmt: skip


# ``--format`` -> formatter(target, inspection, measured, args) -> text
FORMATTERS = {
    "text": _as_text,
    "json": _as_json,
    "dot": _as_dot,
    "svg": _as_svg,
    "html": _as_html,
}
