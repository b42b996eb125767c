"""The serving benchmark's load without Ray: requests of the pool fit the served model's check,
their candidate counts lie in the asked range, and users repeat (Zipf). The benchmark itself
starts Ray and runs for minutes: it is run by hand (docs/SPEED.md, "Serving")."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serving.py"


def _script():
    spec = importlib.util.spec_from_file_location("serving_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_request_pool_is_a_valid_ragged_zipf_load():
    bench = _script()
    pool = bench.request_pool("din", 40, 50, 2000, users=1000, seed=0)
    counts = [bench.body_candidates(b) for b in pool]
    assert all(50 <= c <= 2000 for c in counts) and len(set(counts)) > 20
    users = [tuple(b["request"]["user_profile"].tolist()) for b in pool]
    assert len(set(users)) < len(users)  # the most popular users come back
    args = bench.build_parser().parse_args(["--models", "din", "glm_dcnv2", "--duration", "1"])
    assert args.models == ["din", "glm_dcnv2"] and args.slo_ms == 60.0
