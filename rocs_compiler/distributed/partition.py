"""Which rank each request goes to: the global set of whole requests split into one part per rank
(a request is never split), pure and deterministic, so every rank computes the same partition
from the same gathered costs.

A rank's predicted load: with ``padded`` histories (a rank pads them to its longest request,
``W``), the sum of its requests' costs at ``W`` (``sum(fixed) + W * sum(per_length)``, the cost
being affine in the length); with ``widths`` (a rank's call groups its requests by length), the
sum of its requests' costs each at its width, at most ``W``; otherwise the sum of its requests'
costs at their own lengths. All three are ``sum(fixed) + sum(per_length * min(w, W))`` with ``w``
infinite, the group's width or the length (``Requests.run_widths``). The constructive partitions
weigh a grouped request at its width (``Requests.own``, exact but on the rank's longest group);
the local search and the choice among them weigh the exact loads.

Policies:

- ``"count"``: equal request counts (within one): requests sorted by cost, most costly first,
  dealt to the ranks in snake order (FreeScale's production choice).
- ``"cost"``: equal loads, counts differ: the best (lowest largest load) of longest-processing-
  time-first (LPT) by cost and by length (the latter on the exact loads), multiway
  Karmarkar-Karp differencing (KK) and, for padded histories,
  contiguous runs of requests sorted by length, cut where the largest load is least; then moves
  and swaps of single requests while they lower the largest load (``refine.py``). KK and the
  search run up to :data:`SEARCH_LIMIT` requests times ranks.
- ``"keep"``: every request stays on the rank that loaded it.

No rank is left without requests while another holds two or more (``fill_empty``). The parts
are then labelled with ranks so that as many requests as possible stay where they are (the
labels are arbitrary to every policy): fewer bytes in the exchange.
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass

import numpy as np

from .refine import refine
from .requests import Requests

POLICIES = ("count", "cost", "keep")
# KK merges one partial of ``world`` sums per request, and a step of the local search weighs every
# (request, rank) pair: past this many requests x ranks either costs a planning step a tenth of a
# second or more, and there LPT or the runs by length leave a bubble of 1-2 % or less
# (benchmarks/balance.py's simulation).
SEARCH_LIMIT = 1 << 18


@dataclass(frozen=True)
class Partition:
    """``ranks`` (int64 ``[G]``): each request's rank; ``loads`` (float64 ``[P]``): each rank's
    predicted load; ``algorithm``: what made it."""

    ranks: np.ndarray
    loads: np.ndarray
    algorithm: str


def partition(requests: Requests, world: int, policy: str) -> Partition:
    """The requests split by ``policy`` into ``world`` parts, labelled with ranks."""
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r} is none of {POLICIES}")
    if policy == "keep":
        return Partition(requests.home, loads(requests, requests.home, world), "keep")
    small = False
    if policy == "count":
        tried = {"deal": deal(requests.own, world)}
    else:
        tried = {"lpt": lpt(requests.own, world), "lpt-by-length": lpt_by_length(requests, world)}
        small = requests.own.shape[0] * world <= SEARCH_LIMIT
        if small:
            tried["kk"] = karmarkar_karp(requests.own, world)
        if requests.padded:
            tried["by-length"] = by_length(requests, world)
    best = min(tried, key=lambda name: loads(requests, tried[name], world).max(initial=0.0))
    parts = fill_empty(requests, tried[best], world)
    if policy == "cost" and small:
        searched = refine(requests, parts, world, rounds=requests.own.shape[0])
        best, parts = (
            (best, parts) if np.array_equal(searched, parts) else (f"{best}+moves", searched)
        )
    ranks = keep_home(parts, requests.home, requests.candidates + 1, world)
    return Partition(ranks, loads(requests, ranks, world), best)


def loads(requests: Requests, ranks: np.ndarray, world: int) -> np.ndarray:
    """float64 ``[world]``: each rank's predicted load under ``ranks``: ``sum(fixed) +
    sum(per_length * min(w, W))``, ``W`` its longest length, ``w`` ``Requests.run_widths``."""
    top = np.zeros(world, dtype=np.int64)
    np.maximum.at(top, ranks, requests.lengths)
    runs_at = np.minimum(requests.run_widths, top[ranks])
    own = requests.fixed + requests.per_length * runs_at
    return np.bincount(ranks, weights=own, minlength=world).astype(np.float64)


def _descending(costs: np.ndarray) -> np.ndarray:
    return np.argsort(-costs, kind="stable")


def deal(costs: np.ndarray, world: int) -> np.ndarray:
    """Equal counts: most costly first, dealt 0, 1, ..., P-1, P-1, ..., 0, 0, 1, ..."""
    order = _descending(costs)
    position = np.arange(order.shape[0])
    lap, seat = np.divmod(position, world)
    ranks = np.empty_like(order)
    ranks[order] = np.where(lap % 2 == 0, seat, world - 1 - seat)
    return ranks


def lpt(costs: np.ndarray, world: int) -> np.ndarray:
    """Longest processing time first: most costly first, each to the least loaded rank (the
    lowest rank among equals)."""
    heap = [(0.0, rank) for rank in range(world)]
    ranks = np.empty(costs.shape[0], dtype=np.int64)
    for request in _descending(costs).tolist():
        load, rank = heapq.heappop(heap)
        ranks[request] = rank
        heapq.heappush(heap, (load + float(costs[request]), rank))
    return ranks


def lpt_by_length(requests: Requests, world: int) -> np.ndarray:
    """Longest history first, each to the least loaded rank by the exact loads: taken in that
    order, a rank's longest request is its first, so what each later one adds is known when it
    is placed (``per_length * min(run width, W)``), in every load model."""
    order = np.lexsort((np.arange(requests.lengths.shape[0]), -requests.own, -requests.lengths))
    fixed, per_length = requests.fixed.tolist(), requests.per_length.tolist()
    widths, lengths = requests.run_widths.tolist(), requests.lengths.tolist()
    top = [0] * world
    heap = [(0.0, rank) for rank in range(world)]
    ranks = np.empty(order.shape[0], dtype=np.int64)
    for request in order.tolist():
        load, rank = heapq.heappop(heap)
        top[rank] = top[rank] or lengths[request]
        ranks[request] = rank
        added = fixed[request] + per_length[request] * min(widths[request], top[rank])
        heapq.heappush(heap, (load + added, rank))
    return ranks


def karmarkar_karp(costs: np.ndarray, world: int) -> np.ndarray:
    """Multiway Karmarkar-Karp (largest differencing): every request starts as a partial
    partition of ``world`` sums; the two partials of largest spread (largest - smallest sum)
    are merged, the largest sum of one with the smallest of the other, until one is left.

    A partial is kept as its sums (descending, less the smallest) and a slot per sum: the
    first request put there, which the slot's later requests name as parent."""
    count = costs.shape[0]
    parent = np.arange(count)
    heap = [(-float(c), r, None) for r, c in enumerate(costs.tolist())]
    heapq.heapify(heap)
    seq = count

    def opened(entry):
        _, request, held = entry
        if held is not None:
            return held
        sums = np.zeros(world)
        sums[0] = costs[request]
        slots = np.full(world, -1)
        slots[0] = request
        return sums, slots

    while len(heap) > 1:
        a_sums, a_slots = opened(heapq.heappop(heap))
        b_sums, b_slots = opened(heapq.heappop(heap))
        sums = a_sums + b_sums[::-1]
        b_slots = b_slots[::-1]
        both = (a_slots >= 0) & (b_slots >= 0)
        parent[b_slots[both]] = a_slots[both]
        slots = np.where(a_slots >= 0, a_slots, b_slots)
        order = np.argsort(-sums, kind="stable")
        sums, slots = sums[order] - sums[order][-1], slots[order]
        heapq.heappush(heap, (-float(sums[0]), seq, (sums, slots)))
        seq += 1
    if not heap:
        return np.zeros(0, dtype=np.int64)
    _, final_slots = opened(heap[0])
    while True:  # every request's slot: follow parents to the root
        up = parent[parent]
        if np.array_equal(up, parent):
            break
        parent = up
    part_of_root = np.full(count, -1)
    part_of_root[final_slots[final_slots >= 0]] = np.nonzero(final_slots >= 0)[0]
    return part_of_root[parent].astype(np.int64)


