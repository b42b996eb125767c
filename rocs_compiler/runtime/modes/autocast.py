"""Calls under ``torch.autocast`` run the model compiled under that autocast.

Autocast decides per op which dtype an op computes in (``linear`` and ``matmul`` in the autocast
dtype, ``softmax`` or ``layer_norm`` in float32, the rest in the widest input dtype), so eager's
numerics under autocast are those of another program than the one compiled: the ``rocs::`` ops
of a float32 graph have no autocast rule (the fused linear's CPU kernel met a bfloat16 request
partial and float32 weights, "mat1 and mat2 must have the same dtype"), and running the float32
split partials in bfloat16 would round twice where eager rounds once. So the first call made
with autocast enabled for the program's device type compiles the original again, wrapped in
that autocast (``under_autocast``): capture lowers an autocast region to the explicit casts it
runs, so the program computes eager's casts, and its split partials round once as those of a
model compiled in bfloat16 do (docs/contract.md, "Numerical contract"). Each ``(device type,
dtype)`` gets its own program, compiled once, with its own guards and program choice; it reads
the original's own weights through the wrapper, so updates are seen as in any compile.

The program runs with the ambient autocast switched off for its device type: its casts are in
the graph already, and its eager paths (the original model, in buckets that chose it) enter the
wrapper's autocast themselves. Moves of the compiled model (``.to()``) are repeated on each
program, so a moved model under autocast is the moved original under autocast.

Identity relied on: ``model`` under ``torch.autocast(d, dtype)`` and ``under_autocast(model, d,
dtype)`` without it run the same ops on the same dtypes, so an exact compile of the second is
exact against the first.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any, Callable, Optional

import torch
from torch import nn


def autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The dtype autocast computes in on ``device_type`` now; None when it is off there."""
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def under_autocast(model: nn.Module, device_type: str, dtype: torch.dtype) -> nn.Module:
    """A module whose forward is ``model``'s (same signature, same mode) run under
    ``torch.autocast(device_type, dtype)``; ``model`` is its submodule ``model``."""
    signature = inspect.signature(model.forward)
    this = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)

    def forward(self, *args, **kwargs):
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.model(*args, **kwargs)

    forward.__signature__ = signature.replace(parameters=[this, *signature.parameters.values()])
    cls = type(f"{type(model).__name__}UnderAutocast", (_UnderAutocast,), {"forward": forward})
    wrapper = cls(model, device_type, dtype)
    wrapper.training = model.training  # not ``.train()``: that would switch the original
    return wrapper


class _UnderAutocast(nn.Module):
    def __init__(self, model: nn.Module, device_type: str, dtype: torch.dtype):
        super().__init__()
        self.model = model
        self.device_type = device_type
        self.dtype = dtype


class AutocastPrograms:
    """Per ``(device type, dtype)`` of autocast, the compiled model of the original under it,
    compiled on first use by ``compile_under(device_type, dtype)`` (a door's closure: the runtime
    does not call the doors)."""

    def __init__(
        self, compile_under: Callable[[str, torch.dtype], nn.Module], device: torch.device
    ):
        self._compile_under = compile_under
        self._device = torch.device(device)  # where the compiled model's program runs
        self._programs: dict[tuple[str, torch.dtype], nn.Module] = {}
        self._moves: list[Callable] = []  # ``_apply`` functions to repeat on each program
        self._lock = threading.Lock()

    def active(self) -> bool:
        """True when autocast is on for the program's device type (one C call when autocast is
        off everywhere, the common case)."""
        return torch._C._is_any_autocast_enabled() and torch.is_autocast_enabled(self._device.type)

    def program(self) -> nn.Module:
        """The compiled model under the autocast now enabled on the program's device type."""
        device_type = self._device.type
        key = (device_type, autocast_dtype(device_type))
        program = self._programs.get(key)
        if program is None:
            with self._lock:
                program = self._programs.get(key)
                if program is None:
                    # Captured as a top-level rocs.compile would be: outside the caller's
                    # autocast, ``no_grad`` and ``inference_mode``.
                    with (
                        torch.autocast(device_type, enabled=False),
                        torch.inference_mode(False),
                        torch.enable_grad(),
                    ):
                        program = self._compile_under(*key)
                    for fn in self._moves:
                        program._apply(fn)
                    self._programs[key] = program
        return program

    def moved(self, fn: Callable) -> None:
        """The compiled model was moved (``_apply``): move every program the same way, now or
        once it is compiled."""
        with self._lock:
            self._moves.append(fn)
            self._device = fn(torch.empty(0, device=self._device)).device
            for program in self._programs.values():
                program._apply(fn)

    def call(self, method: str, args: tuple, kwargs: dict, index: Any):
        """``method`` (``"forward"`` or ``"call_replicated"``) of the program under the current
        autocast, run with the ambient autocast off on the program's device type."""
        program = self.program()
        if index is not None:
            kwargs = {**kwargs, "candidate_to_request": index}
        with torch.autocast(self._device.type, enabled=False):
            return (
                program(*args, **kwargs)
                if method == "forward"
                else getattr(program, method)(*args, **kwargs)
            )
