"""Wall-clock medians for the demo and the benchmark scripts (never used by tests)."""

from __future__ import annotations

import statistics
import time
from typing import Callable


def median_ms(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in milliseconds over ``repeats`` calls after ``warmup``."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def interleaved_medians(calls: dict[str, Callable[[], object]], repeats: int, rounds: int = 3):
    """Median milliseconds of each call, measured in ``rounds`` interleaved rounds of
    ``repeats // rounds`` calls each, so that drift in the machine's load hits every call alike."""
    timings: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            timings[name].append(median_ms(fn, max(repeats // rounds, 1)))
    return {name: statistics.median(values) for name, values in timings.items()}
