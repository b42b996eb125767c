"""The ``rocs`` command line: inspect, export and benchmark compiled models.

::

    rocs inspect models_zoo:dlrm                          # node table and summary
    rocs inspect models_zoo:din --format html -o din.html # drawing, table, speedup plot
    rocs inspect mypkg.models:make_ranker --request user_ids,history --format json
    rocs inspect ranker.pt2 --candidates 512              # a saved rocs.export program
    rocs export models_zoo:dlrm -o dlrm.pt2
    rocs zoo
    rocs bench dlrm din --quick                           # runs benchmarks/speed.py

TARGET is one of

- ``models_zoo:NAME``: a zoo model (``rocs zoo`` lists them);
- ``package.module:factory`` or ``path/to/file.py:factory``: a callable taking no arguments that
  returns either ``(model, example_kwargs, request_inputs)`` (``request_inputs`` may be left out
  when ``--request`` is given) or a zoo-entry-like object with ``request_inputs``,
  ``build()`` (the model in eval mode) and ``make_batch(counts)`` (a shared-layout batch with
  ``.kwargs``, ``.candidate_to_request`` and ``.replicated()``, like ``models_zoo.Batch``);
  ``example_kwargs`` is one batch of the model's keyword arguments in replicated layout;
- a saved export (``*.pt2`` from ``rocs export`` / ``rocs.save``).

Exit codes: 0 success, 1 compile or input error (one line; ``--debug`` shows the traceback),
2 usage error, 3 a missing external tool (Graphviz ``dot`` for ``--format svg``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from .options import Options, OptionsError
from .targets import Target, TargetError, load_target

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_TOOL = 0, 1, 2, 3
MEASURE_CANDIDATES = (16, 64, 256, 1024)


class MissingTool(RuntimeError):
    """An external program the command needs is not installed."""


# -- compiled views -------------------------------------------------------------------------------


@dataclass
class Inspection:
    report: Any
    view: Any
    compiled: Any = None  # CompiledModel when one was built


def _ensure_eval(target: Target) -> None:
    if target.model.training:
        print(
            f"rocs: {target.label} returned a model in training mode; using eval mode",
            file=sys.stderr,
        )
        target.model.eval()


def _inspect_model(target: Target, args) -> Inspection:
    from .pipeline import compile_graph
    from .render import view_from_exported, view_from_pipeline
    from .report import build_report

    _ensure_eval(target)
    result = compile_graph(
        target.model, target.request_inputs, (), target.example_kwargs, args.options
    )
    report = build_report(result, args.candidates, args.requests)
    compiled = None
    if args.graph == "shared" or args.measure:
        import rocs_compiler as rocs

        compiled = rocs.compile(
            target.model,
            target.request_inputs,
            example_kwargs=target.example_kwargs,
            options=args.options,
        )
    if args.graph == "shared":
        import rocs_compiler as rocs

        view = view_from_exported(rocs.export(compiled), title=f"{target.label} (shared layout)")
    else:
        view = view_from_pipeline(result, report, title=f"{target.label} (logical graph)")
    return Inspection(report, view, compiled)


def _inspect_program(target: Target, args) -> Inspection:
    from .render import exported_costs, view_from_exported
    from .report import NodeReport, Report

    program = target.program
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
        args.candidates,
        args.requests,
        {},
        fused,
        "saved export",
        "From a saved export: roles come from row counts (R or N) of the shared-layout graph, "
        "FLOPs are those of the rewritten graph, and fallback reasons are not recorded.",
    )
    return Inspection(report, view)


# -- measuring ------------------------------------------------------------------------------------


def _split(total: int, parts: int) -> list[int]:
    parts = max(1, min(parts, total))
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def _tiled_batch(target: Target, counts: Sequence[int]):
    """A shared-layout batch built from the example rows (for factories without make_batch)."""
    import torch
    from torch.utils import _pytree as pytree

    from models_zoo.batch import Batch, request_index

    from .inputs import named_leaves

    example = target.example_kwargs
    flat, spec = pytree.tree_flatten(example)
    names = list(named_leaves(example))
    rows = max(v.shape[0] for v in flat if isinstance(v, torch.Tensor) and v.dim())
    num_requests, num_candidates = len(counts), sum(counts)
    requests = [
        n for n in names if any(n == r or n.startswith(r + ".") for r in target.request_inputs)
    ]
    leaves = []
    for name, value in zip(names, flat):
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == rows:
            count = num_requests if name in requests else num_candidates
            value = value.index_select(0, torch.arange(count) % rows)
        leaves.append(value)
    kwargs = pytree.tree_unflatten(leaves, spec)
    return Batch(kwargs, request_index(counts), tuple(requests))


def _time_pair(first: Callable[[], Any], second: Callable[[], Any], budget: float = 0.5):
    """Best times of two calls, run alternately so that load on a shared machine hits both alike.

    The minimum over repeats is the least noisy estimate of a call's own cost.
    """
    first(), second()  # warm-up
    best = [float("inf"), float("inf")]
    spent, rounds = 0.0, 0
    while rounds < 5 or (spent < budget and rounds < 200):
        for i, fn in enumerate((first, second)):
            start = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - start
            best[i] = min(best[i], elapsed)
            spent += elapsed
        rounds += 1
    return best[0], best[1]


def measure(target: Target, compiled, num_requests: int, candidates: Sequence[int]):
    """Measured speedup of the shared-layout call over the original model, per N."""
    import torch

    points = []
    for n in candidates:
        counts = _split(n, num_requests)
        batch = target.make_batch(counts) if target.make_batch else _tiled_batch(target, counts)
        replicated = batch.replicated()
        shared, index = batch.kwargs, batch.candidate_to_request
        with torch.no_grad():
            eager, rocs_time = _time_pair(
                lambda kw=replicated: target.model(**kw),
                lambda kw=shared, idx=index: compiled(**kw, candidate_to_request=idx),
            )
        points.append((n, eager / rocs_time))
    return points


# -- commands -------------------------------------------------------------------------------------


def _write(text: str, output: Optional[str]) -> None:
    if output:
        Path(output).write_text(text)
        print(f"wrote {output}", file=sys.stderr)
    else:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")


def cmd_inspect(args, extra) -> int:
    from .render import dot_available

    if args.format == "svg" and not dot_available():
        raise MissingTool(
            "--format svg needs Graphviz 'dot', which is not installed (apt-get install "
            "graphviz, brew install graphviz); --format dot or --format html work without it"
        )
    target = load_target(args.target, args.request)
    if target.program is not None:
        if args.measure:
            raise TargetError("--measure needs a model target, not a saved export")
        inspection = _inspect_program(target, args)
    else:
        inspection = _inspect_model(target, args)
    measured = []
    if args.measure:
        sizes = sorted({n for n in MEASURE_CANDIDATES if n <= args.candidates} | {args.candidates})
        sizes = [n for n in sizes if n >= args.requests]
        measured = measure(target, inspection.compiled, args.requests, sizes)
    formatter = {
        "text": _as_text,
        "json": _as_json,
        "dot": _as_dot,
        "svg": _as_svg,
        "html": _as_html,
    }[args.format]
    _write(formatter(target, inspection, measured, args), args.output)
    return EXIT_OK


def _as_text(target: Target, inspection: Inspection, measured, args) -> str:
    head = f"rocs inspect {target.label}"
    if target.request_inputs:
        head += f"  (request inputs: {', '.join(target.request_inputs)})"
    text = head + "\n\n" + inspection.report.to_text()
    if measured:
        text += "\nmeasured speedup   : " + ", ".join(f"{s:.2f}x at N={n}" for n, s in measured)
    return text


def _as_json(target: Target, inspection: Inspection, measured, args) -> str:
    view = inspection.view
    names = {n.id: n.name for n in view.nodes}
    data = inspection.report.to_dict()
    data["target"] = target.label
    data["request_inputs"] = target.request_inputs
    data["graph"] = {
        "kind": view.kind,
        "edges": [
            {"src": names[e.src], "dst": names[e.dst], "broadcast": e.broadcast} for e in view.edges
        ],
    }
    if measured:
        data["measured_speedup"] = [{"num_candidates": n, "speedup": s} for n, s in measured]
    return json.dumps(data, indent=2)


def _as_dot(target: Target, inspection: Inspection, measured, args) -> str:
    from .render import to_dot

    return to_dot(inspection.view)


def _as_svg(target: Target, inspection: Inspection, measured, args) -> str:
    from .render import DotNotFound, run_dot, to_dot

    try:
        return run_dot(to_dot(inspection.view))
    except DotNotFound as err:
        raise MissingTool(str(err)) from None


def _as_html(target: Target, inspection: Inspection, measured, args) -> str:
    from .render import dot_available, graph_svg, html_page, run_dot, speedup_svg, to_dot

    report, view = inspection.report, inspection.view
    if dot_available():
        drawing = run_dot(to_dot(view))
        drawing = drawing[drawing.index("<svg") :]  # drop the XML prolog and doctype
        note = "drawn by Graphviz"
    else:
        drawing = graph_svg(view)
        note = "Graphviz is not installed, drawn as layers by topological depth"
    plot = speedup_svg(report.request_flops, report.candidate_flops, args.requests, measured)
    return html_page(
        target.label, view, report, drawing, plot, args.candidates, args.requests, measured, note
    )


def cmd_export(args, extra) -> int:
    import rocs_compiler as rocs

    target = load_target(args.target, args.request)
    if target.program is not None:
        raise TargetError("the target is already a saved export")
    _ensure_eval(target)
    compiled = rocs.compile(
        target.model,
        target.request_inputs,
        example_kwargs=target.example_kwargs,
        options=args.options,
    )
    program = rocs.export(compiled)
    if args.aoti:
        path = rocs.aoti_package(program, args.output)
        print(f"wrote AOTInductor package {path}", file=sys.stderr)
    else:
        rocs.save(program, args.output)
        print(f"wrote {args.output}", file=sys.stderr)
    return EXIT_OK


def cmd_zoo(args, extra) -> int:
    from models_zoo import ZOO

    width = max(len(name) for name in ZOO)
    for name, entry in ZOO.items():
        print(f"{name:<{width}}  request: {', '.join(entry.request_inputs)}")
        print(f"{'':<{width}}  {entry.description}")
    return EXIT_OK


def _bench_script() -> Optional[Path]:
    for root in (Path.cwd(), Path(__file__).resolve().parents[1]):
        script = root / "benchmarks" / "speed.py"
        if script.is_file():
            return script
    return None


def cmd_bench(args, extra) -> int:
    script = _bench_script()
    if script is None:
        raise TargetError(
            "benchmarks/speed.py was not found (looked in the current directory and next to the "
            "rocs_compiler package); rocs bench runs from a source checkout"
        )
    command = [sys.executable, str(script)]
    if args.models:
        command += ["--models", *args.models]
    return subprocess.call(command + list(extra))


# -- argument parsing -----------------------------------------------------------------------------


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _options_for(command: str) -> Callable[[str], Options]:
    """The ``--options`` parser of ``rocs COMMAND``: a JSON object of pipeline options."""

    def parse(text: str) -> Options:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as err:
            raise argparse.ArgumentTypeError(f"not JSON: {err}") from None
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError("must be a JSON object")
        try:
            return Options.from_mapping(value, where=f"rocs {command}")
        except OptionsError as err:  # argparse names the command and the argument
            raise argparse.ArgumentTypeError("; ".join(err.problems) + "\n" + err.valid) from None

    return parse


_TARGET_HELP = """\
TARGET:
  models_zoo:NAME              a zoo model (rocs zoo lists them)
  package.module:factory       a no-argument callable (also path/to/file.py:factory) returning
                               (model, example_kwargs, request_inputs) -- request_inputs may be
                               left out when --request is given -- or an object with
                               request_inputs, build() and make_batch(counts) like a
                               models_zoo.ZooEntry; example_kwargs is one batch of the model's
                               keyword arguments in replicated layout
  FILE.pt2                     a program saved by rocs export / rocs.save
