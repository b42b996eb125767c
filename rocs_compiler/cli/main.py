"""The ``rocs`` command line: inspect, export and benchmark compiled models.

::

    rocs inspect models_zoo:dlrm                          # node table and summary
    rocs inspect models_zoo:din --format html -o din.html # drawing, table, speedup plot
    rocs inspect my_model.py:Ranker --request user_dense \
        --input user_dense=float32[64] --input 'item_id=int64[]<5000'
    rocs inspect mypkg.models:make_ranker --request user_ids,history --format json
    rocs inspect ranker.pt2 --candidates 512              # a saved rocs.export program
    rocs export models_zoo:dlrm -o dlrm.pt2
    rocs export models_zoo:dlrm --portable --aoti -o dlrm_aoti.pt2   # for a C++ server
    rocs export my_model.py:Ranker --weights ranker_state.pt ... -o ranker.pt2
    rocs serve dlrm.pt2 --port 8000                      # Ray Serve (cli/serve.py)
    rocs zoo
    rocs bench dlrm din --quick                           # runs benchmarks/speed.py

TARGET is one of

- ``models_zoo:NAME``: a zoo model (``rocs zoo`` lists them);
- ``package.module:NAME`` or ``path/to/file.py:NAME`` where NAME is an ``nn.Module`` class
  (constructed with no arguments), an ``nn.Module`` instance, or a factory function taking no
  arguments. A factory returns a model, or ``(model, example_kwargs, request_inputs)``
  (``request_inputs`` may be left out when ``--request`` is given), or a zoo-entry-like object
  with ``request_inputs``, ``build()`` (the model in eval mode) and ``make_batch(counts)`` (a
  shared-layout batch with ``.kwargs``, ``.candidate_to_request`` and ``.replicated()``, like
  ``models_zoo.Batch``); ``example_kwargs`` is one batch of the model's keyword arguments in
  replicated layout. A model without example inputs takes ``--input`` specs
  (:mod:`rocs_compiler.cli.input_specs`), one per argument of its forward;
- a saved export (``*.pt2`` from ``rocs export`` / ``rocs.save``).

``--candidates`` is candidates per request in every command (``inspect``, ``bench``); a batch of
``--requests R`` requests has ``R * candidates`` candidate rows.

``--weights FILE`` loads a ``state_dict`` into the model; the output says which weights were
used (a class TARGET without ``--weights`` is freshly initialised).

Stages that can take seconds print ``[rocs] capture ... 1.2 s`` lines on stderr (``-q``: none).
Errors are one line, ``rocs: error: ...``, and at most one hint (the source line they point at);
torch's logs and warnings are silenced unless ``--debug``, which also shows tracebacks.

Exit codes: 0 success, 1 compile or input error, 2 usage error, 3 a missing external tool
(Graphviz ``dot`` for ``--format svg``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from . import bench as cli_bench
from . import serve as cli_serve
from .output import Console, error_lines, third_party_silenced
from ..errors import CompileError, InputError, TargetError
from .input_specs import NOTATION, parse_spec
from ..options import Options, OptionsError
from ..progress import listening, stage

if TYPE_CHECKING:  # targets import torch, which `rocs --help` and usage errors do without
    from .targets import Target

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_TOOL = 0, 1, 2, 3


class MissingTool(RuntimeError):
    """An external program the command needs is not installed."""


# -- compiled views -------------------------------------------------------------------------------


@dataclass
class Inspection:
    report: Any
    view: Any
    compiled: Any = None  # CompiledModel when one was built


def _num_candidates(args) -> int:
    """N, the candidates of one batch: ``--candidates`` is per request."""
    return args.candidates * args.requests


def _ensure_eval(target: Target, console: Console) -> None:
    if target.model.training:
        console.say(f"rocs: {target.label}: the model is in training mode; using eval mode")
        target.model.eval()


def _compile(target: Target, args):
    import rocs_compiler as rocs

    _ensure_eval(target, args.console)
    return rocs.compile(
        target.model, target.request_inputs, example_kwargs=target.example_kwargs,
        options=args.options,
    )  # fmt: skip


def _inspect_model(target: Target, args) -> Inspection:
    from ..report.render import view_from_exported, view_from_pipeline
    from ..report.build import build_report

    compiled = _compile(target, args)
    result = compiled.pipeline_result
    with stage("costs"):
        report = build_report(result, _num_candidates(args), args.requests, target.model)
    _warn_mislabel(compiled, target, report, args.console)
    if args.graph == "shared":
        import rocs_compiler as rocs

        with stage("export"):
            program = rocs.export(compiled)
        view = view_from_exported(program, title=f"{target.label} (shared layout)")
    else:
        view = view_from_pipeline(result, graph=args.graph)
    return Inspection(report, view, compiled)


def _warn_mislabel(compiled, target: Target, report, console: Console) -> None:
    """A declared request input that varies on every row of the example batch while the others
    repeat: said on stderr and in the report (``runtime/mislabel.py``)."""
    from ..runtime.mislabel import add_note, example_finding

    finding = example_finding(compiled.contract, (), target.example_kwargs or {})
    if finding:
        add_note(report, finding)
        console.say(finding)


def _inspect_program(target: Target, args) -> Inspection:
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
        _num_candidates(args),
        args.requests,
        {},
        fused,
        "saved export",
        "From a saved export: roles come from row counts (R or N) of the shared-layout graph, "
        "FLOPs are those of the rewritten graph, and fallback reasons are not recorded.",
    )
    return Inspection(report, view)


# -- commands -------------------------------------------------------------------------------------


def _write(text: str, args) -> None:
    if args.output:
        Path(args.output).write_text(text)
        args.console.note(f"wrote {args.output}")
    else:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")


def _target(args) -> Target:
    from .targets import load_target

    with stage("load target"):
        return load_target(args.target, args.request, args.input or (), args.weights)


def cmd_inspect(args) -> int:
    if args.format == "svg" and not _dot_available():
        raise MissingTool(
            "--format svg needs Graphviz 'dot', which is not installed (apt-get install "
            "graphviz, brew install graphviz); --format dot or --format html work without it"
        )
    target = _target(args)
    if target.program is not None:
        if args.measure:
            raise TargetError("--measure needs a model target, not a saved export")
        inspection = _inspect_program(target, args)
    else:
        inspection = _inspect_model(target, args)
    measured = []
    if args.measure:
        from .measure import measure, sizes_up_to

        sizes = sizes_up_to(args.candidates)
        measured = measure(target, inspection.compiled, args.requests, sizes)
    formatter = {
        "text": _as_text,
        "json": _as_json,
        "dot": _as_dot,
        "svg": _as_svg,
        "html": _as_html,
    }[args.format]
    drawing = args.format in ("svg", "html")  # Graphviz layout can take seconds
    with stage(f"render {args.format}") if drawing else contextlib.nullcontext():
        text = formatter(target, inspection, measured, args)
    _write(text, args)
    return EXIT_OK


def _dot_available() -> bool:
    from ..report.render import dot_available  # the renderers import the whole pipeline

    return dot_available()


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
        text += "\n" + textwrap.fill(
            measured_note(inspection.report, pairs, args.requests), 100
        )
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
        target.label, views or [inspection.view], report, plot, _num_candidates(args),
        args.requests, points, default_view=inspection.view.kind,
    )  # fmt: skip


def cmd_export(args) -> int:
    import rocs_compiler as rocs

    target = _target(args)
    if target.program is not None:
        raise TargetError("the target is already a saved export")
    compiled = _compile(target, args)
    with stage("export"):
        program = rocs.export(compiled, portable=args.portable)
    if args.aoti:
        with stage("AOTInductor"):
            path = rocs.aoti_package(program, args.output)
        args.console.note(f"wrote AOTInductor package {path}")
    else:
        with stage("save"):
            rocs.save(program, args.output)
        args.console.note(f"wrote {args.output}")
    args.console.note(f"weights: {target.weights}")
    return EXIT_OK


def cmd_zoo(args) -> int:
    try:
        from models_zoo import ZOO
    except ImportError:
        print("rocs: the model zoo (package models_zoo) is not installed", file=sys.stderr)
        return EXIT_USAGE

    width = max(len(name) for name in ZOO)
    for name, entry in ZOO.items():
        print(f"{name:<{width}}  request: {', '.join(entry.request_inputs)}")
        print(f"{'':<{width}}  {entry.description}")
    return EXIT_OK


# -- argument parsing -----------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``rocs inspect: error: argument --x: ...`` and a hint."""

    def error(self, message: str):
        first, *rest = message.splitlines()
        self.exit(EXIT_USAGE, f"{self.prog}: error: {first}\n  ({self.prog} --help shows usage)\n")


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


