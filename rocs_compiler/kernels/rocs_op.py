"""One record per ``rocs::`` op, from which its registration and every table are derived.

A :class:`RocsOp` holds everything the compiler knows about one op: its schema, the argument
checks, the fake (meta) kernel, the FLOP formula, the CPU path in plain torch, the Triton
launcher for CUDA tensors, and the reference (materialize the broadcast, then the unfused op).
:func:`define` registers it as a ``torch.library`` custom op. Nothing else lists the ops: the
runtime's direct calls (``RocsOp.run``), the verifier's reference check and the tests read the
records in ``rocs_compiler.kernels.ROCS_OPS``.

Identity the runtime relies on: ``torch.ops.rocs.<name>(*args) == op.run(*args)`` whenever the
checks pass, because the op's body is exactly ``checks; return op.run(*args)``.

Autograd (``torch.library.register_autograd``, registered by :func:`define` with the op): the
backward is the op's own ``backward`` formula where it has one, else the vector-Jacobian product
of ``differentiable``, a plain-torch function equal to the op (its torch path, when that is
built from differentiable ops, or its reference), recomputed from the saved inputs. Identity:
``op(*args) == differentiable(*args)`` for all inputs, so their derivatives agree; the backward of
the in-kernel broadcast ``u[idx]`` is the per-request sum ``zeros(R).index_add_(0, idx, g)``.
A ``create_graph`` backward (grad mode on inside the backward) is the vector-Jacobian product of
``differentiable`` instead, built with a graph, so second derivatives are those of the op's
torch form: the same identity, differentiated twice.
"""

from __future__ import annotations

import contextvars
import importlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import register_flop_formula

from .common import debug_checks, use_triton
from .index_contract import check_candidate_to_request
from .op_schemas import SCHEMAS
from .request_groups import current_call, reentered


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

    ``backward(needs, grad, *args)`` (``needs``: which arguments want a gradient) returns one gradient per argument (None where there is none; a list
    for a list argument); without it the backward differentiates ``differentiable`` (default:
    ``reference``) again from the saved arguments.

    ``portable`` is the plain-torch form that portable programs run (``export/portable.py``)
    where the reference's materialized broadcast would cost more than the op itself (default:
    ``reference``); it equals the reference for every argument the op accepts.
    """

    name: str
    check: Callable[..., tuple[Optional[int], Optional[int]]]
    fake: Callable[..., torch.Tensor]
    cpu: Callable[..., torch.Tensor]
    reference: Callable[..., torch.Tensor]
    flops: Optional[Callable[..., int]] = None
    triton: Optional[str] = None
    index_arg: Optional[int] = None
    dispatch: Callable[..., torch.Tensor] = first_tensor
    backward: Optional[Callable[..., tuple]] = None
    differentiable: Optional[Callable[..., torch.Tensor]] = None
    portable: Optional[Callable[..., torch.Tensor]] = None

    @property
    def schema(self) -> str:
        """The op's schema, defined once for every op in ``op_schemas.SCHEMAS``."""
        return SCHEMAS[self.name]

    @property
    def portable_form(self) -> Callable[..., torch.Tensor]:
        """What a portable program computes in place of the op: ``portable``, else the
        reference."""
        return self.portable or self.reference

    @property
    def overload(self) -> torch._ops.OpOverload:
        return getattr(torch.ops.rocs, self.name).default

    def run(self, *args: Any) -> torch.Tensor:
        """The op without its checks: the Triton launcher on CUDA, the torch path on the CPU."""
        if self.triton is not None and use_triton(self.dispatch(*args)):
            return _launcher(self.triton)(*args)
        return self.cpu(*args)

    def run_with_backward(self, *args: Any) -> torch.Tensor:
        """:meth:`run` recorded by autograd with the op's registered backward, without the
        dispatcher: what a call of the op under grad computes and saves, for callers whose
        arguments are already checked (the training program, ``runtime/training/program.py``)."""
        if not any(isinstance(a, (list, tuple)) for a in args):
            return _DirectAutograd.apply(self, None, *args)
        flat, spec = pytree.tree_flatten(args)
        return _DirectAutograd.apply(self, spec, *flat)

    def checked_run(self, *args: Any) -> torch.Tensor:
        """The op's body: its checks, the index contract (once per call of a compiled graph
        for each index, rows and device), then :meth:`run`."""
        num_candidates, num_requests = self.check(*args)
        if self.index_arg is not None:
            index = args[self.index_arg]
            device = self.dispatch(*args).device
            scope = current_call()
            key = (num_candidates, num_requests, device)
            if scope is None or scope.index is not index or key not in scope.checked:
                check_candidate_to_request(
                    index,
                    num_candidates,
                    num_requests,
                    device=device,
                    where=f"rocs::{self.name}",
                    check_range=not index.is_cuda or debug_checks(),
                )
                if scope is not None and scope.index is index:
                    scope.checked.add(key)
        return self.run(*args)


