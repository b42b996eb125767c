"""Writes that no version counter counts, found by content: for the request cache.

A compiled model follows its original's weights by their version counters and data pointers
(``runtime/follow/weights.py``). Some writes move neither: batch norm's running statistics are updated
in place by the train-mode forward's kernel, which bumps no version counter, and a write through
``.data`` (``buffer.data.copy_(x)``) goes to a tensor with a counter of its own. The compiled
graph reads the original's tensors through aliases, so without a cache the next call computes
with the new values; a cache whose entries were computed with the old ones would hand them out.

:class:`ContentWatch` keeps a copy of the bytes of the buffers the request program reads
(``WeightRefresh.read_by_content``: directly, or through a folded constant; and the constants
the graph lifted from forward, which it shares with the model) and compares them per call.
Identity: two calls read the same buffer values iff the buffers' bytes are equal, so a call
that finds them equal to the copy may use entries made since the copy. Buffers are where
modules keep state their forward writes outside autograd; parameters are written by optimizers,
``load_state_dict`` and assignment, which the version counters and pointers see (an in-place
write through a parameter's ``.data`` needs ``cm.refresh_weights()``, as for the rest of the
compiled model: comparing every weight's bytes per call would cost about what the request
program saves). The cost is one ``cat`` into a scratch buffer and one ``equal`` over the
buffers' bytes (batch norm's statistics: a few hundred bytes), none for a program reading no
buffer.
"""

from __future__ import annotations

import threading

import torch


class ContentWatch:
    """Per call, whether ``tensors`` were written since the last call (by any means)."""

    def __init__(self, tensors: list[torch.Tensor]):
        self._lock = threading.Lock()
        groups: dict[torch.device, list[torch.Tensor]] = {}
        for t in tensors:
            if t.device.type != "meta":  # no values to compare
                groups.setdefault(t.device, []).append(t)
        # Per device: byte views of the tensors whose elements tile one block of memory (made
        # once: a view sees every later write to its storage), the other tensors (copied per
        # call), their bytes as last seen, and a scratch buffer of that size.
        self._groups = []
        for group in groups.values():
            views = [_bytes(t) for t in group if t.is_contiguous()]
            loose = [t for t in group if not t.is_contiguous()]
            reference = torch.cat(_pieces(views, loose))
            self._groups.append([views, loose, reference, torch.empty_like(reference)])

    def __bool__(self) -> bool:
        return bool(self._groups)

    def changed(self) -> bool:
        """True (once) when the bytes differ from the last call's; they are kept as the new
        reference."""
        if not self._groups:
            return False
        moved = False
        with self._lock:
            for entry in self._groups:
                views, loose, reference, scratch = entry
                torch.cat(_pieces(views, loose), out=scratch)
                if not torch.equal(scratch, reference):
                    entry[2], entry[3] = scratch, reference
                    moved = True
        return moved


def _pieces(views: list[torch.Tensor], loose: list[torch.Tensor]) -> list[torch.Tensor]:
    return views + [_bytes(t.contiguous()) for t in loose] if loose else views


def _bytes(t: torch.Tensor) -> torch.Tensor:
    flat = t.view(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)