def _input_spec(text: str):
    try:
        return parse_spec(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


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
            problems = "; ".join(err.problems)
            valid = Options.describe(one_line=True)
            raise argparse.ArgumentTypeError(f"{problems}; {valid}") from None

    return parse


_TARGET_HELP = f"""\
TARGET:
  models_zoo:NAME              a zoo model (rocs zoo lists them)
  path/to/file.py:NAME         NAME in a file (also package.module:NAME): an nn.Module class
                               (constructed with no arguments), an nn.Module instance, or a
                               no-argument factory returning a model, (model, example_kwargs[,
                               request_inputs]), or an object with request_inputs, build() and
                               make_batch(counts) like a models_zoo.ZooEntry
  FILE.pt2                     a program saved by rocs export / rocs.save

A model without example inputs needs --input {NOTATION}, one per forward argument:
  --input user_dense=float32[64]     float32 [B, 64]; SHAPE leaves out the batch dim
  --input 'item_id=int64[]<5000'     int64 [B] in [0, 5000) (quote it: < is a shell redirect)
  --input features.age=float32[1]    a tensor inside the dict argument 'features'
DTYPE defaults to float32; <K bounds integer ids (default 2). Example batches are random and
ragged (requests with 3, 1 and 5 candidates). --input replaces a target's own example inputs.
"""


def _target_command(sub, common, func, name: str, help: str, description: str):  # noqa: A002
    """A subcommand acting on a TARGET: the target, ``--request``, ``--input`` and ``--options``."""
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
        help="models_zoo:NAME, path/to/file.py:NAME, package.module:NAME, or FILE.pt2",
    )
    command.add_argument(
        "--request",
        type=_names,
        metavar="NAMES",
        help="request-side inputs, comma-separated (default: the target's own)",
    )
    command.add_argument(
        "--input",
        type=_input_spec,
        action="append",
        metavar="SPEC",
        help=f"an example input, {NOTATION} (see below); repeat per input",
    )
    command.add_argument(
        "--weights",
        metavar="FILE",
        help="a state_dict saved with torch.save(model.state_dict(), FILE), loaded into the "
        "model (default: the weights the target builds; a class is freshly initialised)",
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


def _common() -> argparse.ArgumentParser:
    # SUPPRESS: the flag counts wherever it is given (before or after the command).
    common = _Parser(add_help=False)
    common.add_argument(
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS,
        help="show tracebacks and torch's logs and warnings",
    )
    common.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        default=argparse.SUPPRESS,
        help="no progress lines on stderr (errors still show)",
    )
    return common


