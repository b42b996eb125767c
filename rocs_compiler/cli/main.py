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

The command line is split by concern: ``parser.py`` (arguments and subcommands),
``commands.py`` (``inspect``, ``export``, ``zoo``), ``inspection.py`` and ``inspect_formats.py``
(what ``inspect`` shows and how it is written), ``command_kit.py`` (exit codes, loading and
compiling a TARGET); ``serve.py`` and ``bench.py`` hold their commands. This module is the entry
point: it routes ``bench`` to the benchmark's own parser and turns errors into exit codes.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from . import bench as cli_bench
from .command_kit import EXIT_ERROR, EXIT_OK, EXIT_TOOL, EXIT_USAGE, MissingTool
from .commands import cmd_export, cmd_inspect, cmd_zoo
from .inspection import Inspection
from .output import Console, error_lines, third_party_silenced
from .parser import build_parser
from ..errors import CompileError, InputError, TargetError
from ..options import OptionsError
from ..progress import listening

__all__ = [
    "EXIT_ERROR", "EXIT_OK", "EXIT_TOOL", "EXIT_USAGE", "Inspection", "MissingTool",
    "build_parser", "cmd_export", "cmd_inspect", "cmd_zoo", "main",
]  # fmt: skip


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
