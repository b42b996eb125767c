"""The call path of a compiled model, in order: the call is bound once into one value
(``bound.py::Call``, which every later step takes), the input format turns it into a program call
(``formats/``), the contract names its leaves (``contract.py``) and the checks validate them
(``checks.py``; the index's range once, ``Call.requests_reached``), the choice picks a lane
(``choosing.py``; kept originals and settled buckets in ``original_arm.py`` and
``settled_plain.py``), and the lane runs (``lanes.py``, ``train_lane.py``).

Every function takes the compiled model whose state it reads (``runtime/compiled_model.py``);
per-call state lives in the call's own :class:`Call`, so concurrent calls stay safe.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ...formats.base import REPLICATED, ProgramCall
from ...formats.leaves import replace_leaves
from ...kernels.nested_padding import decided_for, fast_path_state
from ...kernels.index_contract import index_trusted
from ..follow.moves import refresh_copy
from .bound import Call
from ...errors import InputError, SizeChange
from .checks import check_replicated, check_shared, reduce_leaves
from .choosing import dropin_choosing, runs_as_given, shared_choosing, trial_clock
from .grouping import group
from .jagged import NOT_SPLIT
from .choosing import settle_if_clear
from .prior import margin
from .lanes import run, run_original, run_plain
from ..choice.program_choice import PLAIN, bucket
from .settled_plain import (
    NOT_TAKEN,
    run_as_original,
    run_kept_original,
    run_settled_as_called,
    run_settled_original,
    run_settled_plain,
)
from .train_lane import chooses_training, trains, trains_as_original


def forward(cm, *args, candidate_to_request: Optional[torch.Tensor] = None, **kwargs):
    """``CompiledModel.forward`` itself (the face binds it as its method); a call at sizes the
    model was not compiled for runs again once it is (``runtime/modes/new_sizes.py``)."""
    try:
        return _forward(cm, *args, candidate_to_request=candidate_to_request, **kwargs)
    except SizeChange as change:
        _compile_for(cm, change)
    return _forward(cm, *args, candidate_to_request=candidate_to_request, **kwargs)


def _compile_for(cm, change: SizeChange) -> None:
    """``cm`` compiled for the sizes of ``change`` too, or the refusal."""
    if cm._growth is None:
        raise InputError(
            f"{change}; only the number of rows may change between calls of this compiled "
            "model (a compiled model moved to another dtype takes the sizes it had then): "
            "mark the size dynamic, torch._dynamo.mark_dynamic(example[name], dim), before "
            "rocs.compile"
        ) from None
    cm._growth.grow(cm, change)


def _forward(cm, *args, candidate_to_request: Optional[torch.Tensor] = None, **kwargs):
    eval_mode = cm._eval_mode
    if eval_mode is not None and eval_mode.applies():  # a training compile in eval mode
        return eval_mode.call(cm, args, kwargs, candidate_to_request)
    autocast = cm._autocast
    if autocast is not None and autocast.active():  # ``runtime/modes/autocast.py``
        return autocast.call("forward", args, kwargs, candidate_to_request)
    nesting = cm._nesting  # ``runtime/follow/nesting.py``: None unless an encoder of it nests
    if nesting is not None and not decided_for(nesting):
        with fast_path_state(nesting):  # eager's decision for this call's grad and autocast state
            return _forward(cm, *args, candidate_to_request=candidate_to_request, **kwargs)
    jagged = cm._jagged  # ``jagged.py``: None unless the model's histories may be cut
    if jagged is not None and jagged.applies():
        result = jagged.run(cm, args, kwargs, candidate_to_request)
        if result is not NOT_SPLIT:  # groups of requests cut to their lengths, or padded nested
            return result
    originals = cm._originals
    # Buckets that kept the original model (``runtime/call/original_arm.py``), before the
    # guards: a drop-in row class, or a shared-layout bucket of a call as made.
    kept = (
        originals is not None
        and originals.active
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
    )
    if kept and candidate_to_request is None:
        rows = cm.contract.first_rows(args, kwargs)
        if rows is not None:
            row_class = rows.bit_length()  # ``OriginalArm.dropin_originals``
            lengths = cm._lengths
            if lengths is not None and originals.dropin_originals:
                row_class = (row_class, *lengths.of_call(cm.contract, args, kwargs))
            if row_class in originals.dropin_originals:
                return cm._call_original(args, kwargs)  # the call as made: no call value needed
    call = Call(args, kwargs, candidate_to_request)  # the call, bound once (``bound.py``)
    if kept and call.index is not None and originals.shared_originals:
        if not cm.input_format.converts:
            result = run_kept_original(cm, call)
            if result is not NOT_TAKEN:
                return result
    if cm.input_format.converts:
        return forward_format(cm, call, replicated=False)
    if originals is not None and originals.measuring_any() and is_choosing(cm):
        result = run_as_original(cm, call)
        if result is not NOT_TAKEN:  # a trial: the plain program or the original model
            return result
    training = cm._training  # ``check_model``, inlined: a served call makes no call for it
    if training is None or not (torch.is_grad_enabled() or training.writes_buffers):
        cm._guards.check()
    elif cm._ddp is not None:
        cm._ddp.check()
    return forward_leaves(cm, call, is_choosing(cm))


def check_model(cm) -> None:
    """Before a call that runs a compiled program: the original model is still the one
    compiled (``runtime/follow/guards.py``) and not wrapped by DDP since."""
    training = cm._training  # ``train_lane.trains``, inlined: a served call makes no call for it
    if training is None or not (torch.is_grad_enabled() or training.writes_buffers):
        cm._guards.check()  # a training call checks them where its program runs (``train``)
    elif cm._ddp is not None:
        cm._ddp.check()  # not past a DDP around the original (``training/distributed.py``)


def is_choosing(cm) -> bool:
    """True when this call runs under the program choice (outside autograd and tracing)."""
    return (
        cm._choice is not None
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
    )


def forward_format(cm, call: Call, replicated: bool):
    """A call through a converting input format (``formats/``): the original model, when the
    format offers it and this call's bucket chose it, else the program on the converted
    call."""
    input_format = cm.input_format
    args, kwargs, index = call.args, call.kwargs, call.index
    choosing = (  # ``is_choosing``, inlined: a plain program, so a compiled graph
        cm._choice is not None
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
    )
    offers = choosing and not replicated and input_format.offers_original
    # The original model's buckets have no length class: a converting format's lengths (a KJT
    # key's padded width) are known only once the call is converted, which they skip.
    if offers and index is None:
        sizes = input_format.original_sizes(args, kwargs)
        if sizes is not None and cm._choice.decided(
            bucket(f"{sizes[0]}-original", sizes[1], sizes[2])
        ) == PLAIN:
            return cm._call_original(args, kwargs)  # the call as made: no guards needed
    original = None
    if offers and cm.graph_module is not None:
        original = input_format.original_program(cm._original, args, kwargs, index)
        if original is not None:
            if original.index is not None and not index_trusted():  # the model's own index
                Call(args, kwargs, original.index).requests_reached(original.requests)
            key = bucket(f"{original.layout}-original", original.rows, original.requests)
            if cm._choice.decided(key) == PLAIN:  # the original model: no guards needed
                refresh_copy(cm)
                return original.run()
    if choosing and not replicated:
        # A bucket settled on the plain program, as called: the original model or, after
        # the guards, the plain program on the call's tensors.
        result = run_settled_as_called(cm, call)
        if result is not NOT_TAKEN:
            return result
    if not replicated:  # ``call_replicated`` checked them
        check_model(cm)
    if cm.graph_module is None:
        return run_original(cm, call, None if replicated else index)
    if original is not None:
        refresh_copy(cm)
        return cm._choice.run(
            key,
            lambda: program_call(
                cm, input_format.program_call(args, kwargs, index, False), False, call
            ),
            original.run,
            clock=trial_clock(original.index),
        )
    converted = input_format.program_call(args, kwargs, index, replicated)
    return program_call(cm, converted, choosing, call)


def program_call(cm, converted: ProgramCall, choosing: bool, called: Call):
    """A format's program call (``formats/base.py::ProgramCall``) of the ``called`` call, on the
    path of its layout; the range found for the index holds when the format kept it."""
    jagged = cm._jagged
    if jagged is not None and converted.layout != REPLICATED and jagged.cuts(cm):
        result = _cut_converted(cm, jagged, converted, choosing, called)
        if result is not NOT_SPLIT:
            return result
    call = Call(converted.args, converted.kwargs, converted.index)
    if converted.index is called.index:
        call.reached = called.reached
    if converted.layout == REPLICATED:
        return call_replicated_leaves(cm, call, choosing, converted.given)
    return forward_leaves(cm, call, choosing, converted.replicated, converted.given)


def _cut_converted(cm, jagged, converted: ProgramCall, choosing: bool, called: Call):
    """A converted call (a KeyedJaggedTensor's keys as padded rows) run as groups of requests
    cut to their lengths (``jagged.py``), or :data:`NOT_SPLIT`."""
    leaves = cm.contract.leaves(converted.args, converted.kwargs)
    signature = cm.contract.signature

    def call(inputs: dict, index):
        args, kwargs = replace_leaves(signature, converted.args, converted.kwargs, inputs)
        group = dataclasses.replace(converted, args=args, kwargs=kwargs, index=index, given={})
        return program_call(cm, group, choosing, Call(args, kwargs, index))

    return jagged.run_converted(cm, leaves, converted.index, call)


def forward_leaves(cm, call: Call, choosing: bool, replicated=frozenset(), as_called=None):
    """A call named by its leaves: a settled bucket's one pass, a packed input's request
    columns reduced, then the choice (``choosing``) or, outside it, the checks and a lane."""
    index = call.index
    leaves = given = cm.contract.leaves(call.args, call.kwargs)
    if as_called:  # the call's own tensors the plain program takes (``ProgramCall.given``)
        leaves = given = {**leaves, **as_called}
    if index is not None and not replicated:  # a bucket settled on the plain program
        if choosing:
            result = run_settled_plain(cm, call, leaves)
        elif trains(cm) and chooses_training(cm):
            result = run_settled_original(cm, call, leaves)
        else:
            result = NOT_TAKEN
        if result is not NOT_TAKEN:
            return result
    reducing = 0.0  # time spent reducing replicated request leaves: the shared program's
    if replicated and index is not None:
        if choosing and runs_as_given(cm, call, given, replicated):
            return run_plain(cm, given, None)
        clock = trial_clock(index)
        start = clock()
        leaves = reduce_leaves(cm, call, leaves, replicated)
        reducing = clock() - start
    if choosing:
        if index is None:
            return dropin_choosing(cm, call, leaves)
        return shared_choosing(cm, call, leaves, given, reducing)
    uniform = None
    if index is None:
        if not replicated and trains_as_original(cm, leaves):
            return cm._original(*call.args, **call.kwargs)
        requests, index, uniform = group(cm, leaves)
    else:
        requests, index = check_shared(cm, call, leaves)
    return run(cm, call, leaves, requests, index, uniform)


def checked_call(cm, call: Call):
    """The call past the guards: what ``forward`` runs when no kept original takes it."""
    check_model(cm)
    return forward_leaves(cm, call, True)


def call_replicated(cm, *args, candidate_to_request: torch.Tensor, **kwargs):
    """The original call (request inputs replicated, one row per candidate) with the
    grouping given: ``candidate_to_request[n]`` is candidate n's request. Raises
    :class:`InputError` when a request input varies within a request. (``CompiledModel``'s
    method itself; at new sizes as ``forward``.)"""
    try:
        return _call_replicated(cm, *args, candidate_to_request=candidate_to_request, **kwargs)
    except SizeChange as change:
        _compile_for(cm, change)
    return _call_replicated(cm, *args, candidate_to_request=candidate_to_request, **kwargs)


def _call_replicated(cm, *args, candidate_to_request: torch.Tensor, **kwargs):
    eval_mode = cm._eval_mode
    if eval_mode is not None and eval_mode.applies():
        return eval_mode.call_replicated(cm, args, kwargs, candidate_to_request)
    autocast = cm._autocast
    if autocast is not None and autocast.active():
        return autocast.call("call_replicated", args, kwargs, candidate_to_request)
    nesting = cm._nesting
    if nesting is not None and not decided_for(nesting):
        with fast_path_state(nesting):
            return _call_replicated(cm, *args, candidate_to_request=candidate_to_request, **kwargs)
    cm._guards.check()
    call = Call(args, kwargs, candidate_to_request)
    if cm.input_format.converts:
        return forward_format(cm, call, replicated=True)
    return call_replicated_leaves(cm, call, is_choosing(cm))


def call_replicated_leaves(cm, call: Call, choosing: bool, as_called=None):
    """``call_replicated`` on named leaves: the grouping checked, then the chosen lane."""
    leaves = cm.contract.leaves(call.args, call.kwargs)
    if as_called:
        leaves = {**leaves, **as_called}
    requests, index = check_replicated(cm, call, leaves)
    choice = cm._choice
    if not choosing:
        return run(cm, call, leaves, requests, index)
    first = next(iter(requests.values()), None)
    num_requests = first.shape[0] if first is not None else 0
    lengths = () if cm._lengths is None else cm._lengths.of(leaves)
    key = bucket("replicated", index.shape[0], num_requests, lengths)
    return choice.run(
        key,
        lambda: run(cm, call, leaves, requests, index),
        lambda: run_plain(cm, leaves, None),  # the replicated rows, as the model takes them
        lambda: settle_if_clear(cm, key, index.shape[0], num_requests, leaves),
        margin=margin(cm, index.shape[0], num_requests, lengths=lengths, leaves=leaves),
        clock=trial_clock(index),
    )