def by_length(requests: Requests, world: int) -> np.ndarray:
    """Padded histories: requests sorted by length (longest first), cut into at most ``world``
    contiguous runs so that the largest run's padded load is least (a bisection on that load;
    for a given bound the greedy cut, each run as long as it fits, is optimal)."""
    order = np.lexsort((np.arange(requests.lengths.shape[0]), -requests.own, -requests.lengths))
    fixed = np.concatenate([[0.0], np.cumsum(requests.fixed[order])]).tolist()
    per_length = np.concatenate([[0.0], np.cumsum(requests.per_length[order])]).tolist()
    lengths = requests.lengths[order].tolist()
    count = len(lengths)

    def ends(bound: float) -> list[int] | None:
        """The greedy runs' ends under ``bound``, or None when more than ``world`` are needed."""
        cuts, start = [], 0
        while start < count:
            width = lengths[start]
            base = fixed[start] + width * per_length[start]
            end = bisect.bisect_right(
                range(count + 1), bound + base, lo=start + 1,
                key=lambda j: fixed[j] + width * per_length[j],
            )  # fmt: skip
            end = max(end - 1, start + 1)
            cuts.append(end)
            start = end
            if len(cuts) > world:
                return None
        return cuts

    low = max(float(np.max(requests.own, initial=0.0)), float(requests.own.sum()) / world)
    high = fixed[-1] + (lengths[0] if count else 0) * per_length[-1]
    for _ in range(60):  # to float precision
        middle = (low + high) / 2
        if middle <= low or middle >= high:
            break
        if ends(middle) is None:
            low = middle
        else:
            high = middle
    ranks = np.empty(count, dtype=np.int64)
    start = 0
    for part, end in enumerate(ends(high) or [count]):
        ranks[order[start:end]] = part
        start = end
    return ranks


