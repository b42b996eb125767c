"""The training benchmark script runs end to end and writes well-formed results (no timing checks)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_training_script_quick(tmp_path):
    out = tmp_path / "out.json"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "training.py"),
        "--quick",
        "--models",
        "two_tower",
        "--json",
        str(out),
    ]
    proc = subprocess.run(
        cmd, check=False, cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "MISMATCH" not in proc.stderr
    rows = json.loads(out.read_text())
    assert [r["k"] for r in rows] == [1, 4]
    assert all(r["eager_ms"] > 0 and r["rocs_ms"] > 0 and r["loss_diff"] < 1e-3 for r in rows)


@pytest.mark.slow
def test_training_script_ddp_columns(tmp_path):
    out = tmp_path / "out.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "training.py"), "--quick", "--ddp",
           "--models", "two_tower", "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, check=False, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(out.read_text())
    assert all(r["ddp_eager_wall_ms"] > 0 and r["ddp_rocs_cpu_ms"] > 0 for r in rows)
