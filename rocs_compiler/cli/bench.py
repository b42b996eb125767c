"""``rocs bench``: the speed benchmark (``benchmarks/speed.py``) behind the ``rocs`` command.

The options are the script's own: ``rocs bench --help`` prints them, ``rocs bench`` checks the
arguments with the script's parser (an error names the argument) and then runs the script with
them unchanged, in a fresh process. A usage error is the parser's one error line and a hint.
``--candidates`` is per request, as everywhere in ``rocs``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

from ..errors import TargetError


def bench_script() -> Optional[Path]:
    for root in (Path.cwd(), Path(__file__).resolve().parents[1]):
        script = root / "benchmarks" / "speed.py"
        if script.is_file():
            return script
    return None


def _script_module(script: Path):
    # As ``python benchmarks/speed.py`` runs it: its own directory importable (its helpers).
    if str(script.parent) not in sys.path:
        sys.path.insert(0, str(script.parent))
    spec = importlib.util.spec_from_file_location("rocs_bench_speed", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def run_bench(argv: Sequence[str], script: Optional[Path]) -> int:
    """Check ``argv`` with the script's parser (``--help`` exits there), then run the script."""
    if script is None:
        raise TargetError(
            "benchmarks/speed.py was not found (looked in the current directory and next to the "
            "rocs_compiler package); rocs bench runs from a source checkout"
        )
    module = _script_module(script)
    usage = io.StringIO()
    try:
        with contextlib.redirect_stderr(usage):
            module.parse_args(list(argv), prog="rocs bench")
    except SystemExit as exit_:
        if exit_.code:  # a usage error: its last line names the argument; the usage is noise
            lines = usage.getvalue().strip().splitlines() or ["rocs bench: error"]
            sys.stderr.write(f"{lines[-1]}\n  (rocs bench --help lists the options)\n")
        raise
    return subprocess.call([sys.executable, str(script), *argv])