def _launcher(spec: str) -> Callable[..., torch.Tensor]:
    # Looked up at each call (a dict lookup once imported), so the module attribute is the
    # launcher that runs: tests count launches by wrapping it.
    module, function = spec.split(":")
    return getattr(importlib.import_module(f"rocs_compiler.kernels.{module}"), function)


def define(op: RocsOp) -> RocsOp:
    """``op`` with its FLOP formula registered. ``torch.ops.rocs.<name>`` itself (its schema, body
    ``op.checked_run``, fake kernel and autograd formula) was registered by ``library.register``
    for every op at once, which ``import rocs_compiler`` runs as soon as torch is imported, so
    before any record's module (each imports torch) can run."""
    if op.flops is not None:
        register_flop_formula(getattr(torch.ops.rocs, op.name))(op.flops)
    return op


def save_arguments(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    """Keep the op's arguments for its backward: tensors through ``save_for_backward`` (so an
    in-place write to one before the backward is caught), everything else as it is; and the
    call's scope, so the backward reuses the request groups of the forward. An output the loss
    does not reach gets no zero-filled gradient (``grad is None``): the op's inputs then get
    None too, so a parameter only that output reads keeps ``grad is None``, as in eager."""
    ctx.set_materialize_grads(False)
    ctx.rocs_scope = current_call()
    ctx.rocs_context = contextvars.copy_context()  # what the forward read, for its backward
    if not any(isinstance(v, (list, tuple)) for v in inputs):  # flat arguments: no pytree
        positions = [i for i, v in enumerate(inputs) if isinstance(v, torch.Tensor)]
        ctx.save_for_backward(*[inputs[i] for i in positions])
        ctx.rocs_arguments = ([None if i in positions else v for i, v in enumerate(inputs)],
                              positions, None)  # fmt: skip
        return
    flat, spec = pytree.tree_flatten(inputs)
    positions = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]
    ctx.save_for_backward(*[flat[i] for i in positions])
    ctx.rocs_arguments = (
        [None if isinstance(v, torch.Tensor) else v for v in flat],
        positions,
        spec,
    )


def _saved_arguments(ctx: Any) -> tuple:
    flat, positions, spec = ctx.rocs_arguments
    flat = list(flat)
    for i, tensor in zip(positions, ctx.saved_tensors):
        flat[i] = tensor
    return tuple(flat) if spec is None else pytree.tree_unflatten(flat, spec)


def gradients(op: RocsOp, ctx: Any, needs: tuple, grad: torch.Tensor) -> tuple:
    """One gradient per argument of ``op`` (a list for a list argument), from what
    :func:`save_arguments` kept in ``ctx``."""
    if grad is None:
        return tuple([None] * len(n) if isinstance(n, (list, tuple)) else None for n in needs)
    args = _saved_arguments(ctx)
    # In the forward's context, whenever and on whichever thread autograd runs the backward: a
    # formula reading a context variable (``nested_padding``'s call state) sees the forward's.
    return ctx.rocs_context.copy().run(_gradients, op, ctx, args, needs, grad)


