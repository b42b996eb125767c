"""A call's rows and its ``candidate_to_request`` checked against the contract: row counts, the
index's type, length and device, its range, and request inputs constant within each request.

Identity: a call that passes these checks is one the shared program computes exactly as the
original would (``kernels/index_contract.py`` states the index's contract).
"""

from __future__ import annotations

import torch

from ...errors import InputError
from ...kernels.index_contract import check_candidate_to_request, distinct_values, index_trusted
from .bound import Call
from .input_checks import row_count_error
from ..rows.request_detection import reduce_rows


def batch_rows(cm, leaves: dict, names: list[str]) -> int:
    """The common row count of the leaves ``names``; refused, naming each input's rows,
    when they differ."""
    if len(names) == 1 and leaves[names[0]].dim():
        return leaves[names[0]].shape[0]
    rows = [leaves[n].shape[0] if leaves[n].dim() else None for n in names]
    first = rows[0]
    if first is None or rows.count(first) != len(rows):
        raise row_count_error(dict(zip(names, rows)), cm._request_set)
    return first


def check_index(cm, call: Call, leaves: dict) -> None:
    """Check ``call``'s index against its candidate inputs (type, length, device), once per
    call."""
    if call.checked:
        return
    index, contract = call.index, cm.contract
    candidates = contract.candidate_inputs
    rows = batch_rows(cm, leaves, candidates) if candidates else None
    batched = candidates or contract.request_inputs
    device = leaves[batched[0]].device if batched else None
    check_candidate_to_request(index, rows, None, device=device)
    call.checked = True


def check_shared(cm, call: Call, leaves: dict, check_range: bool = True):
    """Check a shared-layout call (named ``leaves``); ``check_range=False`` leaves the range of
    its index to its consumer (the plain program's gathers, ``Call.gather``)."""
    contract = cm.contract
    index = call.index
    check_index(cm, call, leaves)
    num_candidates = index.shape[0]
    if contract.request_inputs:
        num_requests = batch_rows(cm, leaves, contract.request_inputs)
    else:
        num_requests = num_candidates
    if index_trusted():
        return leaves, index
    if check_range:
        call.requests_reached(num_requests)
    if contract.request_inputs and num_requests == num_candidates > 1:
        # One row per candidate is what replicated inputs look like: accept it only when
        # every row is its own request (the index is a permutation), never reinterpret it.
        if distinct_values(index) != num_candidates:
            raise InputError(
                f"request inputs have {num_requests} rows, one per candidate, but "
                "candidate_to_request groups candidates into fewer requests: the shared "
                "layout takes one row per request. For replicated request inputs call the "
                "model without candidate_to_request, or cm.call_replicated(...)"
            )
    return leaves, index


def reduce_leaves(cm, call: Call, leaves: dict, replicated: frozenset) -> dict:
    """A shared-layout call (named ``leaves``) whose request leaves ``replicated`` come with
    one row per candidate (a packed input's request columns): each checked constant within
    every request and kept at one row per request."""
    index = call.index
    check_index(cm, call, leaves)
    others = [n for n in cm.contract.request_inputs if n not in replicated]
    num_candidates = index.shape[0]
    if others:
        num_requests = batch_rows(cm, leaves, others)
        call.requests_reached(num_requests)
    else:  # the requests are those the index reaches
        num_requests = call.requests_reached(num_candidates)
    leaves = dict(leaves)
    for name in replicated:
        value = leaves[name]
        if value.shape[0] != num_candidates:
            raise InputError(
                f"input {name!r} has {value.shape[0]} rows; candidate_to_request has "
                f"{num_candidates} entries, one per row of the packed input"
            )
        leaves[name] = reduce_replicated(name, value, index, num_requests)
    return leaves


def check_replicated(cm, call: Call, leaves: dict):
    """A ``call_replicated`` call (named ``leaves``): the index checked, and each request input
    (one row per candidate) checked constant within every request and kept at one row per
    request."""
    contract = cm.contract
    index = call.index
    check_index(cm, call, leaves)
    num_candidates = index.shape[0]
    num_requests = call.requests_reached(num_candidates)
    requests = {}
    for name in contract.request_inputs:
        value = leaves[name]
        rows = value.shape[0] if value.dim() else None
        if rows != num_candidates:
            raise InputError(
                f"call_replicated takes request inputs with one row per candidate; "
                f"{name!r} has {rows} rows, candidate_to_request {num_candidates} entries"
            )
        requests[name] = reduce_replicated(name, value, index, num_requests)
    return requests, index


def reduce_replicated(name: str, value: torch.Tensor, index: torch.Tensor, num_requests: int):
    """``value`` (one row per candidate) at one row per request; refused when it varies within
    a request."""
    shared, consistent = reduce_rows(value, index, num_requests)
    if not consistent:
        raise InputError(f"request input {name!r} varies within a request")
    return shared
