"""A shared-layout call whose bucket settled on the plain program, checked and run in one pass.

Once a call bucket (``runtime/choice/program_choice.py``) has chosen the plain program, a shared-layout
call is its checks, the gather of the request rows to the candidates, and the plain program: the
general path spreads the checks over several layers (the call bucket, the index contract, the
row counts, the input specs), which costs more than the gather on a small model.
:func:`run_settled_plain` makes them in one pass and returns :data:`NOT_TAKEN` for any call it
does not recognize as such (a bucket still measuring or sharing, an index or input that fails a
check, one row per candidate grouped into fewer requests): the general path then runs that
call, and raises its errors.
:func:`run_settled_original` does the same for a training call whose bucket chose the original
model (``runtime/training/program.py``, "Program choice"): the same checks and gather, then the original
model called with the gathered request rows.
:func:`run_settled_as_called` takes a call through a converting input format whose plain program
takes the call's own tensors (a packed input of column ranges whole, ``formats/packed_plain.py``):
in a bucket settled on the plain program it runs them as called, without converting the call.

Identity: a call it takes returns what the general path returns on it (``CompiledModel.
_shared_plain``, or ``train``'s original model): the same program on the same gathered inputs,
after checks that accept no call the general path refuses (index int64 ``[N]`` on the inputs'
device, N rows in every candidate input, R rows in every request input, the input specs, the
range of ``index``: by the gather, ``Call.gather``; with one request row per candidate, an index that is a permutation).
:func:`run_settled_as_called` returns what ``runs_as_given`` and ``dropin_choosing`` return
on such a call, the plain program on the call's tensors, after the checks they make: the
program's input specs (of the packed tensor whole: its dtype, device and columns are its
pieces'), one row count, and in the shared layout the index's type, length, device and range.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .bound import Call
from ...formats.leaves import replace_leaves
from ...kernels.index_contract import distinct_values
from .original_arm import ORIGINAL, PROGRAM
from ..choice.program_choice import PLAIN, ProgramChoice

NOT_TAKEN = object()


def run_settled_plain(model: Any, call: Call, leaves: dict) -> Any:
    """``model``'s plain program on the shared-layout ``call`` (named ``leaves``), or
    :data:`NOT_TAKEN`. ``model`` is a ``CompiledModel`` whose call runs under its program choice
    and takes its tensors as they are (no converting input format)."""
    key, gathered = _settled_gather(model, model._choice, "shared", leaves, call)
    if gathered is NOT_TAKEN:
        return NOT_TAKEN
    contract, plain = model.contract, model._plain
    names = plain.input_names or contract.input_names
    inputs = [gathered[n] if n in gathered else leaves[n] for n in names]
    arm = model._originals
    # Only a call as made (no converting format) is measured against the original model.
    if arm is not None and key not in arm.kept and not model.input_format.converts:
        arm.note(key)
    return contract.outputs(plain(inputs))


def run_as_original(model: Any, call: Call) -> Any:
    """The next trial of the ``call``'s bucket (its ``index`` None: drop-in) when
    it settled on the plain program and is being measured against the original model
    (``original_arm.py``), else :data:`NOT_TAKEN`. Each arm is timed as its calls will run once
    kept: the plain program's as the whole checked call (guards included), the original's as
    :func:`run_kept_original` or the drop-in lane of ``CompiledModel.forward`` (the row count of
    the first batched input, then the original on the call as made). ``model`` takes its tensors
    as they are."""
    contract, choice, arm = model.contract, model._choice, model._originals
    args, kwargs, index = call.args, call.kwargs, call.index
    if index is None:
        rows = contract.first_rows(args, kwargs)
        if rows is None:
            return NOT_TAKEN  # placed by the general path, which runs the plain program
        lengths = model._lengths
        length_class = () if lengths is None else lengths.of_call(contract, args, kwargs)
        row_class = ("dropin", rows.bit_length()) + length_class
        key = ("dropin", row_class[1], 0) + length_class
        if not arm.measuring(key) or choice.everywhere(row_class) != PLAIN:
            return NOT_TAKEN

        def original():
            contract.first_rows(args, kwargs)
            if lengths is not None:
                lengths.of_call(contract, args, kwargs)
            return model._call_original(args, kwargs)
    else:
        if type(index) is not torch.Tensor:
            return NOT_TAKEN
        leaves = contract.leaves(args, kwargs)
        key, gathered = _settled_gather(model, choice, "shared", leaves, call, arm.measuring)
        if gathered is NOT_TAKEN:
            return NOT_TAKEN
        if index.is_cuda:  # no kept lane: a CUDA gather does not check the index's range
            arm.settle(key, PROGRAM)
            return NOT_TAKEN

        def original():
            return run_kept_original(model, call, measured=True)

    weight = next(model._original.parameters(), None)  # a trial: the call's clock by device
    on_cpu = weight is None or weight.device.type == "cpu"
    return arm.run(key, lambda: model._checked_call(call), original, on_cpu)


def run_kept_original(model: Any, call: Call, measured: bool = False) -> Any:
    """The original model on a shared-layout ``call`` of a bucket
    that kept it (``original_arm.py``), its request rows gathered to the candidates, or
    :data:`NOT_TAKEN`. The replicated call is what the original model answers, whatever the
    candidate inputs' rows (it meets or refuses them itself); the index is checked as the
    general path checks it: int64 ``[N]``, in range (by the gather), and with one request row per
    candidate, a permutation. ``measured``: a trial of the bucket, which has not kept it yet."""
    contract, index = model.contract, call.index
    leaves = contract.leaves(call.args, call.kwargs)
    first = leaves[contract.request_inputs[0]]
    if type(index) is not torch.Tensor or index.dtype != torch.int64 or index.dim() != 1:
        return NOT_TAKEN
    if not first.dim() or first.is_cuda:  # a CUDA gather does not check the index's range
        return NOT_TAKEN
    num_candidates, num_requests = index.shape[0], first.shape[0]
    key = ("shared", num_candidates.bit_length(), num_requests.bit_length())
    if model._lengths is not None:
        key += model._lengths.of(leaves)
    if not measured and key not in model._originals.shared_originals:
        return NOT_TAKEN
    if num_requests == num_candidates > 1 and distinct_values(index) != num_candidates:
        return NOT_TAKEN  # one row per candidate, grouped: the general path refuses it
    try:
        rows = {n: leaves[n].index_select(0, index) for n in model._request_set}
    except (IndexError, RuntimeError):
        return NOT_TAKEN  # the general path names the index or the rows
    if model._original_is_copy:
        model._refresh_copy()
    kwargs = call.kwargs
    if not call.args and rows.keys() <= kwargs.keys():  # ``call_with_rows``'s keyword case,
        return model._original(**{**kwargs, **rows})  # inlined: a kept call makes no call for it
    return call_with_rows(model, call, rows)


def run_settled_original(model: Any, call: Call, leaves: dict) -> Any:
    """The original model on the shared-layout training ``call`` (named ``leaves``) whose
    bucket chose it, or :data:`NOT_TAKEN`. ``model`` is a ``CompiledModel`` in a training call
    under its training choice (no converting format)."""
    _, gathered = _settled_gather(model, model._training.choice, "train-shared", leaves, call)
    if gathered is NOT_TAKEN:
        return NOT_TAKEN
    return call_with_rows(model, call, gathered)


def run_settled_as_called(model: Any, call: Call) -> Any:
    """``model``'s plain program on the ``call`` (its ``index`` None: drop-in) as called, or
    :data:`NOT_TAKEN`. ``model`` is a ``CompiledModel`` whose call runs under its
    program choice through an input format that names the call's tensors
    (``InputFormat.called_leaves``) as its plain program takes them."""
    plain, args, kwargs, index = model._plain, call.args, call.kwargs, call.index
    leaves = model.input_format.called_leaves(args, kwargs)
    if leaves is None or leaves.keys() != plain.name_set:
        return NOT_TAKEN
    batched = plain.batched_names
    first = leaves[batched[0]]
    if not first.dim():
        return NOT_TAKEN
    rows = first.shape[0]
    if len(batched) > 1 and any(
        not v.dim() or v.shape[0] != rows for v in map(leaves.get, batched)
    ):
        return NOT_TAKEN  # the general path names the disagreeing rows
    lengths = () if model._lengths is None else model._lengths.of(leaves)
    if index is None:
        key = ("dropin", rows.bit_length(), 0) + lengths
        if model._choice.everywhere(key[:2] + lengths) != PLAIN:
            return NOT_TAKEN
    else:
        if (
            type(index) is not torch.Tensor
            or index.dtype != torch.int64
            or index.shape != (rows,)
            or index.device != first.device
            or model.input_format.request_names  # request inputs with R rows: gathered, checked
        ):
            return NOT_TAKEN
        num_requests = call.requests_reached(rows)
        key = ("shared", rows.bit_length(), num_requests.bit_length()) + lengths
        if model._choice.decided(key) != PLAIN:
            return NOT_TAKEN
    arm = model._originals
    kept = PROGRAM if arm is None else arm.kept.get(key)
    if kept == PROGRAM:  # a decided bucket: no closures per call
        return _plain_as_called(model, leaves)
    if kept == ORIGINAL:
        return model._call_original(args, kwargs)  # the call as made: no guards needed
    arm.note(key)
    return arm.run(key, lambda: _plain_as_called(model, leaves),
                   lambda: model._call_original(args, kwargs), first.device.type == "cpu")


def _plain_as_called(model: Any, leaves: dict) -> Any:
    """``model``'s plain program on the call's own tensors ``leaves``, past the guards and the
    program's input specs."""
    plain, training = model._plain, model._training
    # ``path.check_model``, inlined: a settled call makes no call for it.
    if training is None or not (torch.is_grad_enabled() or training.writes_buffers):
        model._guards.check()
    elif model._ddp is not None:
        model._ddp.check()
    plain.input_specs.check(leaves)
    return model.contract.outputs(plain(list(map(leaves.get, plain.input_names))))


