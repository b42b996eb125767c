"""``rocs inspect --measure``: time the original model against the shared-layout call.

Sizes are candidates per request, like ``--candidates`` everywhere in the CLI: at size ``n`` and
``R`` requests the batch has ``R`` requests of ``n`` candidates each (``N = R * n`` rows).

One timing of a pair of calls on a shared machine can be off by a factor of two, so each size
is timed in repeated trials until the last ``WINDOW`` trials agree within ``SETTLED`` of their
median, or ``MAX_TRIALS`` trials or ``SIZE_BUDGET_S`` seconds have passed. The figure is the
median of those last trials, printed next to their spread (min, median, max).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, NamedTuple, Sequence

from ..formats.names import covers
from ..progress import stage

MEASURE_CANDIDATES = (16, 64, 256, 1024)
TRIAL_BUDGET_S = 0.2  # the timing of one trial
WINDOW = 5  # the trials that must agree
SETTLED = 0.15  # (max - min) / median of the window at which they agree
MAX_TRIALS = 30
SIZE_BUDGET_S = 10.0  # at most this long per size: the spread then shows how unsettled it is


class Measured(NamedTuple):
    per_request: int  # candidates per request
    num_candidates: int  # N, candidates in the batch
    speedup: float  # eager time / shared-layout time: the median of the last WINDOW trials
    low: float  # the smallest speedup of those trials
    high: float  # the largest
    trials: int  # trials run in all
    settled: bool  # whether the window agreed within SETTLED before the bounds ran out


class _TiledBatch(NamedTuple):
    """A batch in both layouts: ``kwargs`` (shared) and ``replicated()`` (the original call)."""

    kwargs: Any
    candidate_to_request: Any
    replicated_kwargs: Any

    def replicated(self) -> Any:
        return self.replicated_kwargs


def _tiled_batch(target, counts: Sequence[int]) -> _TiledBatch:
    """A batch built from the example rows (for factories without make_batch)."""
    import torch
    from torch.utils import _pytree as pytree

    from .input_specs import request_index
    from ..formats.leaves import named_leaves

    example = target.example_kwargs
    flat, spec = pytree.tree_flatten(example)
    names = list(named_leaves(example))
    rows = max(v.shape[0] for v in flat if isinstance(v, torch.Tensor) and v.dim())
    index = request_index(counts)
    num_requests, num_candidates = len(counts), sum(counts)
    shared, replicated = [], []
    for name, value in zip(names, flat):
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == rows:
            request = any(covers(r, name) for r in target.request_inputs)
            count = num_requests if request else num_candidates
            value = value.index_select(0, torch.arange(count) % rows)
            shared.append(value)
            replicated.append(value.index_select(0, index) if request else value)
        else:
            shared.append(value)
            replicated.append(value)
    return _TiledBatch(
        pytree.tree_unflatten(shared, spec), index, pytree.tree_unflatten(replicated, spec)
    )


def _time_pair(first: Callable[[], Any], second: Callable[[], Any], budget: float):
    """Best times of two calls, run alternately so that load on a shared machine hits both alike.

    The minimum over repeats is the least noisy estimate of a call's own cost.
    """
    best = [float("inf"), float("inf")]
    spent, rounds = 0.0, 0
    while rounds < 5 or (spent < budget and rounds < 200):
        for i, fn in enumerate((first, second)):
            start = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - start
            best[i] = min(best[i], elapsed)
            spent += elapsed
        rounds += 1
    return best[0], best[1]


def _speedup_until_settled(eager: Callable[[], Any], shared: Callable[[], Any]):
    """(the speedups of the last WINDOW trials, sorted; trials run; settled)."""
    eager(), shared()  # warm-up
    speedups: list[float] = []
    start = time.perf_counter()
    while True:
        eager_time, shared_time = _time_pair(eager, shared, TRIAL_BUDGET_S)
        speedups.append(eager_time / shared_time)
        window = sorted(speedups[-WINDOW:])
        spread = window[-1] - window[0]
        if len(window) == WINDOW and spread <= SETTLED * statistics.median(window):
            return window, len(speedups), True
        if len(speedups) >= MAX_TRIALS or time.perf_counter() - start > SIZE_BUDGET_S:
            return window, len(speedups), False


def sizes_up_to(per_request: int) -> list[int]:
    """The measured candidates-per-request sizes: the standard ones up to ``per_request``."""
    return sorted({n for n in MEASURE_CANDIDATES if n <= per_request} | {per_request})


def measure(target, compiled, num_requests: int, sizes: Sequence[int]) -> list[Measured]:
    """Measured speedup of the shared-layout call over the original model, per size."""
    import torch

    make = target.make_batch or (lambda counts: _tiled_batch(target, counts))
    points = []
    with torch.no_grad():
        first = make([1] * num_requests)
        with stage("codegen (first call)"):
            compiled(**first.kwargs, candidate_to_request=first.candidate_to_request)
        for n in sizes:
            batch = make([n] * num_requests)
            replicated = batch.replicated()
            shared, index = batch.kwargs, batch.candidate_to_request
            with stage(f"measure {n} candidates/request"):
                window, trials, settled = _speedup_until_settled(
                    lambda kw=replicated: target.model(**kw),
                    lambda kw=shared, idx=index: compiled(**kw, candidate_to_request=idx),
                )
            median = statistics.median(window)
            points.append(
                Measured(n, n * num_requests, median, window[0], window[-1], trials, settled)
            )
    return points


def describe(measured: Sequence[Measured], num_requests: int) -> str:
    """The measured speedups as text, one line per size with the spread of its last trials."""
    lines = [f"measured speedup   : R={num_requests}; per size, the median of its last trials"]
    for m in measured:
        lines.append(
            f"  {m.per_request:>5} per request: {m.speedup:.2f}x  (min {m.low:.2f}x, median "
            f"{m.speedup:.2f}x, max {m.high:.2f}x; last {min(m.trials, WINDOW)} of {m.trials} "
            f"trials{'' if m.settled else ', unsettled'})"
        )
    if not all(m.settled for m in measured):
        lines.append(
            f"  unsettled: the last {WINDOW} trials still differed by over {SETTLED:.0%} after "
            f"{MAX_TRIALS} trials or {SIZE_BUDGET_S:.0f} s (a busy machine?)"
        )
    return "\n".join(lines)
