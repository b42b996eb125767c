"""Helpers of the training tests: losses, gradient comparison against eager, optimizer runs.

The oracle is the original model trained eagerly on the replicated batch; it knows nothing about
sharing. Gradients are compared parameter by parameter at float32 tolerances scaled by the
gradient's size (the compiled backward re-associates per-request sums).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from optimizer_runs import optimizer_runs
from torch.utils import _pytree as pytree

from models_zoo import Batch

# (counts per request, shuffled candidate order)
RAGGED_BATCHES = {
    "ragged_1_3_17": ([1, 3, 17], True),
    "one_request": ([5], False),
    "each_impression_its_own_request": ([1, 1, 1, 1, 1, 1], False),
}


def floating_leaves(out: Any) -> list[torch.Tensor]:
    return [
        t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()
    ]


def loss_of(out: Any, seed: int = 0) -> torch.Tensor:
    """A squared error against fixed random targets, summed over the floating outputs."""
    gen = torch.Generator().manual_seed(seed)
    total = 0.0
    for leaf in floating_leaves(out):
        target = torch.randn(leaf.shape, generator=gen).to(leaf.dtype)
        total = total + ((leaf.float() - target) ** 2).mean()
    return total


def gradients(model: nn.Module, run: Callable[[], Any], seed: int = 0) -> tuple[float, dict]:
    """(loss, {name: grad}) of one backward of ``loss_of(run())`` into ``model``'s parameters.
    The global generator is seeded first: a compiled model's random ops (dropout) draw what
    eager's draw from the same state (they run in eager's order, on eager's shapes)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = loss_of(run(), seed)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return float(loss), grads


def assert_gradients_match(got: dict, want: dict, what: str = "") -> None:
    assert set(got) == set(want), (
        f"{what}: parameters with a gradient differ: {set(got) ^ set(want)}"
    )
    for name, g in want.items():
        scale = float(g.abs().max()) if g.numel() else 1.0
        torch.testing.assert_close(
            got[name],
            g,
            rtol=1e-4,
            atol=1e-5 * max(1.0, scale),
            msg=lambda m, name=name: f"{what} {name}: {m}",
        )


def check_gradients(
    model: nn.Module, cm, batch: Batch, what: str = "", dropin: bool = True
) -> None:
    """The compiled model's parameter gradients equal eager's on ``batch``, shared layout and
    (``dropin``) the original call."""
    replicated = batch.replicated()
    loss, want = gradients(model, lambda: model(**replicated))
    shared_loss, got = gradients(
        model, lambda: cm(**batch.kwargs, candidate_to_request=batch.candidate_to_request)
    )
    assert abs(shared_loss - loss) <= 1e-4 * max(1.0, abs(loss)), (what, shared_loss, loss)
    assert_gradients_match(got, want, f"{what} shared layout")
    if dropin:
        _, got = gradients(model, lambda: cm(**replicated))
        assert_gradients_match(got, want, f"{what} drop-in")


def optimizer_run(model: nn.Module, cm, batches: list[Batch], steps: int = 50) -> tuple[list, list]:
    """``steps`` SGD steps of ``model`` trained eagerly, then, from the same starting weights,
    through its compiled form ``cm`` (shared layout), on the same batches: (eager losses,
    compiled losses). Asserts that both runs end at the same weights; ``model`` is left as it
    was. ``cm`` follows the in-place reloads of the model's weights between the runs."""
    calls = [
        (
            lambda b=b: model(**b.replicated()),
            lambda b=b: cm(**b.kwargs, candidate_to_request=b.candidate_to_request),
        )
        for b in batches
    ]
    return optimizer_runs(model, calls, lambda out, position: loss_of(out, seed=position), steps)


def assert_losses_track(
    eager_losses: list[float], compiled_losses: list[float], what: str = ""
) -> None:
    for step, (a, b) in enumerate(zip(eager_losses, compiled_losses)):
        assert abs(a - b) <= 2e-3 * max(1.0, abs(a)), (
            f"{what}: step {step}: eager {a}, compiled {b}"
        )