"""


def _target_command(sub, common, func, name: str, help: str, description: str):  # noqa: A002
    """A subcommand acting on a TARGET: the target, ``--request`` and ``--options``."""
    command = sub.add_parser(
        name,
        parents=[common],
        help=help,
        description=description,
        epilog=_TARGET_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    command.add_argument(
        "target",
        metavar="TARGET",
        help="models_zoo:NAME, package.module:factory, path/to/file.py:factory, or FILE.pt2",
    )
    command.add_argument(
        "--request",
        type=_names,
        metavar="NAMES",
        help="request-side inputs, comma-separated (default: the target's own)",
    )
    command.add_argument(
        "--options",
        type=_options_for(name),
        default=Options(),
        metavar="JSON",
        help="pipeline options as a JSON object, e.g. '{\"defer\": false}'; valid keys: "
        + ", ".join(f.name for f in dataclasses.fields(Options)),
    )
    command.set_defaults(func=func)
    return command


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    parser = argparse.ArgumentParser(
        prog="rocs",
        description="Request-oriented compute sharing: inspect, export and benchmark models.",
        epilog="exit codes: 0 ok, 1 compile/input error, 2 usage error, 3 missing external tool",
        parents=[common],
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    inspect = _target_command(
        sub, common, cmd_inspect, "inspect",
        help="roles, FLOPs and a drawing of a compiled model",
        description="Compile TARGET and show what runs per request and per candidate.",
    )
    inspect.add_argument(
        "--candidates",
        type=_positive,
        default=1024,
        metavar="N",
        help="candidates per batch for the ideal speedup (default 1024)",
    )
    inspect.add_argument(
        "--requests",
        type=_positive,
        default=1,
        metavar="R",
        help="requests per batch for the ideal speedup (default 1)",
    )
    inspect.add_argument("--format", choices=["text", "json", "dot", "svg", "html"], default="text")
    inspect.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    inspect.add_argument(
        "--graph",
        choices=["logical", "shared"],
        default="logical",
        help="draw the logical graph (roles, default) or the rewritten "
        "shared-layout graph (broadcasts and fused ops)",
    )
    inspect.add_argument(
        "--measure",
        action="store_true",
        help="also time the original model and the shared-layout call "
        f"(N in {', '.join(map(str, MEASURE_CANDIDATES))} up to --candidates)",
    )

    export = _target_command(
        sub, common, cmd_export, "export",
        help="compile TARGET and save a torch.export program",
        description="Compile TARGET and save its shared-layout program (load with rocs.load).",
    )
    export.add_argument("-o", "--output", required=True, metavar="FILE", help="output .pt2 file")
    export.add_argument(
        "--aoti",
        action="store_true",
        help="compile with AOTInductor into a package (needs a C++ compiler)",
    )

    zoo = sub.add_parser(
        "zoo",
        parents=[common],
        help="list the zoo models",
        description="List the zoo models and their request inputs.",
    )
    zoo.set_defaults(func=cmd_zoo)

    bench = sub.add_parser(
        "bench",
        parents=[common],
        help="run benchmarks/speed.py",
        description="Run the speed benchmark (benchmarks/speed.py); options after the model "
        "names go to the script, e.g. rocs bench dlrm --quick --no-inductor.",
    )
    bench.add_argument("models", nargs="*", metavar="MODEL", help="zoo models (default: all)")
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    if extra and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    output = getattr(args, "output", None)
    if output and not Path(output).resolve().parent.is_dir():
        # Checked before any compile work, which can take seconds.
        parser.error(f"argument -o/--output: directory {Path(output).parent} does not exist")
    from .errors import CompileError, InputError

    try:
        return args.func(args, extra)
    except MissingTool as err:
        print(f"rocs: {err}", file=sys.stderr)
        return EXIT_TOOL
    except (CompileError, InputError, TargetError) as err:
        if args.debug:
            raise
        print(f"rocs: error: {err}", file=sys.stderr)
        return EXIT_ERROR
    except Exception as err:
        if args.debug:
            raise
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        print(f"rocs: error ({type(err).__name__}): {first}", file=sys.stderr)
        print("  (run with --debug for the traceback)", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
