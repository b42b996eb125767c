"""Shared helpers of the test suite, which mirrors the package's folders (``tests/analysis`` for
``rocs_compiler/analysis``, ...). pytest puts this folder on ``sys.path``, so test modules in
subfolders import the shared models (``models_for_tests``) and these helpers by name."""

from __future__ import annotations

from rocs_compiler.cli import main as cli


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """``rocs ARGV`` in-process: (exit code, stdout, stderr)."""
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err
