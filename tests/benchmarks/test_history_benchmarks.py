"""The lineage and ecosystem benchmarks run end to end and report exact rows (no timing checks)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, *args: str) -> str:
    cmd = [sys.executable, str(ROOT / "benchmarks" / script), "--repeats", "1", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_lineage_rows_are_exact_and_fully_shared():
    out = _run("lineage.py", "--candidates", "8", "--models", "GRU, sequence first",
               "heads merged into the batch (bmm)")  # fmt: skip
    rows = [line for line in out.splitlines() if line.startswith(("| GRU", "| heads"))]
    assert len(rows) == 2, out
    assert all(row.endswith("| 0 | True |") for row in rows), rows  # no fallback, exact


def test_ecosystem_rows_are_exact():
    pytest.importorskip("deepctr_torch")
    out = _run("ecosystem.py", "--candidates", "8", "--models", "wdl")
    (row,) = [line for line in out.splitlines() if line.startswith("| wdl")]
    assert row.endswith("| True |"), row


def test_ecosystem_torchrec_rows_are_exact():
    pytest.importorskip("torchrec", reason="the TorchRec rows need torchrec")
    out = _run("ecosystem.py", "--candidates", "8", "--libraries", "torchrec", "--models", "dlrm")
    (row,) = [line for line in out.splitlines() if line.startswith("| dlrm")]
    assert row.endswith("| True |"), row
