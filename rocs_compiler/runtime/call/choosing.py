"""The choice of lane for a call: the shared or the plain program per call bucket (its layout,
sizes and length class, ``lengths.py``), measured or settled by the FLOP prior at the call's
lengths (``runtime/choice/program_choice.py`` holds the decisions; this module asks them).

Identity: both programs return the original's outputs, so a bucket may run either; only speed
differs, and the choice keeps the faster one.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .bound import Call
from .checks import batch_rows, check_index, check_shared
from .grouping import group
from .lanes import run, run_plain
from .prior import flops, margin
from ..choice.program_choice import (
    CLEAR_GAIN,
    CLEAR_SAVING,
    DROPIN_MARGIN,
    PLAIN,
    SHARED,
    bucket,
    call_clock,
)


def runs_as_given(cm, call: Call, given: dict, replicated: frozenset) -> bool:
    """True when a shared-layout call whose request inputs all come with one row per
    candidate (a packed input's request columns) falls in a bucket that runs the plain
    program: the program then takes the packed input as the original model does, and its
    answer is the original's on that input, so its request columns are not reduced nor
    checked constant per request (what the shared program needs)."""
    if any(n not in replicated for n in cm.contract.request_inputs):
        return False
    check_index(cm, call, given)
    num_candidates = call.index.shape[0]
    num_requests = call.requests_reached(num_candidates)
    lengths = () if cm._lengths is None else cm._lengths.of(given)
    return cm._choice.decided(bucket("shared", num_candidates, num_requests, lengths)) == PLAIN


def shared_choosing(cm, call: Call, leaves: dict, given: dict, reducing: float = 0.0):
    """A shared-layout call running the shared or the plain program, whichever its bucket
    chose (``runtime/choice/program_choice.py``); every check of the shared layout runs first.
    ``given`` are the leaves as called: request leaves that came with one row per candidate
    (checked constant per request into ``leaves``, ``reducing`` seconds that only the shared
    program needs) are the plain program's as they are."""
    choice, contract, index = cm._choice, cm.contract, call.index
    first = contract.request_inputs[0] if contract.request_inputs else None
    rows = leaves[first].shape[0] if first is not None and leaves[first].dim() else 0
    num_candidates = index.shape[0] if isinstance(index, torch.Tensor) and index.dim() else 0
    lengths = () if cm._lengths is None else cm._lengths.of(leaves)
    key = bucket("shared", num_candidates, rows, lengths)
    program = choice.decided(key)
    if program == PLAIN:  # a decided bucket is called directly: no closures per call
        return shared_plain(cm, call, leaves, given)
    if program == SHARED:
        return run(cm, call, leaves, *check_shared(cm, call, leaves))
    return choice.run(
        key,
        lambda: run(cm, call, leaves, *check_shared(cm, call, leaves)),
        lambda: shared_plain(cm, call, leaves, given),
        lambda: settle_if_clear(cm, key, num_candidates, rows, leaves),
        shared_extra=reducing,
        margin=margin(cm, num_candidates, rows, lengths=lengths, leaves=leaves),
        clock=trial_clock(index),
    )


def shared_plain(cm, call: Call, leaves: dict, given: dict):
    """A shared-layout call run by the plain program, after the layout's checks."""
    # The plain program's gathers of request rows check the index's range (``Call.gather``).
    check_shared(cm, call, leaves, check_range=not cm.contract.request_inputs)
    return run_plain(cm, leaves, call, given)


def dropin_choosing(cm, call: Call, leaves: dict):
    """A drop-in call under the program choice: the requests are found first (their number
    is part of the bucket) unless every bucket of this row class (row count and length class)
    chose the plain program."""
    choice = cm._choice
    rows = batch_rows(cm, leaves, cm.contract.batched_inputs)
    lengths = () if cm._lengths is None else cm._lengths.of(leaves)
    row_class = ("dropin", rows.bit_length()) + lengths  # ``program_choice.row_class``
    if choice.everywhere(row_class) == PLAIN:
        return settled_dropin_plain(cm, ("dropin", row_class[1], 0) + lengths, leaves)
    clock = trial_clock(leaves[cm.contract.batched_inputs[0]])
    start = clock()
    requests, index, uniform = group(cm, leaves)
    finding = clock() - start
    num_requests = next(iter(requests.values())).shape[0] if requests else rows
    key = bucket("dropin", rows, num_requests, lengths)
    program = choice.decided(key)
    if program is not None:
        return run_plain(cm, leaves, None) if program == PLAIN else run(
            cm, call, leaves, requests, index, uniform
        )
    # Finding requests is the shared program's cost only while no bucket of the row class
    # shares; after that every call pays it (``runtime/choice/program_choice.py``).
    alone = not choice.shares_in(row_class)
    return choice.run(
        key,
        lambda: run(cm, call, leaves, requests, index, uniform),
        lambda: run_plain(cm, leaves, None),
        lambda: settle_if_clear(cm, key, rows, num_requests, leaves),
        shared_extra=finding if alone else 0.0,
        margin=margin(cm, rows, num_requests, DROPIN_MARGIN if alone else 0.0, lengths, leaves),
        clock=clock,
    )


def settled_dropin_plain(cm, key: tuple, leaves: dict):
    """A drop-in call of a row class settled on the plain program: the plain program, its
    bucket noted for the measurement against the original model (``runtime/call/original_arm.py``,
    which runs a kept original before the guards); a converted call (``formats/``) is in the
    program's terms, not the original's."""
    arm = cm._originals
    if (
        arm is not None
        and key not in arm.kept
        and not cm.input_format.converts
        and cm.contract.places_rows
    ):
        arm.note(key)
    return run_plain(cm, leaves, None)


def trial_clock(tensor: Any = None) -> Callable[[], float]:
    """The clock an inference trial is timed by (``program_choice.call_clock``): the thread's
    CPU time for a call whose ``tensor`` (an input) is on the CPU, with one torch thread;
    else, or without a tensor, wall time."""
    return call_clock(isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu")


def settle_if_clear(
    cm, key: tuple, rows: int, num_requests: int, leaves: Optional[dict] = None
) -> Optional[str]:
    """``SHARED`` (and the bucket settled) when, for ``rows`` candidates of ``num_requests``
    requests at the lengths of the call named ``leaves``, the cost model's FLOP ideal reaches
    ``CLEAR_GAIN`` and the saving ``CLEAR_SAVING``; else None (measure). Inference calls only
    (``train`` measures every bucket)."""
    shared, plain = flops(cm, rows, num_requests, key[3:], leaves)  # at its length class
    if shared <= 0 or plain < CLEAR_GAIN * shared or plain - shared < CLEAR_SAVING:
        return None
    cm._choice.settle(key, SHARED)
    return SHARED
