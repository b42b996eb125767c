"""The requests of a drop-in call: found among consecutive rows equal in every request input
(``runtime/rows/request_detection.py``), each request's first row kept.

Identity: gathering the kept rows by the found index gives back the call's request inputs.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import fx, nn

from ...errors import InputError
from ...ir.graph_meta import PLACEMENT
from ...ir.roles import Role
from .checks import batch_rows
from ..rows.request_detection import detect_requests


def group(cm, leaves: dict):
    """``(requests, index, uniform)`` of a drop-in call: each request's first row of every
    request input, the index, and the request count when requests are equal-sized (else None)."""
    if torch.compiler.is_compiling():  # ``torch.compile(cm)``: dynamo stops at the grouping
        return _group_untraced(cm, leaves)
    return group_rows(cm, leaves)


def group_rows(cm, leaves: dict):
    """The grouping itself: :func:`group` calls it, or under a tracer its untraced wrapper."""
    contract = cm.contract
    rows = batch_rows(cm, leaves, contract.batched_inputs)
    if not cm._request_work:
        device = leaves[contract.batched_inputs[0]].device
        return leaves, torch.arange(rows, device=device), rows
    request_leaves = [leaves[n] for n in contract.request_inputs]
    if request_leaves and request_leaves[0].is_meta:
        raise InputError(
            "inputs on the meta device have no values to find requests by; call the compiled "
            "model with tensors on the device it was compiled for"
        )
    found = detect_requests(request_leaves, rows)
    cm._mislabel.observe(leaves, found.counts, rows)
    counts = found.counts
    if counts and counts.count(counts[0]) == len(counts):
        # Equal-sized requests: the first row of each is every counts[0]-th row, a view
        # (equal to gathering the starts), and the grouping is known.
        requests = {n: leaves[n][:: counts[0]] for n in contract.request_inputs}
        return requests, found.index, len(counts)
    requests = {n: leaves[n].index_select(0, found.starts) for n in contract.request_inputs}
    return requests, found.index, None


# Outside dynamo's trace: the grouping reads rows as bytes through dtype views, whose aliases
# AOTAutograd regenerates with the wrong itemsize, and its Python counts would guard (and
# recompile) on every batch's request sizes. Eager calls skip the wrapper's cost (about 1 us).
_group_untraced = torch.compiler.disable(group_rows)


def has_request_work(graph_module: Optional[nn.Module]) -> bool:
    """True unless ``graph_module`` is a graph none of whose ops is placed per request."""
    graph = getattr(graph_module, "graph", None)
    if not isinstance(graph, fx.Graph):
        return True
    return any(n.op == "call_function" and n.meta.get(PLACEMENT) == Role.REQUEST for n in graph.nodes)
