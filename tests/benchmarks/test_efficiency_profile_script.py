"""The efficiency profile script runs end to end and writes its tables (no timing checks)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "efficiency_profile.py"


def test_efficiency_profile_script_quick(tmp_path):
    md = tmp_path / "profile.md"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--models", "two_tower", "--markdown", str(md)]
    proc = subprocess.run(
        cmd, check=False, cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    text = md.read_text()
    assert "### two_tower (N = 16, R = 1, 2 calls)" in text
    for category in ("GEMM & attention", "embedding lookups", "data movement", "outside ATen"):
        assert f"| {category} |" in text
    assert "`rocs::embedding_bag_rows`" in text  # fused ops are found under the rocs call
    assert "FLOP ideal" in text and "| two_tower |" in text
    assert text.rstrip("\n") in proc.stdout
