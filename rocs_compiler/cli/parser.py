"""The ``rocs`` argument parser: one-line usage errors, the argument types (names, positive
integers, ``--input`` specs, ``--options`` JSON), the arguments every TARGET command shares and
:func:`build_parser` with every subcommand.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Callable

from . import serve as cli_serve
from .command_kit import EXIT_USAGE
from .commands import cmd_export, cmd_inspect, cmd_zoo
from .input_specs import NOTATION, parse_spec
from ..options import Options, OptionsError


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``rocs inspect: error: argument --x: ...`` and a hint."""

    def error(self, message: str):
        first, *rest = message.splitlines()
        self.exit(EXIT_USAGE, f"{self.prog}: error: {first}\n  ({self.prog} --help shows usage)\n")


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def _length_spec(text: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """``NAMES=L[,L...]`` -> (names, lengths); NAMES joined by '+'."""
    names, sep, lengths = text.partition("=")
    if not sep or not names or not lengths:
        raise argparse.ArgumentTypeError(f"expected NAMES=L[,L...], got {text!r}")
    values = tuple(_positive(v) for v in lengths.split(","))
    return tuple(n.strip() for n in names.split("+") if n.strip()), values


def _distribution_spec(text: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """``NAMES=L[*K],...`` -> (names, one length per request); ``L*K``: K requests of length L."""
    names, sep, items = text.partition("=")
    if not sep or not names or not items:
        raise argparse.ArgumentTypeError(f"expected NAMES=L[*K][,L[*K]...], got {text!r}")
    lengths: list[int] = []
    for item in items.split(","):
        length, star, count = item.partition("*")
        lengths.extend([_positive(length)] * (_positive(count) if star else 1))
    return tuple(n.strip() for n in names.split("+") if n.strip()), tuple(lengths)


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
    inspect.add_argument(
        "--length",
        type=_length_spec,
        action="append",
        metavar="NAMES=L[,L...]",
        help="count FLOPs at history length L: NAMES (inputs joined by '+', those the model "
        "ties) get their dim 1 marked dynamic in the example; several lengths print FLOPs per "
        "request and per candidate at each, e.g. --length hist_item_ids+hist_cat_ids=10,50,2048",
    )
    inspect.add_argument(
        "--length-distribution",
        type=_distribution_spec,
        metavar="NAMES=L[*K],...",
        help="count FLOPs over a distribution of history lengths, one per request (L*K: K "
        "requests of length L): FLOPs per request and per candidate are the mean over them, as "
        "jagged calls run them, e.g. --length-distribution hist_item_ids+hist_cat_ids=30*63,2048",
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