def fill_empty(requests: Requests, parts: np.ndarray, world: int) -> np.ndarray:
    """``parts`` with no part empty while another holds two requests or more: the most loaded
    such part gives its most costly request to an empty one. No load grows past the largest (a
    request alone costs at most what it cost among others), and a rank with no requests, which
    still runs DDP's forward and backward, gets work."""
    parts = parts.copy()
    while True:
        sizes = np.bincount(parts, minlength=world)
        empty = np.nonzero(sizes == 0)[0]
        if not empty.shape[0] or sizes.max(initial=0) < 2:
            return parts
        donors = np.where(sizes >= 2, loads(requests, parts, world), -np.inf)
        donor = int(np.argmax(donors))
        members = np.nonzero(parts == donor)[0]
        parts[members[int(np.argmax(requests.own[members]))]] = int(empty[0])


def keep_home(parts: np.ndarray, home: np.ndarray, weight: np.ndarray, world: int) -> np.ndarray:
    """``parts`` relabelled with ranks, heaviest overlap first: the part holding most of rank
    p's ``weight`` becomes rank p where both are free (fewer rows to send)."""
    overlap = np.zeros((world, world))
    np.add.at(overlap, (parts, home), weight)
    label = np.full(world, -1)
    taken = np.zeros(world, dtype=bool)
    for flat in np.argsort(-overlap, axis=None, kind="stable").tolist():
        part, rank = divmod(flat, world)
        if label[part] < 0 and not taken[rank]:
            label[part], taken[rank] = rank, True
    return label[parts]
