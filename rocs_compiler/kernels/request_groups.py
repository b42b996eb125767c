"""Group candidates by request for the torch paths of the per-request ops.

Attention and interaction compute, for every candidate n, something against the request
tensor at row ``candidate_to_request[n]``. Doing that per candidate would replicate the
request tensor; instead, candidates of one request are stacked and processed with one
batched matmul against that request's rows, so each request row is read once.

Requests are bucketed by candidate count: all requests with ``c`` candidates form one
group of shape ``[G, c, ...]``, so a batch where every request has the same count is a
single group (no Python loop over requests), and a ragged batch costs one batched call per
distinct count (at most about ``sqrt(2 N)`` of them).
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class RequestGroup:
    """All requests that have ``count`` candidates.

    ``requests`` is [G] request ids, ``candidates`` is [G, count] candidate rows (each row in
    the original candidate order). ``all_requests`` means ``requests == arange(R)``;
    ``contiguous`` means ``candidates == arange(N).view(R, count)``.
    """

    count: int
    requests: torch.Tensor
    candidates: torch.Tensor
    all_requests: bool
    contiguous: bool

    def gather_requests(self, x: torch.Tensor) -> torch.Tensor:
        """[R, ...] -> [G, ...]."""
        return x if self.all_requests else x.index_select(0, self.requests)

    def gather_candidates(self, x: torch.Tensor) -> torch.Tensor:
        """[N, ...] -> [G, count, ...]."""
        shape = (self.candidates.shape[0], self.count, *x.shape[1:])
        if self.contiguous:
            return x.view(shape)
        return x.index_select(0, self.candidates.reshape(-1)).view(shape)

    def scatter_candidates(self, out: torch.Tensor, values: torch.Tensor) -> None:
        """Write [G, count, ...] ``values`` into the rows of ``out`` [N, ...]."""
        flat = values.reshape(-1, *out.shape[1:])
        if self.contiguous:
            out.copy_(flat)
        else:
            out.index_copy_(0, self.candidates.reshape(-1), flat)


class _CallGroups:
    """The groupings computed during one call of a compiled graph: every op of the call
    receives the same ``candidate_to_request`` tensor, so it is grouped once per call, not once
    per op. ``uniform`` is the number of requests when the caller knows the index is
    ``arange(uniform)`` with each entry repeated equally often (drop-in request detection)."""

    __slots__ = ("checked", "groups", "index", "uniform")

    def __init__(self, index: torch.Tensor, uniform: Optional[int]):
        self.index, self.uniform, self.groups = index, uniform, {}
        # (N, R, device) the index contract was checked for by an op of this call: the same
        # index object within one call passes the same check again (rocs_op.checked_run).
        self.checked: set = set()


# Per call, never across calls: set by the runtime around one run of a graph, per thread and
# per task (a context variable), so concurrent calls never see each other's groups.
_CALL: ContextVar[Optional[_CallGroups]] = ContextVar("rocs_call_groups", default=None)


class call_groups:  # noqa: N801 - used as a function: ``with call_groups(index):``
    """Within the block, ``group_by_request(index, ...)`` is computed once and reused; with
    ``uniform`` (the caller's knowledge that requests are equal-sized and contiguous) it needs
    no pass over the index's values. A plain class, not a generator: it opens every call."""

    __slots__ = ("_scope", "_token")

    def __init__(self, index: Optional[torch.Tensor], uniform: Optional[int] = None):
        self._scope = _CallGroups(index, uniform) if index is not None else None

    def __enter__(self) -> None:
        self._token = _CALL.set(self._scope)

    def __exit__(self, *exc) -> None:
        _CALL.reset(self._token)


def current_call() -> Optional[_CallGroups]:
    """The scope of the call being run (None outside ``call_groups``)."""
    return _CALL.get()


class reentered:  # noqa: N801 - used as a function: ``with reentered(scope):``
    """Runs a block inside a call's scope again: an op's backward, which autograd runs after
    the call returned, reuses the groups its forward computed."""

    __slots__ = ("_scope", "_token")

    def __init__(self, scope: Optional[_CallGroups]):
        self._scope = scope

    def __enter__(self) -> None:
        self._token = _CALL.set(self._scope)

    def __exit__(self, *exc) -> None:
        _CALL.reset(self._token)


def group_by_request(idx: torch.Tensor, num_requests: int) -> list[RequestGroup]:
    """Bucket candidates by request, requests by candidate count; ``idx`` is int64 [N]."""
    scope = _CALL.get()
    if scope is None or scope.index is not idx:
        return _group_by_request(idx, num_requests)
    groups = scope.groups.get(num_requests)
    if groups is None:
        if scope.uniform == num_requests:
            groups = _uniform_groups(idx, num_requests)
        else:
            groups = _group_by_request(idx, num_requests)
        scope.groups[num_requests] = groups
    return groups


def _group_by_request(idx: torch.Tensor, num_requests: int) -> list[RequestGroup]:
    num_candidates = idx.shape[0]
    if num_candidates == 0:
        return []
    counts = torch.bincount(idx, minlength=num_requests)
    distinct = [c for c in torch.unique(counts).tolist() if c > 0]
    is_sorted = bool((idx[1:] >= idx[:-1]).all()) if num_candidates > 1 else True

    if len(distinct) == 1 and distinct[0] * num_requests == num_candidates and is_sorted:
        return _uniform_groups(idx, num_requests)

    order = torch.argsort(idx, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    groups = []
    for count in distinct:
        requests = torch.nonzero(counts == count).squeeze(1)
        positions = starts[requests].unsqueeze(1) + torch.arange(count, device=idx.device)
        all_requests = requests.shape[0] == num_requests
        groups.append(RequestGroup(count, requests, order[positions], all_requests, False))
    return groups


def _uniform_groups(idx: torch.Tensor, num_requests: int) -> list[RequestGroup]:
    """Every request has the same count and candidates are already grouped: one group."""
    num_candidates = idx.shape[0]
    count = num_candidates // num_requests
    arange = torch.arange(num_candidates, device=idx.device)
    requests = torch.arange(num_requests, device=idx.device)
    return [RequestGroup(count, requests, arange.view(num_requests, count), True, True)]