def build_parser() -> argparse.ArgumentParser:
    common = _common()
    parser = _Parser(
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
    )  # fmt: skip
    inspect.add_argument(
        "--candidates",
        type=_positive,
        default=1024,
        metavar="N",
        help="candidates per request, for the ideal speedup and --measure (default 1024)",
    )
    inspect.add_argument(
        "--requests",
        type=_positive,
        default=1,
        metavar="R",
        help="requests per batch, each with --candidates candidates (default 1)",
    )
    inspect.add_argument("--format", choices=["text", "json", "dot", "svg", "html"], default="text")
    inspect.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    inspect.add_argument(
        "--graph",
        choices=["captured", "logical", "shared"],
        default="logical",
        help="draw the graph as captured (the model as written), the logical graph (after "
        "rewrites; the default) or the shared-layout graph (broadcasts and fused ops)",
    )
    inspect.add_argument(
        "--measure",
        action="store_true",
        help="also time the original model and the shared-layout call at 16, 64, 256 and 1024 "
        "candidates per request, up to --candidates, repeating each until the trials agree, "
        "and print their spread (min, median, max)",
    )

    export = _target_command(
        sub, common, cmd_export, "export",
        help="compile TARGET and save a torch.export program",
        description="Compile TARGET and save its shared-layout program (load with rocs.load).",
    )  # fmt: skip
    export.add_argument("-o", "--output", required=True, metavar="FILE", help="output .pt2 file")
    export.add_argument(
        "--aoti",
        action="store_true",
        help="compile with AOTInductor into a package (needs a C++ compiler)",
    )
    export.add_argument(
        "--portable",
        action="store_true",
        help="replace every rocs:: op by plain torch: the program (or package) runs without "
        "rocs_compiler, in C++ (AOTInductor) or ONNX Runtime",
    )

    cli_serve.add_command(sub, common, _positive)

    zoo = sub.add_parser(
        "zoo",
        parents=[common],
        help="list the zoo models",
        description="List the zoo models and their request inputs.",
    )
    zoo.set_defaults(func=cmd_zoo)

    # Listed here for `rocs --help`; `rocs bench ...` is parsed by the benchmark's own parser
    # (see main), so that `rocs bench --help` shows the benchmark's options.
    sub.add_parser(
        "bench",
        help="run the speed benchmark (benchmarks/speed.py; rocs bench --help lists its options)",
        add_help=False,
    )
    return parser


def _split_command(argv: list[str]) -> tuple[list[str], Optional[str], list[str]]:
    """Global flags before the command, the command, and what follows it."""
    for i, arg in enumerate(argv):
        if not arg.startswith("-"):
            return argv[:i], arg, argv[i + 1 :]
    return argv, None, []


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    console = Console(sys.stderr)
    flags, command, rest = _split_command(argv)
    if command == "bench" and not {"-h", "--help"} & set(flags):
        try:
            return cli_bench.run_bench(rest, cli_bench.bench_script())
        except TargetError as err:
            console.say(f"rocs: error: {err}")
            return EXIT_ERROR
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    debug, quiet = getattr(args, "debug", False), getattr(args, "quiet", False)
    output = getattr(args, "output", None)
    if output and not Path(output).resolve().parent.is_dir():
        # Checked before any compile work, which can take seconds.
        parser.error(f"argument -o/--output: directory {Path(output).parent} does not exist")
    args.console = console = Console(sys.stderr, progress=not quiet)
    # ROCS_PRINT_GRAPHS prints graphs on stderr: asking for them keeps stderr open.
    silenced = not debug and not os.environ.get("ROCS_PRINT_GRAPHS")
    try:
        with third_party_silenced() if silenced else contextlib.nullcontext(), listening(console):
            return args.func(args)
    except MissingTool as err:
        console.say(f"rocs: {err}")
        return EXIT_TOOL
    except Exception as err:
        if debug:
            raise
        known = isinstance(err, (CompileError, InputError, TargetError, OptionsError))
        for line in error_lines(err, known):
            console.say(line)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
