"""The original model as the plain program's rival: a settled plain bucket runs the faster one.

A bucket that settles on the plain program (``runtime/choice/program_choice.py``) has nothing to share
worth its cost; what is left to win is the fixed cost of a call. The plain program (the compiled
graph without sharing, ``runtime/call/plain.py``) runs the model's ATen ops without its modules, often
faster than the model itself, but before it the runtime checks that the model is still the one
compiled (``runtime/follow/guards.py``) and the inputs' specs, which on a small model costs more than the
module calls the graph saves. So the next calls of such a bucket measure both, the plain program
and the original model on the call as made, :data:`ARM_TRIALS` each, alternating, by the call's
clock (``program_choice.call_clock``), and keep the plain program only if its minimum leads the
original's by :data:`PROGRAM_MARGIN`. A call in a bucket that
kept the original model runs it on the call as made (in the shared layout with the request rows
gathered to the candidates first): no guards, since the original is the model as it is now, no
input specs, which the original meets or refuses itself, nothing converted.

Identity: the original model's answer on the replicated call is the plain program's (the plain
program's identity, ``runtime/call/plain.py``, is stated against it) and the compiled model's contract,
so the choice changes only the time a call takes. Keys are the program choice's buckets; a
drop-in row class is one key, ``(layout, rows bits, 0, *length class)``, since it is only settled
on the plain program once every bucket of its row class is.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ..choice.program_choice import PLAIN, SHARED, ProgramChoice, call_clock

PROGRAM, ORIGINAL = "plain program", "original"
ARM_TRIALS = 10  # timed calls per arm: the arms are close on the models where this matters
# The plain program is kept only when it leads the original model by this fraction: a tie goes to
# the original, whose cost is the model's own whatever the runtime's checks cost.
PROGRAM_MARGIN = 0.03
_ARM = {SHARED: PROGRAM, PLAIN: ORIGINAL}  # the inner choice's arms: the program, the original


class OriginalArm:
    """Per settled plain bucket, whether its calls run the plain program or the original model.

    A lane that runs the plain program in a settled bucket notes its key (:meth:`note`); while a
    noted key is undecided (:meth:`measuring_any`) calls look up their bucket before the guards
    (``settled_plain.run_as_original``), where a trial times each arm as its kept lane runs, and
    while a noted key is undecided or some key kept the original (:attr:`active`) calls look for
    a kept original before the guards (``CompiledModel.forward``)."""

    def __init__(self, trials: int = ARM_TRIALS):
        self._choice = ProgramChoice(trials)
        self._pending: set[tuple] = set()
        self._lock = threading.Lock()
        self.active = False
        # Drop-in row classes that kept the original (:func:`dropin_row_class`): a drop-in row
        # class settled on the plain program finds no requests, so no new bucket of it is ever
        # measured again.
        self.dropin_originals: set[int | tuple] = set()
        self.shared_originals: set[tuple] = set()  # shared-layout buckets that kept the original
        self.kept: dict[tuple, str] = {}  # bucket -> PROGRAM or ORIGINAL, read without a lock

    def note(self, key: tuple) -> None:
        """A call of ``key``, a bucket settled on the plain program, ran the plain program."""
        if key not in self._pending and key not in self.kept:
            with self._lock:
                self._pending.add(key)
                self.active = True

    def measuring_any(self) -> bool:
        """Whether some noted bucket is not decided yet."""
        return bool(self._pending)

    def measuring(self, key: tuple) -> bool:
        """Whether ``key`` was noted and is not decided yet."""
        return key in self._pending

    def run(self, key: tuple, program: Callable[[], Any], original: Callable[[], Any],
            on_cpu: bool = True) -> Any:
        """``key``'s call: the arm it kept, else the next trial, timed by the call's clock."""
        result = self._choice.run(
            key, program, original, margin=PROGRAM_MARGIN, clock=call_clock(on_cpu)
        )
        if key in self._pending and self._choice.decided(key) is not None:
            self._decided(key)
        return result

    def _decided(self, key: tuple) -> None:
        with self._lock:
            self._pending.discard(key)
            arm = self.kept[key] = _ARM[self._choice.decided(key)]
            if arm == ORIGINAL and key[0] == "dropin":
                self.dropin_originals.add(dropin_row_class(key))
            elif arm == ORIGINAL and key[0] == "shared":
                self.shared_originals.add(key)
            self.active = bool(self._pending) or ORIGINAL in self.kept.values()

    def settle(self, key: tuple, arm: str) -> None:
        """Decide ``key`` for ``arm`` (:data:`PROGRAM` or :data:`ORIGINAL`) without trials."""
        with self._lock:
            self._pending.add(key)
        self._choice.settle(key, PLAIN if arm == ORIGINAL else SHARED)
        self._decided(key)

    def decisions(self) -> dict[tuple, str]:
        """``{bucket: "plain program" | "original"}`` decided so far."""
        return dict(self.kept)


def dropin_row_class(key: tuple) -> int | tuple:
    """What ``CompiledModel.forward`` finds a drop-in call of the bucket ``key`` by in
    :attr:`OriginalArm.dropin_originals`: its rows bits, or for a model with dynamic lengths
    ``(rows bits, *length class)``."""
    return key[1] if len(key) == 3 else (key[1], *key[3:])
