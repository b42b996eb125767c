"""The eval mode of a training compile: an inference program of the original in eval mode.

A training compile captures its model in training mode: its dropout draws and its batch norm
normalizes by the batch's statistics, so the training program cannot answer for the model in
eval mode. ``cm.eval()`` (or a parent's ``.eval()``, or ``model.eval()`` itself) switches the
original; the next call made in eval mode compiles the original again as it now is, once, through
the same door and pipeline as an inference compile (``rocs.compile(model.eval(), request_inputs,
example, options)``, the compile's own request inputs, example and options with ``training``
off), and every call in eval mode runs that compiled model: the request side shared, in both
layouts, under its own guards and program choice. It reads the original's own parameters and
buffers, as every inference compile does (``runtime/follow/weights.py``), so the optimizer's in-place
steps and the running statistics the training calls updated are seen at the next evaluation.
``cm.train()`` switches back to the training program; the eval program is kept for the next
evaluation.

Identity: the eval program is an inference compile of the model in eval mode, exact against it
(docs/contract.md); the original in eval mode is what eager evaluation runs.

A call in eval mode with grad enabled (a loss on eval-mode outputs, fine-tuning with frozen
batch statistics) runs the original model itself, so its gradients are eager's: an inference
program computes without autograd. A training compile moved to another dtype evaluates under
``torch.no_grad()`` only (its eager model is a moved copy whose gradients would not reach the
original's parameters).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ...errors import InputError


class EvalMode:
    """The eval-mode program of a training compile of ``original``, compiled on first use by
    ``compile_eval`` (a door's closure: the runtime does not call the doors)."""

    def __init__(self, original: nn.Module, compile_eval: Callable[[], nn.Module]):
        self._original = original
        self._compile_eval = compile_eval
        self._program: nn.Module | None = None
        self._moves: list[Callable] = []  # ``_apply`` functions to repeat on the program
        self._lock = threading.Lock()

    def applies(self) -> bool:
        """True when the original is in eval mode (it was compiled in training mode)."""
        return not self._original.training

    @property
    def program(self) -> nn.Module | None:
        """The eval-mode compiled model, or None before the first call in eval mode."""
        return self._program

    def compiled(self) -> nn.Module:
        """The eval-mode compiled model, compiled now if this is the first call in eval mode."""
        if self._program is None:
            with self._lock:
                if self._program is None:
                    # Capture as a top-level rocs.compile would: not under the caller's
                    # ``no_grad`` or ``inference_mode`` (whose tensors cannot join autograd).
                    with torch.inference_mode(False), torch.enable_grad():
                        program = self._compile_eval()
                    for fn in self._moves:
                        program._apply(fn)
                    self._program = program
        return self._program

    def moved(self, fn: Callable) -> None:
        """The training compile was moved (``_apply``): move the eval program the same way, now
        or once it is compiled."""
        with self._lock:
            self._moves.append(fn)
            if self._program is not None:
                self._program._apply(fn)

    def call(self, model: Any, args: tuple, kwargs: dict, index: torch.Tensor | None):
        """``model``'s call (``CompiledModel.forward``) in eval mode."""
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():
            return self._call_original(model, args, kwargs, index)
        program = self.compiled()
        if index is None:
            return program(*args, **kwargs)
        return program(*args, candidate_to_request=index, **kwargs)

    def call_replicated(self, model: Any, args: tuple, kwargs: dict, index: torch.Tensor):
        """``model.call_replicated`` in eval mode: the request inputs come replicated."""
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():
            return self._call_original(model, args, kwargs, None)
        return self.compiled().call_replicated(*args, candidate_to_request=index, **kwargs)

    def _call_original(self, model: Any, args: tuple, kwargs: dict, index):
        """A grad-mode call in eval mode: the original model on the call in replicated layout
        (request leaves gathered with ``index``), past DDP's check as every training call."""
        if model._original_is_copy:
            raise InputError(
                "a training compile moved to another dtype evaluates in eval mode under "
                "torch.no_grad() only (its eager model is a moved copy): call it under "
                "torch.no_grad(), or call cm.train() to train on"
            )
        if model._ddp is not None:
            model._ddp.check()  # ``runtime/training/distributed.py``
        return model.input_format.run_original(self._original, args, kwargs, index)