def _gradients(op: RocsOp, ctx: Any, args: tuple, needs: tuple, grad: torch.Tensor) -> tuple:
    with reentered(ctx.rocs_scope):
        if torch.is_grad_enabled():  # a ``create_graph`` backward: its gradients are differentiated
            # SDPA's fused CPU kernels have a first-order backward only; its math form has all.
            with sdpa_kernel(SDPBackend.MATH):
                return vjp(op.differentiable or op.reference, grad, args, needs, create_graph=True)
        if op.backward is not None:
            return tuple(op.backward(needs, grad, *args))
        return vjp(op.differentiable or op.reference, grad, args, needs)


class _DirectAutograd(torch.autograd.Function):
    """``op.run`` as an autograd node whose backward is the op's own (:func:`_gradients`), the
    arguments flattened (``spec``) so that tensors inside a list argument are inputs of the
    node. Identity: the same forward and the same backward formula as the dispatcher's
    autograd kernel of ``torch.ops.rocs.<name>`` registered by :func:`define`."""

    # The forward takes ``ctx`` (no ``setup_context``): autograd.Function's separate-context
    # form costs about 50 us more per call on a CPU.
    @staticmethod
    def forward(ctx: Any, op: RocsOp, spec: Any, *flat: Any) -> torch.Tensor:
        args = _unflattened(flat, spec)
        output = op.run(*args)
        save_arguments(ctx, args, output)
        ctx.rocs_op, ctx.rocs_spec = op, spec
        return output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        spec = ctx.rocs_spec
        needs = _unflattened(ctx.needs_input_grad[2:], spec)
        grads = gradients(ctx.rocs_op, ctx, needs, grad)
        if spec is None:
            return (None, None, *grads)
        flat: list = []
        for value, arg_grad in zip(needs, grads):  # ``needs`` has the arguments' structure
            count = len(pytree.tree_leaves(value))  # 0 for None, which flattens to nothing
            if isinstance(value, (list, tuple)):
                flat += list(arg_grad) if arg_grad is not None else [None] * count
            elif count:
                flat.append(arg_grad)
        return (None, None, *flat)


def _unflattened(flat: Any, spec: Any) -> tuple:
    return tuple(flat) if spec is None else tuple(pytree.tree_unflatten(list(flat), spec))


def vjp(
    fn: Callable[..., torch.Tensor],
    grad: torch.Tensor,
    args: tuple,
    needs: tuple,
    create_graph: bool = False,
) -> tuple:
    """The gradients of ``fn(*args)`` against ``grad``, one per argument (None for those that
    ``needs`` marks False or that are not floating tensors; a list for a list argument).
    ``create_graph``: differentiable in ``args`` and ``grad`` (a double backward), ``args``
    then used as they are rather than detached."""

    def wants(value: Any, needed: bool) -> bool:
        return needed and isinstance(value, torch.Tensor) and value.is_floating_point()

    def leaf(value: torch.Tensor) -> torch.Tensor:
        return value if create_graph and value.requires_grad else value.detach().requires_grad_()

    leaves: list[torch.Tensor] = []
    inputs = []
    for value, needed in zip(args, needs):
        if isinstance(value, (list, tuple)):
            items = [leaf(v) if wants(v, needed) else v for v in value]
            leaves += [v for v in items if isinstance(v, torch.Tensor) and v.requires_grad]
            inputs.append(type(value)(items))
        elif wants(value, needed):
            value = leaf(value)
            leaves.append(value)
            inputs.append(value)
        else:
            inputs.append(value)
    if not leaves:
        return tuple(None for _ in args)
    with torch.enable_grad():
        out = fn(*inputs)
        grads = iter(
            torch.autograd.grad(
                out, leaves, grad, allow_unused=True, materialize_grads=True,
                create_graph=create_graph,
            )  # fmt: skip
        )
    result = []
    for value in inputs:
        if isinstance(value, (list, tuple)):
            result.append(
                [
                    next(grads) if isinstance(v, torch.Tensor) and v.requires_grad else None
                    for v in value
                ]
            )
        elif isinstance(value, torch.Tensor) and value.requires_grad:
            result.append(next(grads))
        else:
            result.append(None)
    return tuple(result)
