"""Local search on a partition: moves and swaps of single requests off the most loaded rank, each
taken only when it leaves both ranks it touches below that rank's load.

A constructive partition leaves a bubble of about one request's cost where requests are few per
rank (2 ranks of 16 requests: a request is several percent of a rank's load), and, for padded
histories, contiguous runs of lengths cannot fill a short rank with short requests taken from a
long one. A move of request r from rank s to rank d, or a swap of r with a request t of d,
changes only s and d; each is weighed in closed form (``partition.loads``'s model: a padded rank
costs ``sum(fixed) + W * sum(per_length)``, W its longest request), for every r, d and t at once.

Guarantee: the largest load never grows; the search stops when no move or swap lowers the most
loaded rank's load, or after ``rounds`` steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .requests import Requests


def refine(requests: Requests, parts: np.ndarray, world: int, rounds: int) -> np.ndarray:
    """``parts`` after at most ``rounds`` improving moves or swaps (see the module)."""
    parts = parts.copy()
    if requests.padded:
        unit = _Unit(requests.fixed, requests.per_length, requests.lengths)
    else:  # loads add up: every request at "width 0" with its whole cost fixed
        unit = _Unit(requests.own, np.zeros_like(requests.own), np.zeros_like(requests.lengths))
    for _ in range(rounds):
        ranks = _Ranks.of(unit, parts, world)
        src = int(np.argmax(ranks.load))
        members = np.nonzero(parts == src)[0]
        if not members.shape[0]:
            break  # no load anywhere
        bound = ranks.load[src] * (1 - 1e-12)
        tried = [_move(unit, ranks, src, members)]
        for dest in range(world):
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
    """Per request: cost at width 0, cost per unit of width, length (all ``[G]``)."""

    fixed: np.ndarray
    per_length: np.ndarray
    lengths: np.ndarray


@dataclass(frozen=True)
class _Ranks:
    """Per rank: summed fixed costs, summed per-width costs, width, load (all ``[P]``)."""

    fixed: np.ndarray
    per_length: np.ndarray
    width: np.ndarray
    load: np.ndarray

    @classmethod
    def of(cls, unit: _Unit, parts: np.ndarray, world: int) -> _Ranks:
        fixed = np.bincount(parts, weights=unit.fixed, minlength=world)
        per_length = np.bincount(parts, weights=unit.per_length, minlength=world)
        width = np.zeros(world, dtype=np.int64)
        np.maximum.at(width, parts, unit.lengths)
        return cls(fixed, per_length, width, fixed + width * per_length)


def _width_without(lengths: np.ndarray) -> np.ndarray:
    """For each of a rank's requests, the rank's width without it."""
    order = np.sort(lengths)
    top = order[-1]
    if order.shape[0] > 1 and order[-2] == top:
        return np.full_like(lengths, top)
    second = order[-2] if order.shape[0] > 1 else 0
    return np.where(lengths == top, second, top)


def _move(unit: _Unit, ranks: _Ranks, src: int, members: np.ndarray):
    """(larger new load, request, destination, None): the best move of one of ``members``."""
    f, b, w = unit.fixed[members], unit.per_length[members], unit.lengths[members]
    src_after = ranks.fixed[src] - f + _width_without(w) * (ranks.per_length[src] - b)
    dest_after = (
        ranks.fixed[None, :] + f[:, None]
        + np.maximum(ranks.width[None, :], w[:, None]) * (ranks.per_length[None, :] + b[:, None])
    )  # fmt: skip
    pair = np.maximum(src_after[:, None], dest_after)  # [members, ranks]
    pair[:, src] = np.inf
    i, dest = np.unravel_index(int(np.argmin(pair)), pair.shape)
    return float(pair[i, dest]), int(members[i]), int(dest), None


def _swap(unit: _Unit, ranks: _Ranks, src: int, members: np.ndarray, dest: int, others):
    """(larger new load, request, ``dest``, request back): the best swap of one of ``members``
    with one of ``others`` (``dest``'s requests)."""
    f, b, w = unit.fixed[members, None], unit.per_length[members, None], unit.lengths[members]
    of, ob, ow = unit.fixed[None, others], unit.per_length[None, others], unit.lengths[others]
    src_width = np.maximum(_width_without(w)[:, None], ow[None, :])
    dest_width = np.maximum(_width_without(ow)[None, :], w[:, None])
    src_after = ranks.fixed[src] - f + of + src_width * (ranks.per_length[src] - b + ob)
    dest_after = ranks.fixed[dest] + f - of + dest_width * (ranks.per_length[dest] + b - ob)
    pair = np.maximum(src_after, dest_after)  # [members, others]
    i, j = np.unravel_index(int(np.argmin(pair)), pair.shape)
    return float(pair[i, j]), int(members[i]), dest, int(others[j])
