"""Side-by-side optimizer runs: a model trained eagerly, then through its compiled form."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn


def optimizer_runs(
    model: nn.Module,
    calls: Sequence[tuple[Callable[[], Any], Callable[[], Any]]],
    loss: Callable[[Any, int], torch.Tensor],
    steps: int = 50,
) -> tuple[list[float], list[float]]:
    """``steps`` SGD steps (momentum 0.9) of ``model`` through the first call of each pair of
    ``calls`` (one pair per batch, cycled), then from the same starting weights through the
    second: (first losses, second losses). ``loss(outputs, batch position)`` is the loss;
    the RNG is seeded per step. Asserts that both runs end at the same weights; ``model`` is
    left as it was."""
    start = copy.deepcopy(model.state_dict())
    runs, finals = [], []
    for which in (0, 1):
        model.load_state_dict(start)
        opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
        losses = []
        for step in range(steps):
            position = step % len(calls)
            opt.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            value = loss(calls[position][which](), position)
            value.backward()
            opt.step()
            losses.append(float(value))
        runs.append(losses)
        finals.append(copy.deepcopy(model.state_dict()))
    model.load_state_dict(start)
    model.zero_grad(set_to_none=True)
    for name, value in finals[0].items():
        if not value.is_floating_point():
            continue
        # 50 momentum steps carry one step's rounding differences forward: a looser bound.
        atol = 1e-3 * max(1.0, float(value.abs().max()))
        torch.testing.assert_close(
            finals[1][name], value, rtol=1e-2, atol=atol, msg=lambda m, name=name: f"{name}: {m}"
        )
    return runs[0], runs[1]