def call_with_rows(model: Any, call: Call, gathered: dict) -> Any:
    """``model``'s original model on its ``call`` with the request leaves replaced by
    ``gathered`` (one row per candidate)."""
    args, kwargs = call.args, call.kwargs
    if not args and gathered.keys() <= kwargs.keys():  # keyword tensors: no tree walk
        return model._original(**{**kwargs, **gathered})
    call_args, call_kwargs = replace_leaves(model.contract.signature, args, kwargs, gathered)
    return model._original(*call_args, **call_kwargs)


def _settled_gather(
    model: Any,
    choice: ProgramChoice,
    layout: str,
    leaves: dict,
    call: Call,
    original: Callable[[tuple], bool] | None = None,
) -> tuple[tuple | None, Any]:
    """(bucket, the request leaves gathered to one row per candidate by name) when ``call``
    (named ``leaves``) is a valid shared-layout call whose ``layout`` bucket ``choice`` settled on the
    plain program (and, given ``original``, one for which it says True: the original model
    runs, which needs no input specs); else ``(None, NOT_TAKEN)``."""
    contract, index = model.contract, call.index
    request_inputs = contract.request_inputs
    if not request_inputs or type(index) is not torch.Tensor:
        return None, NOT_TAKEN
    first = leaves[request_inputs[0]]
    if index.dtype != torch.int64 or index.dim() != 1 or not first.dim():
        return None, NOT_TAKEN
    num_candidates, num_requests = index.shape[0], first.shape[0]
    if num_requests == num_candidates > 1 and distinct_values(index) != num_candidates:
        return None, NOT_TAKEN  # one row per candidate, grouped: the general path refuses it
    key = (layout, num_candidates.bit_length(), num_requests.bit_length())
    if model._lengths is not None:
        key += model._lengths.of(leaves)
    if choice.decided(key) != PLAIN or (original is not None and not original(key)):
        return None, NOT_TAKEN
    candidate_inputs = contract.candidate_inputs
    for names, rows in ((request_inputs, num_requests), (candidate_inputs, num_candidates)):
        for name in names:
            value = leaves[name]
            if not value.dim() or value.shape[0] != rows:
                return None, NOT_TAKEN
    if index.device != (leaves[candidate_inputs[0]] if candidate_inputs else first).device:
        return None, NOT_TAKEN
    if model._input_specs is not None and original is None:
        model._input_specs.check(leaves)
    return key, call.gather(leaves, model._request_set, num_requests)
