"""Which of two exact programs a call runs: the shared one or the plain one, by measurement.

Both programs return the model's outputs (``runtime/call/plain.py`` states the plain program's
identity), so the choice changes only the time a call takes, and it is measured rather than
predicted. Calls are grouped into buckets (:func:`bucket`) by layout, by size (rows and requests,
rounded up to powers of two) and by *length class*: the bit length of each dynamic size past the
batch dim (a history length the example marked dynamic, ``runtime/call/lengths.py``; none for a
model without one, whose buckets are ``(layout, rows bits, requests bits)``). What sharing saves
changes with the length, so a bucket measured at long histories decides nothing for short ones.
The first calls of a bucket alternate between the programs, shared first, and once each has run
:data:`TRIALS` times the bucket keeps the one with the lower minimum time (noise only adds time).
A decision is never revisited; a call being measured runs one program, never both.

A bucket whose FLOP ideal (the pipeline's FLOPs per request and per candidate, counted at the
call's lengths once per length class: ``runtime/call/prior.py``) reaches :data:`CLEAR_GAIN` with
a saving of at least :data:`CLEAR_SAVING` FLOPs is settled on the shared program without trials,
whose cost would be the slower program's; one whose ideal is below :data:`LOW_GAIN` keeps the
shared program only if it leads by :data:`LOW_GAIN_MARGIN` (:func:`margin_for`).

A drop-in call finds its requests before it knows its bucket: that time counts toward the shared
program only, and once every bucket of a row count and length class (a *row class*,
:func:`row_class`, :meth:`ProgramChoice.everywhere`) chose the plain program, calls of that row
class skip finding requests. While no bucket of a row class shares, the shared program must lead
by :data:`DROPIN_MARGIN` (a close win at one request count would tax every call of the row
class); once one shares, the others compare with finding included in both and no margin.
docs/SPEED.md ("Program choice") has the measurements behind these rules.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

SHARED, PLAIN = "shared", "plain"
TRIALS = 6  # timed calls per program; the first of each is discarded (allocation, caches)
# Training steps (``runtime/training/step_timing.py``): more trials, compared by their median. A step of a
# few milliseconds moves by 10-20 % from call to call on a loaded CPU (memory traffic more than
# interrupts), so the lower minimum of five picks the more variable program, not the faster one;
# a training run's cost is its typical step, and 2 x 10 trial steps are nothing beside it.
TRAINING_TRIALS = 10
# A bucket whose FLOP ideal (plain FLOPs over shared FLOPs) reaches CLEAR_GAIN while the plain
# program would run CLEAR_SAVING more FLOPs (about a millisecond of CPU work) is settled on the
# shared program without trials. Below that saving fixed per-call costs, which FLOPs do not
# count, can decide, and a trial is cheap.
CLEAR_GAIN = 2.0
CLEAR_SAVING = 1e7
DROPIN_MARGIN = 0.10  # relative lead the shared program needs in a drop-in bucket
# A bucket whose FLOP ideal is below LOW_GAIN has next to nothing to share: its shared program is
# the plain one rewritten, and a tie in five timed calls is noise. The shared program must then
# lead by LOW_GAIN_MARGIN, so that a model with nothing to share keeps its own ops.
LOW_GAIN = 1.05
LOW_GAIN_MARGIN = 0.05


class ProgramChoice:
    """Decisions and measurements per bucket (thread safe; decisions are read without a lock)."""

    def __init__(self, trials: int = TRIALS, typical: Callable[[list[float]], float] = min):
        self._trials = trials
        self._typical = typical  # a program's time from its trials (the first one dropped)
        self._decided: dict[tuple, str] = {}
        self._times: dict[tuple, dict[str, list[float]]] = {}
        self._margins: dict[tuple, float] = {}  # lead the shared program needs, per bucket
        # A row_class (layout and rows) whose buckets all chose one program, none still measured.
        self._row_classes: dict[tuple, str] = {}
        self._lock = threading.Lock()

    def decided(self, key: tuple) -> str | None:
        return self._decided.get(key)

    def settle(self, key: tuple, program: str) -> None:
        """Decide ``key`` without trials."""
        with self._lock:
            self._decided.setdefault(key, program)
            self._times.pop(key, None)
            self._margins.pop(key, None)
            self._summarize(row_class(key))

    def everywhere(self, rows: tuple) -> str | None:
        """The program every bucket of the row class ``rows`` (:func:`row_class`) chose, when
        they all chose the same one and none is still being measured; else None."""
        return self._row_classes.get(rows)

    def shares_in(self, rows: tuple) -> bool:
        """Whether some decided bucket of the row class ``rows`` runs the shared program."""
        return any(p == SHARED for k, p in list(self._decided.items()) if row_class(k) == rows)

    def next_trial(self, key: tuple, margin: float = 0.0) -> str:
        """The program the next call of an undecided bucket runs; the bucket keeps the shared
        program only if it is faster than the plain one by the fraction ``margin``."""
        with self._lock:
            if key not in self._times:
                self._times[key] = {SHARED: [], PLAIN: []}
                self._margins[key] = margin
                self._row_classes.pop(row_class(key), None)
            times = self._times[key]
            return PLAIN if len(times[PLAIN]) < len(times[SHARED]) else SHARED

    def record(self, key: tuple, program: str, seconds: float) -> None:
        with self._lock:
            if key in self._decided:
                return
            times = self._times.setdefault(key, {SHARED: [], PLAIN: []})
            times[program].append(seconds)
            if min(len(t) for t in times.values()) >= self._trials:
                best = {p: self._typical(t[1:]) for p, t in times.items()}
                lead = 1.0 - self._margins.pop(key, 0.0)
                self._decided[key] = SHARED if best[SHARED] <= best[PLAIN] * lead else PLAIN
                del self._times[key]
                self._summarize(row_class(key))

    def _summarize(self, rows: tuple) -> None:
        if any(row_class(k) == rows for k in self._times):
            return
        chosen = {p for k, p in self._decided.items() if row_class(k) == rows}
        if len(chosen) == 1:
            self._row_classes[rows] = chosen.pop()
        else:
            self._row_classes.pop(rows, None)

    def run(
        self,
        key: tuple,
        shared: Callable[[], Any],
        plain: Callable[[], Any],
        settle: Callable[[], str | None] | None = None,
        shared_extra: float = 0.0,
        margin: float = 0.0,
        clock: Callable[[], float] | None = None,
    ) -> Any:
        """Run ``key``'s program: its decision, else ``settle()``'s, else the next trial, timed by
        ``clock`` (default wall time; ``shared_extra`` seconds spent before the call count toward
        the shared program, which must lead by the fraction ``margin``)."""
        program = self.decided(key) or (settle() if settle is not None else None)
        if program is not None:
            return plain() if program == PLAIN else shared()
        program = self.next_trial(key, margin)
        clock = clock or now
        start = clock()
        result = plain() if program == PLAIN else shared()
        extra = shared_extra if program == SHARED else 0.0
        self.record(key, program, clock() - start + extra)
        return result

    def decisions(self) -> dict[tuple, str]:
        """``{bucket: program}`` decided so far (for reports and tests)."""
        return dict(self._decided)


def margin_for(ideal: float, margin: float = 0.0) -> float:
    """The lead the shared program needs in a bucket whose FLOP ideal (plain FLOPs over shared
    FLOPs; 0 when unknown) is ``ideal``, at least ``margin``."""
    return max(margin, LOW_GAIN_MARGIN) if 0.0 < ideal < LOW_GAIN else margin


def bucket(layout: str, rows: int, requests: int = 0, lengths: tuple = ()) -> tuple:
    """The bucket of a call: its layout, its sizes rounded up to powers of two and its length
    class ``lengths`` (``runtime/call/lengths.py``; empty for a model without dynamic lengths,
    whose buckets are ``(layout, rows bits, requests bits)``)."""
    return (layout, rows.bit_length(), requests.bit_length()) + lengths


def row_class(key: tuple) -> tuple:
    """The row class of the bucket ``key``: every field but its requests (layout, rows bits,
    length class)."""
    return key[:2] + key[3:]


now = time.perf_counter


def call_clock(on_cpu: bool = True) -> Callable[[], float]:
    """The clock a trial is timed by: the thread's CPU time when the call computes on the CPU
    with one torch thread (all of its work is then on the calling thread, autograd's backward of
    CPU tensors included, and time spent preempted by other processes is not the call's), else
    wall time."""
    return time.thread_time if on_cpu and torch.get_num_threads() == 1 else now
