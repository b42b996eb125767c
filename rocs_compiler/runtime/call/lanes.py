"""The lanes a call runs in once its checks passed and its program was chosen: the shared program
(``run``), the plain program (``run_plain``), and the original model (``call_original``,
``run_original``, ``run_eager``); with what every lane hands back (constants cloned, backward
refused in grad mode, ``runtime/training/no_backward.py``).

Identity: each lane returns the original model's outputs for the call (the shared program's
rewrite, the plain program's unshared graph and the original itself compute the same values).
"""

from __future__ import annotations

import warnings
from typing import Callable, Optional

import torch
from torch import fx

from .bound import Call
from ...errors import InputError
from ...formats.leaves import is_tensor, replace_leaves
from ...kernels.request_groups import call_groups
from ..follow.moves import refresh_copy
from .train_lane import train, trains
from .program_io import clone_constants, graph_inputs, refuse_backward, refuse_backward_eager
from ..training.program import refuse_replicated_grads


def call_original(cm, args: tuple, kwargs: dict):
    """The original model on the call as made (a moved copy brought up to date first)."""
    if cm._original_is_copy:
        refresh_copy(cm)
    return cm._original(*args, **kwargs)


def run_plain(cm, leaves: dict, call: Optional[Call], given=None):
    """The plain program on replicated inputs (in the shared layout ``call``'s, gathered by its
    index unless ``given`` has them with one row per candidate already; None: drop-in)."""
    if cm._input_specs is not None:
        cm._input_specs.check(leaves)
    names, request = cm._plain.input_names or cm.contract.input_names, cm._request_set
    if call is None:
        return cm.contract.outputs(cm._plain([leaves[n] for n in names]))
    source = leaves
    if given is not None and given is not leaves:
        request = {n for n in request if given[n] is leaves[n]}
        source = given
    if request:
        num_requests = leaves[cm.contract.request_inputs[0]].shape[0]
        source = {**source, **call.gather(source, request, num_requests)}
    return cm.contract.outputs(cm._plain([source[n] for n in names]))


def run(cm, call: Call, leaves, requests, index, uniform: Optional[int] = None):
    """Run the graph on ``call``'s ``leaves`` with the request inputs replaced by ``requests``
    (``requests is leaves`` in the shared layout) and candidates grouped by ``index`` (the
    call's, or the drop-in call's found requests); ``uniform`` is the number of requests when
    they are known to be equal-sized and contiguous (the kernels then group without a pass
    over ``index``)."""
    if cm._input_specs is not None:
        cm._input_specs.check(leaves)
    grad_mode = torch.is_grad_enabled()
    if trains(cm):
        refuse_replicated_grads(leaves, requests)
        return train(cm, call, leaves, requests, index, uniform)
    if not grad_mode and cm.graph_module is not None:
        # The common serving call (no_grad or inference mode): no autograd context to enter.
        with call_groups(index, uniform):
            if cm._cache is None:
                outputs = graph_runner(cm)(*graph_inputs(cm, leaves, requests), index)
            else:  # ``runtime/cache/request_cache.py``
                inputs = graph_inputs(cm, leaves, requests)
                outputs = cm._cache.run(cm, graph_runner(cm), inputs, index)
        if cm._constant_outputs:
            outputs = clone_constants(cm, outputs)
        return cm.contract.outputs(outputs)
    if grad_mode:
        wants_grad = [n for n, v in leaves.items() if is_tensor(v) and v.requires_grad]
        if wants_grad:
            raise InputError(
                f"input(s) {', '.join(wants_grad)} require grad, but a compiled model computes "
                "without autograd (its outputs carry no gradient): call it under "
                "torch.no_grad() or torch.inference_mode(), and train the original model"
            )
    if cm.graph_module is None:
        with torch.no_grad():
            result = run_eager(cm, call, requests, index)
        return refuse_backward_eager(cm, result) if grad_mode else result
    with torch.no_grad(), call_groups(index, uniform):
        inputs = graph_inputs(cm, leaves, requests)
        outputs = clone_constants(cm, graph_runner(cm)(*inputs, index))
    if cm._weights is not None:
        outputs = refuse_backward(cm, outputs)
    return cm.contract.outputs(outputs)


def graph_runner(cm) -> Callable:
    """The graph with its ops called directly: ``index`` was range-checked above."""
    if torch.compiler.is_compiling():
        return cm.graph_module  # tracers (dynamo, export) read the graph's ops themselves
    weights = cm._weights
    epoch = 0
    if weights is not None:
        if not weights.current():
            weights.refresh()
        epoch = weights.epoch
    if cm._runner is None or cm._runner_epoch != epoch:
        from ..program.direct import direct_program

        gm = cm.graph_module
        runner = direct_program(gm) if isinstance(gm, fx.GraphModule) else gm
        object.__setattr__(cm, "_runner", runner)
        object.__setattr__(cm, "_runner_epoch", epoch)
    return cm._runner


def run_original(cm, call: Call, index):
    """The eager fallback of a converting format: the original model on the user's call
    (``index``: its index, None for a replicated call, whose rows the model takes as they are)."""
    warn_fallback(cm)
    grad_mode = torch.is_grad_enabled()
    with torch.no_grad():
        result = cm.input_format.run_original(cm._original, call.args, call.kwargs, index)
    return refuse_backward_eager(cm, result) if grad_mode else result


def warn_fallback(cm) -> None:
    """Once per compiled model: the call runs the original model eagerly, and why."""
    if not cm._warned:
        warnings.warn(
            f"rocs: running the original model eagerly ({cm.fallback_reason})", stacklevel=4
        )
        cm._warned = True


def run_eager(cm, call: Call, requests, index):
    """The original model on the call with its request inputs gathered to the candidates (a
    model that could not be captured)."""
    warn_fallback(cm)
    gathered = {n: requests[n].index_select(0, index) for n in cm.contract.request_inputs}
    call_args, call_kwargs = replace_leaves(cm.contract.signature, call.args, call.kwargs, gathered)
    return cm._original(*call_args, **call_kwargs)
