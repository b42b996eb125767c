"""Local search on a partition: moves and swaps of single requests off the most loaded rank, each
taken only when it leaves both ranks it touches below that rank's load.

A constructive partition leaves a bubble of about one request's cost where requests are few per
rank (2 ranks of 16 requests: a request is several percent of a rank's load), and, for padded
histories, contiguous runs of lengths cannot fill a short rank with short requests taken from a
long one. A move of request r from rank s to rank d, or a swap of r with a request t of d,
changes only s and d; each is weighed in closed form for every r and d (moves) and every r and
t of the :data:`SWAP_RANKS` least loaded ranks d (swaps) at once.

The load model (``partition.loads``): a rank's load is ``sum(fixed) + S(W)``, ``W`` its longest
request and ``S(x) = sum(per_length * min(w, x))`` over its requests, ``w`` each request's
``Requests.run_widths`` (infinite for padded histories, so ``S(x) = x * sum(per_length)``; the
group's width for grouped calls; the length otherwise, so ``S`` is constant at ``x >= W``).
``S`` is a sum of ``min``s, evaluated at any ``x`` from the rank's widths sorted with prefix sums.

Guarantee: the largest load never grows; the search stops when no move or swap lowers the most
loaded rank's load, or after ``rounds`` steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .requests import Requests

# Swaps are weighed with the least loaded ranks only: a swap off the most loaded rank lowers it
# most where the other rank has the most room, and weighing every rank's requests against the
# most loaded one's costs most of a planning step at 8 ranks and more.
SWAP_RANKS = 3


def refine(requests: Requests, parts: np.ndarray, world: int, rounds: int) -> np.ndarray:
    """``parts`` after at most ``rounds`` improving moves or swaps (see the module)."""
    parts = parts.copy()
    unit = _Unit(requests.fixed, requests.per_length, requests.lengths, requests.run_widths)
    for _ in range(rounds):
        ranks = _Ranks.of(unit, parts, world)
        src = int(np.argmax(ranks.load))
        members = np.nonzero(parts == src)[0]
        if not members.shape[0]:
            break  # no load anywhere
        bound = ranks.load[src] * (1 - 1e-12)
        tried = [_move(unit, ranks, src, members)]
        for dest in np.argsort(ranks.load, kind="stable")[:SWAP_RANKS].tolist():
            others = np.nonzero(parts == dest)[0]
            if dest != src and others.shape[0] and ranks.load[dest] < bound:
                tried.append(_swap(unit, ranks, src, members, dest, others))
        tried = [t for t in tried if t is not None and t[0] < bound]
        if not tried:
            break
        _, moved, dest, back = min(tried, key=lambda t: t[0])
        parts[moved] = dest
        if back is not None:
            parts[back] = src
    return parts


@dataclass(frozen=True)
class _Unit:
    """Per request: cost at width 0, cost per unit of width, length, run width (all ``[G]``)."""

    fixed: np.ndarray
    per_length: np.ndarray
    lengths: np.ndarray
    widths: np.ndarray

    def at(self, index, x) -> np.ndarray:
        """``per_length * min(w, x)`` of the requests ``index`` at widths ``x`` (broadcast)."""
        return self.per_length[index] * np.minimum(self.widths[index], x)


class _Width:
    """``S(x) = sum(per_length * min(w, x))`` over one rank's requests."""

    def __init__(self, widths: np.ndarray, per_length: np.ndarray):
        order = np.argsort(widths, kind="stable")
        self.widths = widths[order]
        b = per_length[order]
        finite = np.where(np.isinf(self.widths), 0.0, b * self.widths)
        self.below = np.concatenate([[0.0], np.cumsum(finite)])  # sum of b * w, first k
        self.above = np.concatenate([np.cumsum(b[::-1])[::-1], [0.0]])  # sum of b, from k on

    def __call__(self, x) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        k = np.searchsorted(self.widths, x, side="right")
        return self.below[k] + x * self.above[k]


