"""A shared-layout call of one dynamo graph's variant with the runtime's per-call steps done once:
:class:`SettledShared`.

Inside ``shared_call`` the door has checked the index (an int64 ``[N]`` tensor whose values lie in
``[0, R)``, R the rows every request input shares), and the :class:`~.subgraph.Subgraph` has
matched the variant on each input's dtype, device and sizes past the batch, and its module state
on identity and version. Of what the compiled model's call path would still do for the call (bind
it, name its leaves, check rows and index again, pick a lane, enter the groups' scope, run the
graph, clone constant outputs), a variant whose shared program always runs (no program choice,
request cache, jagged cuts, nested fast path, converting format or training mode) depends on the
call only in the candidate inputs' rows, the graph and its constant outputs: this does those, and
hands every other call (grad or autocast on, candidate rows that differ from N, one request per
candidate) back to the call path.

Identity: the runtime's shared lane computes ``contract.outputs(graph(*inputs, index))`` with the
inputs in the contract's order and the request inputs at R rows (``runtime/call/lanes.py::run``);
so does this, with the same graph.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.utils import _pytree as pytree

from ..formats.leaves import GRAPH_OUTPUT
from ..runtime import CompiledModel
from ..runtime.call.program_io import clone_constants
from .dynamo_graph import dotted
from .lowering import Lowered


class SettledShared:
    """Runs a variant's lowered graph on a shared call's leaves (its outputs as the runtime
    returns them); None when the call needs the call path."""

    __slots__ = ("_model", "_graph", "_inputs", "_flat_outputs")

    def __init__(self, model: CompiledModel, paths: list[tuple]):
        self._model = model
        self._graph = model.graph_module
        contract = model.contract
        by_name = {dotted(p): p for p in paths}
        requests, candidates = set(contract.request_inputs), set(contract.candidate_inputs)
        # Per graph input: its leaf path, its dotted name, and whether it is a request input
        # (taken at R rows) or a candidate input (its rows checked against N).
        self._inputs = [
            (by_name[n], n, n in requests, n in candidates) for n in contract.input_names
        ]
        # Outputs that are the graph's outputs as one flat list or tuple: the list the subgraph
        # returns is the graph's own, without building the structure to take it apart again.
        self._flat_outputs = _flat(contract)

    @staticmethod
    def of(model: Any, paths: list[tuple]) -> Optional["SettledShared"]:
        """The settled call of ``model`` (a variant's runner), or None when its calls may take
        another lane than the shared program."""
        if not isinstance(model, CompiledModel) or not isinstance(model.graph_module, Lowered):
            return None
        if not model.graph_module.uses_inductor or model.input_format.converts:
            return None
        moving_parts = (
            model._choice, model._originals, model._cache, model._jagged, model._nesting,
            model._autocast, model._training, model._eval_mode,
        )  # fmt: skip
        if any(part is not None for part in moving_parts):
            return None
        names = {dotted(p) for p in paths}
        if not all(n in names for n in model.contract.input_names):
            return None
        return SettledShared(model, paths)

    def __call__(self, leaves: dict, shared: dict, index: torch.Tensor) -> Any:
        if torch.is_grad_enabled() or torch._C._is_any_autocast_enabled():
            return None
        num_candidates = index.shape[0]
        inputs = []
        num_requests = None
        for path, name, request, candidate in self._inputs:
            if request:
                value = shared[name]
                num_requests = value.shape[0]
            else:
                value = leaves[path]
                if candidate and (not value.dim() or value.shape[0] != num_candidates):
                    return None  # the call path names the rows that disagree
            inputs.append(value)
        if num_requests == num_candidates or not inputs or inputs[0].device != index.device:
            return None  # one row per candidate: the call path checks the index is a permutation
        outputs = self._graph(*inputs, index)
        model = self._model
        if model._constant_outputs:
            outputs = clone_constants(model, outputs)
        return outputs if self._flat_outputs else model.contract.outputs(outputs)


def _flat(contract) -> bool:
    """Whether ``contract.outputs(tensors)`` holds ``tensors`` in order and nothing else, as a
    list or tuple."""
    spec = contract.out_spec
    if not isinstance(spec, pytree.TreeSpec) or spec.type not in (list, tuple):
        return False
    children = spec.children() if hasattr(spec, "children") else spec.children_specs
    return (
        all(child.is_leaf() for child in children)
        and all(c is GRAPH_OUTPUT for c in contract.out_constants)
    )
