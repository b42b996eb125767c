"""The training lane: a call in grad mode runs the training program (``runtime/training/``), or
the original model where its bucket chose it.

Identity: the training program's outputs and gradients are the original model's on the call.
"""

from __future__ import annotations

from ...kernels.request_groups import call_groups
from ..training.distributed import sharded_by_fsdp, unshard_fsdp
from .checks import batch_rows
from .program_io import clone_constants, graph_inputs
from .prior import margin
from ..choice.program_choice import PLAIN, bucket, call_clock
from .settled_plain import call_with_rows

import torch


def trains(cm) -> bool:
    """True when this call is a training call (``run``): the training program or, where its
    bucket chose it, the original model itself, which needs no guards."""
    training = cm._training
    return training is not None and (torch.is_grad_enabled() or training.writes_buffers)


def chooses_training(cm) -> bool:
    """True when a training call (``trains``) runs the program its bucket chose (``train``):
    a training compile with the choice on, no converting input format, not being traced, not
    sharded by FSDP2 (whose ranks must run the same collectives: ``sharded_by_fsdp``)."""
    training = cm._training
    return (
        training is not None
        and training.choice is not None
        and not cm.input_format.converts
        and not torch.compiler.is_compiling()
        and not sharded_by_fsdp(cm)
    )


def trains_as_original(cm, leaves: dict) -> bool:
    """True for a drop-in training call whose row class's buckets all chose the original
    model (``train``): it is called as made, without finding the requests first, which
    only the training program needs (a call whose request inputs require grad goes on to be
    refused by the program's path, whichever bucket it falls in)."""
    if not trains(cm) or not chooses_training(cm):
        return False
    rows = batch_rows(cm, leaves, cm.contract.batched_inputs)
    lengths = () if cm._lengths is None else cm._lengths.of(leaves)
    if cm._training.choice.everywhere(("train-dropin", rows.bit_length()) + lengths) != PLAIN:
        return False
    return not any(leaves[n].requires_grad for n in cm.contract.request_inputs)


def train(cm, call, leaves, requests, index, uniform):
    """A training call: the training program, or the original model when this call's
    bucket chose it (``runtime/training/program.py``, "Program choice")."""
    training = cm._training

    def program():
        if unshard_fsdp(cm):  # ``runtime/training/distributed.py``
            training.look_up_again()
        cm._guards.check()
        with call_groups(index, uniform):
            outputs = training(graph_inputs(cm, leaves, requests), index)
        return cm.contract.outputs(clone_constants(cm, outputs))

    choice = training.choice
    if not chooses_training(cm):
        return program()
    shared = requests is leaves
    first = cm.contract.request_inputs[0] if cm.contract.request_inputs else None
    num_requests = requests[first].shape[0] if first is not None else index.shape[0]
    lengths = () if cm._lengths is None else cm._lengths.of(leaves)
    layout = "train-shared" if shared else "train-dropin"
    key = bucket(layout, index.shape[0], num_requests, lengths)

    def original():
        if not shared:  # drop-in and replicated calls: the original call as made
            return cm._original(*call.args, **call.kwargs)
        gathered = {n: leaves[n].index_select(0, index) for n in cm.contract.request_inputs}
        return call_with_rows(cm, call, gathered)

    decided = choice.decided(key)
    if decided is not None:
        return original() if decided == PLAIN else program()
    # Each trial is timed to the end of its backward (``runtime/training/step_timing.py``). No bucket
    # is settled by its FLOPs alone: a training program's fixed costs per op (the autograd
    # nodes of its fused ops, their backward's per-request sums) are not in the count, and
    # a step of a few hundred rows can share half its FLOPs and no time.
    return training.trials.run(
        key,
        program,
        original,
        lambda: None,
        margin=margin(cm, index.shape[0], num_requests, lengths=lengths, leaves=leaves),
        clock=call_clock(index.device.type == "cpu"),
    )
