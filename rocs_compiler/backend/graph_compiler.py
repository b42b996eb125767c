"""The backend object: :class:`RocsBackend`, which dynamo calls with each graph it traces.

For each graph it first has dynamo trace the frame again with the floats it would pass as tensors
read as constants (``specialized_floats.py``), then names the placeholders (``dynamo_graph.py``),
decides whether the graph can share anything (a request input reaches it, dynamo did not
specialize it to one row, its rewrite did not share nothing before) and returns a
:class:`~.subgraph.Subgraph`, which compiles at its first call, or the graph lowered plainly.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import fx

from .dynamo_graph import Slot, classify
from ..errors import InputError, OptionsError
from ..options import BackendOptions
from .lowering import lower_plain
from .request_names import request_covers, unknown_request_names, without_kjt_keys
from .specialized_floats import specialize_floats
from .subgraph import Subgraph, symbolic_dims_of
from .unshared import UNSHARED, frame_code


class RocsBackend:
    """A ``torch.compile`` backend with fixed options: ``torch.compile(model, backend=obj)``.

    ``subgraphs`` lists what it compiled (one entry per dynamo graph), for inspection and tests.
    """

    def __init__(
        self,
        request_inputs: Sequence[str] | str,
        options: Optional[Mapping[str, Any] | BackendOptions] = None,
    ):
        self.options = BackendOptions.from_mapping(options, where="rocs.backend")
        if self.options.training:
            raise OptionsError(
                "torch.compile(backend='rocs')",
                [
                    "option 'training' is not supported by the torch.compile backend (AOTAutograd "
                    "would hand it a forward graph without the parameters' gradients); compile "
                    "for training with rocs.compile(model, request_inputs, ..., training=True)"
                ],
                BackendOptions.describe(),
            )
        if isinstance(request_inputs, str):
            request_inputs = [request_inputs]
        if not request_inputs:
            raise ValueError("the rocs backend needs request_inputs (a list of input names)")
        self.request_inputs = without_kjt_keys(request_inputs)
        self.subgraphs: list[Subgraph] = []

    def __repr__(self) -> str:
        return f"RocsBackend(request_inputs={self.request_inputs!r}, options={self.options!r})"

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], **_: Any) -> Callable:
        specialize_floats(gm)  # dynamo traces the frame again with its floats as constants
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        slots = [classify(n) for n in placeholders]
        inputs = [s.name for s in slots if s.kind == "input"]
        present = [r for r in self.request_inputs if any(request_covers(r, n) for n in inputs)]
        unknown, nested = unknown_request_names(self.request_inputs, present)
        if unknown and not nested:
            raise InputError(unknown)
        subgraph = Subgraph(gm, slots, present, self.options)
        if unknown:
            warnings.warn(f"rocs: {unknown}; this graph runs without sharing", stacklevel=2)
            subgraph.fallback_reason = "its request inputs cannot be named here"
        unsupported = [s.name for s in slots if s.kind == "unsupported"]
        rows = _static_rows(placeholders, slots)
        if subgraph.fallback_reason is not None:
            pass
        elif unsupported:
            subgraph.fallback_reason = f"graph inputs rocs cannot name: {', '.join(unsupported)}"
            warnings.warn(
                f"rocs: {subgraph.fallback_reason}; this graph runs without sharing", stacklevel=2
            )
        elif not present:
            subgraph.fallback_reason = "no request input reaches this graph"
        elif rows is not None and rows <= 1:
            # Dynamo specializes a batch of one; one candidate has nothing to share.
            subgraph.fallback_reason = "static batch of one row"
        elif UNSHARED.reason(gm, present) is not None:  # its rewrite shared nothing before
            subgraph.fallback_reason = UNSHARED.reason(gm, present)
        if subgraph.fallback_reason is not None:
            subgraph.plain = lower_plain(gm, example_inputs, self.options.inductor)
        else:
            # The rewrite runs at the first call, not here: export inside dynamo's tracing context
            # would share dynamo's shape environment and add guards on export's own inputs.
            subgraph.static_rows = rows
            subgraph.symbolic_dims = symbolic_dims_of(gm, slots)
            subgraph.retrace = functools.partial(UNSHARED.retrace, gm, present, frame_code())
            _warn_if_grad(example_inputs)
        self.subgraphs.append(subgraph)
        return subgraph


def _static_rows(placeholders: list[fx.Node], slots: list[Slot]) -> Optional[int]:
    """The batch size dynamo specialized this graph to, or None when the batch dim is symbolic."""
    rows = []
    for node, slot in zip(placeholders, slots):
        value = node.meta.get("example_value")
        if slot.kind == "input" and isinstance(value, torch.Tensor) and value.dim():
            if isinstance(value.shape[0], torch.SymInt):
                return None
            rows.append(int(value.shape[0]))
    return max(rows) if rows else None


_GRAD_WARNED = False


def _warn_if_grad(example_inputs: Sequence[Any]) -> None:
    global _GRAD_WARNED
    if _GRAD_WARNED or not torch.is_grad_enabled():
        return
    if any(isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs):
        _GRAD_WARNED = True
        warnings.warn(
            "rocs compiles for inference: outputs carry no gradient; call the model under "
            "torch.no_grad() or torch.inference_mode(), or compile for training with "
            "rocs.compile(model, request_inputs, ..., training=True)",
            stacklevel=3,
        )
