"""One record per ``rocs::`` op, from which its registration and every table are derived.

A :class:`RocsOp` holds everything the compiler knows about one op: its schema, the argument
checks, the fake (meta) kernel, the FLOP formula, the CPU path in plain torch, the Triton
launcher for CUDA tensors, and the reference (materialize the broadcast, then the unfused op).
:func:`define` registers it as a ``torch.library`` custom op. Nothing else lists the ops: the
runtime's direct calls (``RocsOp.run``), the verifier's reference check and the tests read the
records in ``rocs_compiler.kernels.ROCS_OPS``.

Identity the runtime relies on: ``torch.ops.rocs.<name>(*args) == op.run(*args)`` whenever the
checks pass, because the op's body is exactly ``checks; return op.run(*args)``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch.utils.flop_counter import register_flop_formula

from .index_contract import check_candidate_to_request
from .common import debug_checks, use_triton


def first_tensor(*args: Any) -> torch.Tensor:
    """The argument whose device and dtype choose the path: the first tensor."""
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg
        if isinstance(arg, (list, tuple)) and arg and isinstance(arg[0], torch.Tensor):
            return arg[0]
    raise ValueError("a rocs op needs at least one tensor argument")


@dataclass(frozen=True)
class RocsOp:
    """Everything about one ``rocs::<name>`` op.

    ``check(*args)`` validates shapes and dtypes (raising ``ValueError``/``TypeError`` that name
    the op and the argument) and returns ``(N, R)`` for the index check, either None where
    unknown. ``index_arg`` is the position of ``candidate_to_request`` (None: the op takes none).
    ``triton`` names the launcher as ``"module:function"`` inside ``rocs_compiler.kernels``; it is
    imported on first use, so the package works without Triton.
    """

    name: str
    schema: str
    check: Callable[..., tuple[Optional[int], Optional[int]]]
    fake: Callable[..., torch.Tensor]
    cpu: Callable[..., torch.Tensor]
    reference: Callable[..., torch.Tensor]
    flops: Optional[Callable[..., int]] = None
    triton: Optional[str] = None
    index_arg: Optional[int] = None
    dispatch: Callable[..., torch.Tensor] = first_tensor

    @property
    def overload(self) -> torch._ops.OpOverload:
        return getattr(torch.ops.rocs, self.name).default

    def run(self, *args: Any) -> torch.Tensor:
        """The op without its checks: the Triton launcher on CUDA, the torch path on the CPU."""
        if self.triton is not None and use_triton(self.dispatch(*args)):
            return _launcher(self.triton)(*args)
        return self.cpu(*args)

    def checked_run(self, *args: Any) -> torch.Tensor:
        """The op's body: its checks, the index contract, then :meth:`run`."""
        num_candidates, num_requests = self.check(*args)
        if self.index_arg is not None:
            index = args[self.index_arg]
            check_candidate_to_request(
                index,
                num_candidates,
                num_requests,
                device=self.dispatch(*args).device,
                where=f"rocs::{self.name}",
                check_range=not index.is_cuda or debug_checks(),
            )
        return self.run(*args)


def _launcher(spec: str) -> Callable[..., torch.Tensor]:
    # Looked up at each call (a dict lookup once imported), so the module attribute is the
    # launcher that runs: tests count launches by wrapping it.
    module, function = spec.split(":")
    return getattr(importlib.import_module(f"rocs_compiler.kernels.{module}"), function)


def define(op: RocsOp) -> RocsOp:
    """Register ``op`` as ``torch.ops.rocs.<name>`` with its fake kernel and FLOP formula."""
    custom = torch.library.custom_op(
        f"rocs::{op.name}", op.checked_run, mutates_args=(), schema=op.schema
    )
    custom.register_fake(op.fake)
    if op.flops is not None:
        register_flop_formula(getattr(torch.ops.rocs, op.name))(op.flops)
    return op
