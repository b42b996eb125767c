"""What every ``rocs`` command shares: the exit codes, :class:`MissingTool`, loading and
compiling a TARGET, and writing a command's output.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .output import Console
from ..progress import stage

if TYPE_CHECKING:  # targets import torch, which `rocs --help` and usage errors do without
    from .targets import Target

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_TOOL = 0, 1, 2, 3


class MissingTool(RuntimeError):
    """An external program the command needs is not installed."""


def num_candidates(args) -> int:
    """N, the candidates of one batch: ``--candidates`` is per request."""
    return args.candidates * args.requests


def _ensure_eval(target: Target, console: Console) -> None:
    if target.model.training:
        console.say(f"rocs: {target.label}: the model is in training mode; using eval mode")
        target.model.eval()


def compile_target(target: Target, args, example_kwargs=None):
    """``target``'s model compiled from its example (``example_kwargs``: another one)."""
    import rocs_compiler as rocs

    _ensure_eval(target, args.console)
    return rocs.compile(
        target.model, target.request_inputs,
        example_kwargs=target.example_kwargs if example_kwargs is None else example_kwargs,
        options=args.options,
    )  # fmt: skip


def write_output(text: str, args) -> None:
    if args.output:
        Path(args.output).write_text(text)
        args.console.note(f"wrote {args.output}")
    else:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")


def load_command_target(args) -> Target:
    from .targets import load_target

    with stage("load target"):
        return load_target(args.target, args.request, args.input or (), args.weights)
