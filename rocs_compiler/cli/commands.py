"""The ``rocs`` commands over a TARGET or the zoo: ``inspect``, ``export`` and ``zoo``, each a
function of the parsed arguments returning an exit code (``serve`` and ``bench`` live in
``serve.py`` and ``bench.py``).
"""

from __future__ import annotations

import contextlib
import sys

from .command_kit import (
    EXIT_OK,
    EXIT_USAGE,
    MissingTool,
    compile_target,
    load_command_target,
    write_output,
)
from .inspect_formats import FORMATTERS
from .inspection import inspect_model, inspect_program
from ..errors import TargetError
from ..progress import stage


def cmd_inspect(args) -> int:
    if args.format == "svg" and not _dot_available():
        raise MissingTool(
            "--format svg needs Graphviz 'dot', which is not installed (apt-get install "
            "graphviz, brew install graphviz); --format dot or --format html work without it"
        )
    target = load_command_target(args)
    if target.program is not None:
        if args.measure:
            raise TargetError("--measure needs a model target, not a saved export")
        inspection = inspect_program(target, args)
    else:
        inspection = inspect_model(target, args)
    measured = []
    if args.measure:
        from .measure import measure, sizes_up_to

        sizes = sizes_up_to(args.candidates)
        measured = measure(target, inspection.compiled, args.requests, sizes)
    formatter = FORMATTERS[args.format]
    drawing = args.format in ("svg", "html")  # Graphviz layout can take seconds
    with stage(f"render {args.format}") if drawing else contextlib.nullcontext():
        text = formatter(target, inspection, measured, args)
    write_output(text, args)
    return EXIT_OK


def _dot_available() -> bool:
    from ..report.render import dot_available  # the renderers import the whole pipeline

    return dot_available()


def cmd_export(args) -> int:
    import rocs_compiler as rocs

    target = load_command_target(args)
    if target.program is not None:
        raise TargetError("the target is already a saved export")
    compiled = compile_target(target, args)
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
