"""Which of two exact programs a call runs: the shared one or the plain one, by measurement.

Both programs return the model's outputs (``runtime/plain.py`` states the plain program's
identity; the shared program's is the pipeline's), so the choice changes only the time a call
takes. Which one is faster depends on the batch (few candidates per request favour the plain
program, many the shared one) and on the machine, so it is measured rather than predicted:
calls are grouped into buckets by layout and size (the number of rows and the number of
requests, rounded to powers of two), the first calls of a bucket alternate between
the two programs, shared first, and once each has run :data:`TRIALS` times the bucket keeps the
one with the lower minimum time (on a shared machine noise only adds time, so the minimum is the
estimate it disturbs least). A bucket's decision is never revisited.

Calls in a bucket still being measured run one program each, never both: measuring adds no work.

Trials cost what the slower program costs, which for a model with much request-side work is
the whole saving many times over (a history encoder run per candidate). A bucket whose FLOP
ideal, the plain program's FLOPs over the shared program's (the compiler's cost model, per
request and per candidate), reaches :data:`CLEAR_GAIN` with a saving of at least
:data:`CLEAR_SAVING` FLOPs is therefore settled on the shared program at once; the other buckets
(close ones, or small ones where fixed per-call costs decide) are measured.

A drop-in call learns its number of requests only by finding them, which is the part of the
shared program's cost the plain one avoids: the time to find them counts toward the shared
program's trials only, and once every bucket of a row count chose the plain program (a
*family*, :meth:`ProgramChoice.everywhere`), calls with that row count skip finding requests.
A drop-in bucket that keeps the shared program makes every call of its row count find the
requests first, whatever their number, so while no bucket of the row count shares, a close
result goes to the plain program: the shared one must lead by :data:`DROPIN_MARGIN`, more than
the spread of the minimum of repeated trials on a shared machine, else a coin-toss win at one
request count taxes all the others (measured: a GRU history model at 16 rows, whose
one-request bucket went shared by 2-5 %, ran its four-request calls at 0.86-0.89 of eager
instead of 1.04). Once one bucket shares, every call of the row count finds requests anyway:
the other buckets then compare the programs as they will run, finding included in both, with
no margin (a transformer history model at 16 rows, four requests: 1.3x with the shared
program, 0.82-0.92 with the plain one after finding requests it no longer needed).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

SHARED, PLAIN = "shared", "plain"
TRIALS = 6  # timed calls per program; the first of each is discarded (allocation, caches)
# A bucket whose FLOP ideal (plain FLOPs over shared FLOPs) reaches CLEAR_GAIN while the plain
# program would run CLEAR_SAVING more FLOPs (about a millisecond of CPU work) is settled on the
# shared program without trials. Below that saving fixed per-call costs, which FLOPs do not
# count, can decide, and a trial is cheap.
CLEAR_GAIN = 2.0
CLEAR_SAVING = 1e7
DROPIN_MARGIN = 0.10  # relative lead the shared program needs in a drop-in bucket


class ProgramChoice:
    """Decisions and measurements per bucket (thread safe; decisions are read without a lock)."""

    def __init__(self, trials: int = TRIALS):
        self._trials = trials
        self._decided: dict[tuple, str] = {}
        self._times: dict[tuple, dict[str, list[float]]] = {}
        self._margins: dict[tuple, float] = {}  # lead the shared program needs, per bucket
        # A family (layout and rows) whose buckets all chose one program, none still measured.
        self._families: dict[tuple, str] = {}
        self._lock = threading.Lock()

    def decided(self, key: tuple) -> str | None:
        return self._decided.get(key)

    def settle(self, key: tuple, program: str) -> None:
        """Decide ``key`` without trials."""
        with self._lock:
            self._decided.setdefault(key, program)
            self._times.pop(key, None)
            self._margins.pop(key, None)
            self._summarize(key[:2])

    def everywhere(self, family: tuple) -> str | None:
        """The program every bucket of ``family`` (a bucket's first two fields) chose, when they
        all chose the same one and none is still being measured; else None."""
        return self._families.get(family)

    def shares_in(self, family: tuple) -> bool:
        """Whether some decided bucket of ``family`` runs the shared program."""
        return any(p == SHARED for k, p in list(self._decided.items()) if k[:2] == family)

    def next_trial(self, key: tuple, margin: float = 0.0) -> str:
        """The program the next call of an undecided bucket runs; the bucket keeps the shared
        program only if it is faster than the plain one by the fraction ``margin``."""
        with self._lock:
            if key not in self._times:
                self._times[key] = {SHARED: [], PLAIN: []}
                self._margins[key] = margin
                self._families.pop(key[:2], None)
            times = self._times[key]
            return PLAIN if len(times[PLAIN]) < len(times[SHARED]) else SHARED

    def record(self, key: tuple, program: str, seconds: float) -> None:
        with self._lock:
            if key in self._decided:
                return
            times = self._times.setdefault(key, {SHARED: [], PLAIN: []})
            times[program].append(seconds)
            if min(len(t) for t in times.values()) >= self._trials:
                best = {p: min(t[1:]) for p, t in times.items()}
                lead = 1.0 - self._margins.pop(key, 0.0)
                self._decided[key] = SHARED if best[SHARED] <= best[PLAIN] * lead else PLAIN
                del self._times[key]
                self._summarize(key[:2])

    def _summarize(self, family: tuple) -> None:
        if any(k[:2] == family for k in self._times):
            return
        chosen = {p for k, p in self._decided.items() if k[:2] == family}
        if len(chosen) == 1:
            self._families[family] = chosen.pop()
        else:
            self._families.pop(family, None)

    def run(
        self,
        key: tuple,
        shared: Callable[[], Any],
        plain: Callable[[], Any],
        settle: Callable[[], str | None] | None = None,
        shared_extra: float = 0.0,
        margin: float = 0.0,
    ) -> Any:
        """Run ``key``'s program: its decision, else ``settle()``'s, else the next trial, timed
        (``shared_extra`` seconds spent before the call count toward the shared program, which
        must lead by the fraction ``margin``)."""
        program = self.decided(key) or (settle() if settle is not None else None)
        if program is not None:
            return plain() if program == PLAIN else shared()
        program = self.next_trial(key, margin)
        start = now()
        result = plain() if program == PLAIN else shared()
        extra = shared_extra if program == SHARED else 0.0
        self.record(key, program, now() - start + extra)
        return result

    def decisions(self) -> dict[tuple, str]:
        """``{bucket: program}`` decided so far (for reports and tests)."""
        return dict(self._decided)


def bucket(layout: str, rows: int, requests: int = 0) -> tuple:
    """The bucket of a call: its layout and its sizes rounded up to powers of two."""
    return (layout, rows.bit_length(), requests.bit_length())


now = time.perf_counter
