"""A compiled model moved to another floating dtype is compiled again for it.

``compiled.to(torch.bfloat16)`` must keep the numerical contract of a model compiled in
bfloat16 (``docs/contract.md``, numerics), but the compiled graph is specialized to the dtype it
was compiled in: the split partials of a float32 graph are float32 contractions with no casts,
which after a move run and round in bfloat16 (three roundings where eager rounds once); a
bfloat16 graph's float32 partials end in a cast back to bfloat16, which a move to float32 would
keep; and any cast in forward that was a no-op at compile time (``x.float()`` of a float32
tensor) is not in the graph at all. So a move that changes a floating dtype does what compile
would do: it compiles a copy of the original model moved the same way, on the compile's example
moved the same way, and the compiled model takes that program over, still following (as a cast
copy) and guarding the original model. A move of device alone keeps the graph, moved.

``cm.type(dtype)`` is the one move nn.Module applies to every tensor, integer ones included; a
compiled model moves only its floating (and complex) tensors and input specs, as ``.to(dtype)``
does: integer ids, index tables and masks keep their dtype and follow a device change alone
(:func:`keep_integer_dtypes`).

Identity relied on: a module's ``_apply(fn)`` maps every floating tensor of one dtype to one
dtype and device, so ``fn`` applied to an empty tensor of each floating dtype the compiled model
holds tells the move (``InputSpecs.moved`` reads input dtypes the same way).
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch


def dtype_move(
    fn: Callable[[torch.Tensor], torch.Tensor], tensors: Iterable[torch.Tensor]
) -> Optional[tuple[torch.dtype, torch.device]]:
    """The ``(dtype, device)`` that ``fn`` moves floating tensors to, when it changes the dtype
    of any of ``tensors``' floating dtypes; None when it changes none (a device move)."""
    seen = set()
    for tensor in tensors:
        key = (tensor.dtype, tensor.device)
        if not tensor.is_floating_point() or key in seen:
            continue
        seen.add(key)
        probe = fn(torch.empty(0, dtype=tensor.dtype, device=tensor.device))
        if probe.dtype != tensor.dtype:
            return probe.dtype, probe.device
    return None


def keep_integer_dtypes(
    fn: Callable[[torch.Tensor], torch.Tensor],
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``fn`` for floating and complex tensors; for any other tensor, only the device ``fn``
    moves it to (``nn.Module.type`` casts every tensor, ids included)."""

    def move(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_floating_point() or tensor.is_complex():
            return fn(tensor)
        probe = fn(torch.empty(0, dtype=tensor.dtype, device=tensor.device))
        return fn(tensor) if probe.dtype == tensor.dtype else tensor.to(probe.device)

    return move
