"""Shared helpers of the test suite, which mirrors the package's folders (``tests/analysis`` for
``rocs_compiler/analysis``, ...). pytest puts this folder on ``sys.path``, so test modules in
subfolders import the shared models (``models_for_tests``) and these helpers by name."""

from __future__ import annotations

import os

# One intra-op thread per test process, and per process a test starts (the variable is read by
# each child's OpenMP): the suite runs as two xdist workers on two cores, and a worker whose
# torch threads outnumber its core waits on the other's (a 50-step training run took 58 s
# instead of 1.5 s that way). Tests assert no timings; benchmarks set their own threads.
os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402

torch.set_num_threads(1)

from rocs_compiler.cli import main as cli  # noqa: E402


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """``rocs ARGV`` in-process: (exit code, stdout, stderr)."""
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err
