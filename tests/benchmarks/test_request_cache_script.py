"""The request cache benchmark runs end to end and prints its tables (no timing checks)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "request_cache.py"


def test_request_cache_script_quick(tmp_path):
    cmd = [
        sys.executable, str(SCRIPT), "--models", "two_tower", "--hits", "0", "1", "--calls", "2",
        "--warm", "8", "--candidates", "2", "--users", "1000",
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT))  # this checkout's package, not an installed one
    proc = subprocess.run(
        cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| two_tower |")]
    assert len(rows) == 3  # two hit rates and the summary
