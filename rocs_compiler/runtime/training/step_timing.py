"""Training trials timed to the end of their backward.

The program choice of a training compile (``runtime/training/program.py``) compares the training program
with the original model; a training step is forward *and* backward, and the two programs' backward
passes differ more than their forwards do (a ``rocs::`` op's backward is its own formula or the
vector-Jacobian product of its torch path, eager's is autograd's). :func:`run_step_trial` runs one
trial's forward and starts a clock on its outputs: when the backward reaches them (the loss's
backward above the model costs the same for both programs), and again when that backward pass ends
(``queue_callback`` of the autograd engine), the trial's time becomes forward + backward and is
recorded. A trial whose backward never comes (a grad-mode call without ``backward``) is recorded
with its forward alone when the next call of its bucket starts, so a bucket always decides.

Identity: the clock is an identity autograd function on the outputs (its backward returns the
gradients it gets, None for an output the loss does not reach), so outputs, gradients (which
parameters get none included) and what autograd saves are those of the trial's program.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..choice.program_choice import PLAIN, ProgramChoice, now


class _Pending:
    """One trial waiting for its backward: recorded once, by whichever comes first."""

    def __init__(
        self, choice: ProgramChoice, key: tuple, program: str, forward: float, clock: Callable
    ):
        self.choice, self.key, self.program, self.forward = choice, key, program, forward
        self.clock = clock  # the forward's clock, which times the backward too
        self._lock = threading.Lock()
        self._done = False

    def finish(self, backward: float = 0.0) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        self.choice.record(self.key, self.program, self.forward + backward)


class _BackwardClock(torch.autograd.Function):
    """Identity on the outputs; its backward starts the clock and queues its stop."""

    @staticmethod
    def forward(ctx, pending, *tensors):
        ctx.pending = pending
        # An output the loss does not use gets None, not zeros: a parameter only it reaches
        # keeps ``grad is None``, as in eager (an optimizer skips it; zeros would decay it).
        ctx.set_materialize_grads(False)
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        pending = ctx.pending
        clock = pending.clock
        start = clock()
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: pending.finish(clock() - start)
        )
        return (None, *grads)


class StepTrials:
    """Training trials of one :class:`ProgramChoice`, each recorded as forward + backward."""

    def __init__(self, choice: ProgramChoice):
        self.choice = choice
        self._waiting: dict[tuple, _Pending] = {}
        self._lock = threading.Lock()

    def run(
        self,
        key: tuple,
        shared: Callable[[], Any],
        plain: Callable[[], Any],
        settle: Callable[[], str | None],
        margin: float = 0.0,
        clock: Callable[[], float] | None = None,
    ) -> Any:
        """Like :meth:`ProgramChoice.run`, with each trial timed to the end of its backward by
        ``clock`` (``program_choice.call_clock``: a CPU call's backward runs on its thread; wall
        time when None)."""
        clock = clock or now
        choice = self.choice
        program = choice.decided(key) or settle()
        if program is not None:
            return plain() if program == PLAIN else shared()
        with self._lock:
            waiting = self._waiting.pop(key, None)
        if waiting is not None:  # the previous trial of this bucket had no backward
            waiting.finish()
        program = choice.next_trial(key, margin)
        start = clock()
        result = plain() if program == PLAIN else shared()
        pending = _Pending(choice, key, program, clock() - start, clock)
        leaves, spec = pytree.tree_flatten(result)
        positions = [
            i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor) and v.requires_grad
        ]
        if not positions:
            pending.finish()
            return result
        with self._lock:
            self._waiting[key] = pending
        timed = _BackwardClock.apply(pending, *(leaves[i] for i in positions))
        for i, tensor in zip(positions, timed):
            leaves[i] = tensor
        return pytree.tree_unflatten(leaves, spec)
