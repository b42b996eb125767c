"""The speed benchmark script runs end to end and writes well-formed results (no timing checks)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "speed.py"


def test_speed_script_quick(tmp_path):
    out = tmp_path / "out.json"
    md = tmp_path / "out.md"
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--quick",
        "--models",
        "dlrm",
        "two_tower",
        "--no-inductor",
        "--candidates",
        "4",
        "--requests",
        "1",
        "2",
        "--json",
        str(out),
        "--markdown",
        str(md),
        "--no-progress",
    ]
    proc = subprocess.run(
        cmd, check=False, cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]

    results = json.loads(out.read_text())
    rows = results["rows"]
    assert {(r["model"], r["R"], r["N_per_request"]) for r in rows} == {
        (m, r, 4) for m in ("dlrm", "two_tower") for r in (1, 2)
    }
    for row in rows:
        assert row["N_total"] == row["R"] * 4
        for key in ("eager_ms", "rocs_shared_ms", "rocs_dropin_ms"):
            assert row[key] is not None and row[key] > 0, (row["model"], key)
        assert row["inductor_ms"] is None and "inductor" in row["errors"]
        assert row["ideal_speedup"] >= 1.0
        assert row["speedup_shared"] > 0 and row["speedup_dropin"] > 0
        assert row["efficiency"] > 0
        assert not row["mismatch"], row
        if row["R"] == 1:
            memory = row["memory_bytes"]
            assert memory["eager"] > 0 and memory["rocs_shared"] > 0
        else:
            assert "memory_bytes" not in row

    assert results["meta"]["threads"] >= 1
    assert "| model | R | N/req |" in proc.stdout
    assert "dlrm" in proc.stdout and "two_tower" in proc.stdout
    markdown = md.read_text()
    assert "command: `python benchmarks/speed.py --quick" in markdown
    assert "Peak memory" in markdown


def test_memory_measurement_writes_nothing_to_stderr(capfd, monkeypatch):
    """The profiler's native ``USDT: ... profiler_start`` lines would interleave with progress."""
    import importlib.util

    import torch

    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("speed_for_test", SCRIPT)
    speed = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, speed)
    spec.loader.exec_module(speed)
    capfd.readouterr()
    assert speed.peak_memory_bytes(lambda: torch.ones(256, 256) * 2, torch.device("cpu")) > 0
    out, err = capfd.readouterr()
    assert err == "" and out == "", err
