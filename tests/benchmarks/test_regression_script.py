"""The no-regression benchmark runs end to end on two small models (no timing checks)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "regression.py"


def test_regression_script_quick(tmp_path):
    md = tmp_path / "table.md"
    models = ("no_share", "wide_deep", "torchfm_lr")  # torchfm_lr: a packed input's column range
    cmd = [sys.executable, str(SCRIPT), "--quick", "--models", *models, "--markdown", str(md)]
    proc = subprocess.run(cmd, check=False, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    assert out.startswith("| model | R=1 N=8 shared | R=1 N=8 drop-in | R=2 N=8 shared |")
    rows = [line for line in out.splitlines() if line.startswith(tuple(f"| {m} " for m in models))]
    assert len(rows) == 3
    for row in rows:
        ratios = row.strip("|").split("|")[1:]
        assert len(ratios) == 4 and all(float(r) > 0 for r in ratios), row  # no "!" mismatch mark
    assert "MISMATCH" not in out
    pattern = r"^minimum ratio: \d+\.\d\d \((no_share|wide_deep|torchfm_lr), R=\d, N=8, (shared|dropin)\)$"
    assert re.search(pattern, out, re.M)
    assert md.read_text() == out


def test_regression_script_knows_every_model_family():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import regression
    finally:
        sys.path.remove(str(SCRIPT.parent))
    names = set(regression.all_cases())
    assert len(names) >= 25
    assert {"crossmix", "cin", "autoint", "fibinet", "multitask_gates", "no_share"} <= names
    assert {"dcnv2_glm", "finalmlp_glm", "wukong_glm", "bst_dca", "hstu_dca", "two_tower"} <= names
    assert {"torchfm_lr", "torchfm_fm"} <= names
