"""``rocs inspect --measure``: each size is timed in repeated trials until they agree (bounded in
count and time), and the figure is printed with the spread of those trials.

No timing is asserted: the stopping rule is driven by scripted timings, and the command's output
is checked for the spread's fields and their order (min <= median <= max).
"""

from __future__ import annotations

import json
import re
import sys
import textwrap

import pytest

from conftest import run_cli as run
from rocs_compiler.cli import measure

MODEL_FILE = textwrap.dedent(
    """
    import torch
    from torch import nn


    class Ranker(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.user = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 8))
            self.item = nn.Embedding(500, 8)
            self.head = nn.Linear(16, 1)

        def forward(self, user_dense, item_id):
            u = self.user(user_dense)
            return self.head(torch.cat([u, self.item(item_id)], dim=-1)).squeeze(-1)
    """
)
ARGS = [
    "inspect", "measured_models.py:Ranker", "--input", "user_dense=float32[12]",
    "--input", "item_id=int64[]<500", "--request", "user_dense", "--candidates", "16",
    "--requests", "2", "--measure", "-q",
]  # fmt: skip
SPREAD = re.compile(
    r"(\d+) per request: ([\d.]+)x  \(min ([\d.]+)x, median ([\d.]+)x, max ([\d.]+)x; "
    r"last (\d+) of (\d+) trials"
)


@pytest.fixture
def quick(tmp_path, monkeypatch):
    """A model file to inspect, and trials short enough for a test."""
    (tmp_path / "measured_models.py").write_text(MODEL_FILE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(measure, "TRIAL_BUDGET_S", 0.001)
    monkeypatch.setattr(measure, "SIZE_BUDGET_S", 1.0)
    yield
    sys.modules.pop("measured_models", None)


def _scripted(monkeypatch, speedups):
    """Make every trial return the next of ``speedups`` (as eager time / shared time)."""
    script = iter(speedups)
    monkeypatch.setattr(measure, "_time_pair", lambda first, second, budget: (next(script), 1.0))


def _never_called():
    return None


def test_trials_repeat_until_the_last_ones_agree(monkeypatch):
    monkeypatch.setattr(measure, "SIZE_BUDGET_S", float("inf"))
    # Two outliers first (the 47x / 20x kind), then trials within 15% of each other.
    _scripted(monkeypatch, [47.5, 19.7, 30.0, 31.0, 29.5, 30.5, 30.2, 99.0])
    window, trials, settled = measure._speedup_until_settled(_never_called, _never_called)
    assert settled and trials == 7
    assert window == sorted([30.0, 31.0, 29.5, 30.5, 30.2])


def test_trials_stop_at_the_count_bound_when_they_never_agree(monkeypatch):
    monkeypatch.setattr(measure, "SIZE_BUDGET_S", float("inf"))
    _scripted(monkeypatch, [10.0, 40.0] * measure.MAX_TRIALS)
    window, trials, settled = measure._speedup_until_settled(_never_called, _never_called)
    assert not settled and trials == measure.MAX_TRIALS
    assert len(window) == measure.WINDOW


def test_trials_stop_at_the_time_bound(monkeypatch):
    monkeypatch.setattr(measure, "SIZE_BUDGET_S", 0.0)
    _scripted(monkeypatch, [10.0, 40.0] * measure.MAX_TRIALS)
    window, trials, settled = measure._speedup_until_settled(_never_called, _never_called)
    assert not settled and trials == 1 and window == [10.0]


def test_text_prints_the_spread_next_to_each_figure(quick, capsys):
    code, out, err = run(capsys, *ARGS)
    assert code == 0, err
    points = SPREAD.findall(out)
    assert [int(p[0]) for p in points] == [16]
    for _, figure, low, median, high, last, trials in points:
        assert float(low) <= float(median) <= float(high)
        assert figure == median
        assert 1 <= int(last) <= min(int(trials), measure.WINDOW)


def test_json_carries_the_spread(quick, capsys):
    code, out, err = run(capsys, *ARGS, "--format", "json")
    assert code == 0, err
    (point,) = json.loads(out)["measured_speedup"]
    assert point["speedup_min"] <= point["speedup_median"] <= point["speedup_max"]
    assert point["speedup"] == point["speedup_median"]
    assert 1 <= point["trials"] <= measure.MAX_TRIALS
    assert isinstance(point["settled"], bool)
