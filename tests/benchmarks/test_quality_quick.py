"""The quality benchmark's --quick run: it finishes and writes every field the tables need.

Runs ``benchmarks/quality.py --quick`` (tiny synthetic MovieLens-format data under
``tests/data/ml-synthetic``) in a subprocess. Quality numbers on that data mean nothing, so the
test checks structure and internal consistency only, never AUC values.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "quality.py"
EXPECTED = {  # the quick run's backbones: one per path (the full run adds finalmlp and wukong)
    "dcnv2": ["vanilla", "rocs_base", "rocs_scaled"],
    "sequence": ["vanilla", "dca"],
    "ranker": ["vanilla", "rocs_base", "rocs_scaled"],
    "bst_like": ["vanilla", "dca", "dca_scaled"],
}


# One run for both tests (it trains every backbone): on one xdist worker, kept for the session.
pytestmark = pytest.mark.xdist_group("quality")


@pytest.fixture(scope="session")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("quality") / "quick.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--no-progress", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        check=False,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_every_backbone_and_variant_is_reported(quick_run):
    result, _ = quick_run
    found: dict[str, list[str]] = {}
    for row in result["results"]:
        found.setdefault(row["backbone"], []).append(row["variant"])
    assert found == EXPECTED


def test_rows_have_quality_cost_and_speed(quick_run):
    result, _ = quick_run
    seeds = result["config"]["seeds"]
    assert len(seeds) >= 2
    for row in result["results"]:
        where = f"{row['backbone']}/{row['variant']}"
        for metric in ("auc", "logloss"):
            stats = row[metric]
            assert len(stats["per_seed"]) == len(seeds), where
            assert all(math.isfinite(v) for v in stats["per_seed"]), where
            assert stats["std"] >= 0, where
        assert len(row["auc_delta_vs_vanilla"]["per_seed"]) == len(seeds), where
        flops = row["flops"]
        for key in ("request", "candidate", "amortized_n1", "amortized_n100"):
            assert flops[key] >= 0, (where, key)
        assert flops["amortized_n1"] == pytest.approx(flops["candidate"] + flops["request"])
        assert flops["amortized_n100"] == pytest.approx(flops["candidate"] + flops["request"] / 100)
        assert isinstance(flops["fallbacks"], list)
        for n in ("100", "1000"):
            speed = row["speed"][n]
            assert speed["eager_ms"] > 0 and speed["rocs_ms"] > 0, (where, n)
            assert speed["allclose"], (where, n, speed["max_abs_err"])
            assert speed["ideal_speedup"] >= 1.0 - 1e-9, (where, n)
        if row["variant"].endswith("_scaled"):
            assert row["request_scale"] >= 1.0
            assert row["scale_search"]["max_scale"] >= row["request_scale"]


def test_data_summary_and_markdown(quick_run):
    result, stdout = quick_run
    data = result["data"]
    assert data["train"]["rows"] > 0 and data["test"]["rows"] > 0
    assert result["command"].startswith("python benchmarks/quality.py --quick")
    header = stdout.splitlines()[0]
    assert header.startswith("| backbone | variant |")
    rows = sum(len(v) for v in EXPECTED.values())
    tables = stdout.split("\n\n")
    assert len(tables) == 2  # results, then per-seed details
    for table in tables:
        assert len([line for line in table.splitlines() if line.startswith("| ")]) == 1 + rows


def test_the_quality_tests_share_one_xdist_worker(request):
    """Under ``--dist loadgroup`` (the README's test command) the group mark reaches xdist, so
    the quick run above trains once, not once per worker (pytest 9.2 broke this: pyproject pins
    it out)."""
    if getattr(request.config.option, "loadgroup", False):
        assert request.node.nodeid.endswith("@quality"), request.node.nodeid