@dataclass(frozen=True)
class _Ranks:
    """Per rank: summed fixed costs, longest length, ``S`` and load (``[P]`` each)."""

    fixed: np.ndarray
    width: np.ndarray
    spread: list
    load: np.ndarray

    @classmethod
    def of(cls, unit: _Unit, parts: np.ndarray, world: int) -> _Ranks:
        fixed = np.bincount(parts, weights=unit.fixed, minlength=world)
        width = np.zeros(world, dtype=np.int64)
        np.maximum.at(width, parts, unit.lengths)
        spread = [
            _Width(unit.widths[parts == r], unit.per_length[parts == r]) for r in range(world)
        ]
        load = fixed + np.array([spread[r](width[r]) for r in range(world)])
        return cls(fixed, width, spread, load)


def _width_without(lengths: np.ndarray) -> np.ndarray:
    """For each of a rank's requests, the rank's width without it."""
    order = np.sort(lengths)
    top = order[-1]
    if order.shape[0] > 1 and order[-2] == top:
        return np.full_like(lengths, top)
    second = order[-2] if order.shape[0] > 1 else 0
    return np.where(lengths == top, second, top)


def _spread_at_larger(spread: _Width, a: np.ndarray, c: np.ndarray) -> np.ndarray:
    """``spread(max(a[:, None], c[None, :]))`` from ``spread`` at ``a`` and at ``c`` alone."""
    return np.where(a[:, None] >= c[None, :], spread(a)[:, None], spread(c)[None, :])


def _move(unit: _Unit, ranks: _Ranks, src: int, members: np.ndarray):
    """(larger new load, request, destination, None): the best move of one of ``members``."""
    f, length = unit.fixed[members], unit.lengths[members]
    left = _width_without(length)
    src_after = ranks.fixed[src] - f + ranks.spread[src](left) - unit.at(members, left)
    grown = np.maximum(ranks.width[None, :], length[:, None])  # [members, ranks]
    spread = np.repeat((ranks.load - ranks.fixed)[None, :], members.shape[0], axis=0)
    for dest in np.nonzero(ranks.width < length.max(initial=0))[0].tolist():
        longer = length > ranks.width[dest]  # these widen ``dest``
        spread[longer, dest] = ranks.spread[dest](length[longer])
    dest_after = ranks.fixed[None, :] + f[:, None] + spread + unit.at(members[:, None], grown)
    dest_after[:, src] = np.inf
    pair = np.maximum(src_after[:, None], dest_after)  # [members, ranks]
    i, dest = np.unravel_index(int(np.argmin(pair)), pair.shape)
    return float(pair[i, dest]), int(members[i]), int(dest), None


def _swap(unit: _Unit, ranks: _Ranks, src: int, members: np.ndarray, dest: int, others):
    """(larger new load, request, ``dest``, request back): the best swap of one of ``members``
    with one of ``others`` (``dest``'s requests)."""
    mine, theirs = members[:, None], others[None, :]
    f, of = unit.fixed[mine], unit.fixed[theirs]
    mine_left = _width_without(unit.lengths[members])
    theirs_left = _width_without(unit.lengths[others])
    src_width = np.maximum(mine_left[:, None], unit.lengths[theirs])
    dest_width = np.maximum(theirs_left[None, :], unit.lengths[mine])
    src_spread = _spread_at_larger(ranks.spread[src], mine_left, unit.lengths[others])
    dest_spread = _spread_at_larger(ranks.spread[dest], unit.lengths[members], theirs_left)
    src_after = (
        ranks.fixed[src] - f + of + src_spread
        - unit.at(mine, src_width) + unit.at(theirs, src_width)
    )  # fmt: skip
    dest_after = (
        ranks.fixed[dest] + f - of + dest_spread
        - unit.at(theirs, dest_width) + unit.at(mine, dest_width)
    )  # fmt: skip
    pair = np.maximum(src_after, dest_after)  # [members, others]
    i, j = np.unravel_index(int(np.argmin(pair)), pair.shape)
    return float(pair[i, j]), int(members[i]), dest, int(others[j])
