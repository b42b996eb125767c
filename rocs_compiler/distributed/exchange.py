"""A partition's sends and receives, packed into one all-to-all of bytes.

Every rank knows the whole partition (``partition.py``) and every request's candidate count and
length, so it knows what it sends to each rank and what it receives from each, without asking:
a chunk from rank s to rank d holds s's requests bound for d (in s's order) and all their
candidates (in s's order), tensor after tensor in :class:`Schema` order, each padded to 16 bytes
so that every tensor is read back in place. Histories travel cut or padded to the longest
request the destination receives (``histories.py``), so a chunk's size is known on both ends.

Identity: rank d's batch is the concatenation, over sources s = 0..P-1, of ``s.take(requests of
s bound for d)`` with histories fit to d's width; ``candidate_to_request`` offset by the requests
before it.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .batch import RequestBatch, concat
from .histories import fit_width

ALIGN = 16


@dataclass(frozen=True)
class Field:
    """One tensor of a chunk: its name, dtype and shape past the rows (a history's width, at
    position 0 of ``tail``, is the chunk's)."""

    name: str
    dtype: torch.dtype
    tail: tuple[int, ...]
    history: bool

    def nbytes(self, rows: int, width: int) -> int:
        tail = (width, *self.tail[1:]) if self.history else self.tail
        size = rows * math.prod(tail) * self.dtype.itemsize
        return -(-size // ALIGN) * ALIGN


@dataclass(frozen=True)
class Schema:
    """What every rank's batch agrees on: request fields (and ``lengths``), candidate fields
    (and ``candidate_to_request``)."""

    request: tuple[Field, ...]
    candidate: tuple[Field, ...]

    @classmethod
    def of(cls, batch: RequestBatch, histories: Sequence[str]) -> Schema:
        def field(name, value, history=False):
            return Field(name, value.dtype, tuple(value.shape[1:]), history)

        request = [field(n, v, n in histories) for n, v in batch.request.items()]
        if batch.lengths is not None:
            request.append(Field("<lengths>", torch.int64, (), False))
        candidate = [field(n, v) for n, v in batch.candidate.items()]
        candidate.append(Field("<candidate_to_request>", torch.int64, (), False))
        return cls(tuple(request), tuple(candidate))

    def describe(self) -> list[str]:
        """One line per field: name, dtype and shape past the rows (``W``: a history's width)."""
        lines = []
        for kind, fields in (("request", self.request), ("candidate", self.candidate)):
            for f in fields:
                tail = ("W", *f.tail[1:]) if f.history else f.tail
                lines.append(f"{kind} {f.name}: {str(f.dtype).removeprefix('torch.')} {list(tail)}")
        return lines

    def digest(self) -> int:
        return zlib.crc32("\n".join(self.describe()).encode())

    def nbytes(self, requests: int, candidates: int, width: int) -> int:
        """The size of a chunk of ``requests`` requests and ``candidates`` candidates."""
        return sum(f.nbytes(requests, width) for f in self.request) + sum(
            f.nbytes(candidates, width) for f in self.candidate
        )


@dataclass(frozen=True)
class Routes:
    """What one rank sends and receives under a partition: ``sends[d]``, its local indices of
    the requests bound for rank d (ascending); ``received[s]``, (requests, candidates) it gets
    from rank s; ``widths[d]``, rank d's history width."""

    sends: list[torch.Tensor]
    received: list[tuple[int, int]]
    widths: list[int]

    @classmethod
    def of(cls, rank: int, world: int, ranks: np.ndarray, requests, histories: bool) -> Routes:
        """Rank ``rank``'s routes when global request i goes to ``ranks[i]``; ``requests`` is
        the gathered ``partition.Requests`` (rank by rank, each in local order)."""
        home = requests.home
        mine = ranks[home == rank]
        sends = [torch.from_numpy(np.nonzero(mine == d)[0]) for d in range(world)]
        to_me = ranks == rank
        received = []
        for s in range(world):
            chosen = to_me & (home == s)
            received.append((int(chosen.sum()), int(requests.candidates[chosen].sum())))
        widths = [0] * world
        if histories:
            top = np.zeros(world, dtype=np.int64)
            np.maximum.at(top, ranks, requests.lengths)
            widths = [max(int(w), 1) for w in top]
        return cls(sends, received, widths)


def pack(batch: RequestBatch, schema: Schema, routes: Routes, padding_id) -> tuple:
    """(uint8 buffer, bytes per destination): ``batch``'s chunks for every rank, in rank order."""
    pieces, sizes = [], []
    for dest, requests in enumerate(routes.sends):
        chunk = batch.take(requests)
        width = routes.widths[dest]
        before = sum(p.numel() for p in pieces)
        values = _values(chunk, schema, width, padding_id)
        for f, value in zip((*schema.request, *schema.candidate), values):
            raw = value.contiguous().view(-1).view(torch.uint8)
            pieces.append(raw)
            pad = f.nbytes(value.shape[0], width) - raw.numel()
            if pad:
                pieces.append(raw.new_zeros(pad))
        sizes.append(sum(p.numel() for p in pieces) - before)
    buffer = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.uint8)
    return buffer, sizes


def receive_sizes(schema: Schema, routes: Routes, rank: int) -> list[int]:
    """Bytes this rank receives from each rank."""
    width = routes.widths[rank]
    return [schema.nbytes(r, c, width) for r, c in routes.received]


def unpack(buffer: torch.Tensor, like: RequestBatch, schema: Schema, routes: Routes,
           rank: int) -> RequestBatch:  # fmt: skip
    """This rank's batch from the received bytes: the chunks of ranks 0..P-1 one after the other
    (``like`` gives names and layout)."""
    width = routes.widths[rank]
    chunks, offset = [], 0
    for requests, candidates in routes.received:
        values = []
        for f, rows in [(f, requests) for f in schema.request] + [
            (f, candidates) for f in schema.candidate
        ]:
            tail = (width, *f.tail[1:]) if f.history else f.tail
            size = rows * math.prod(tail) * f.dtype.itemsize
            raw = buffer.narrow(0, offset, size)
            values.append(raw.view(f.dtype).view(rows, *tail))
            offset += f.nbytes(rows, width)
        chunks.append(_batch(like, schema, values))
    return concat(chunks)


def _values(chunk: RequestBatch, schema: Schema, width: int, padding_id) -> list:
    values = []
    for f in schema.request:
        if f.name == "<lengths>":
            values.append(chunk.lengths.to(torch.int64))
        else:
            value = chunk.request[f.name]
            values.append(fit_width(value, width, padding_id) if f.history else value)
    values += [chunk.candidate[f.name] for f in schema.candidate[:-1]]
    values.append(chunk.candidate_to_request)
    return values


def _batch(like: RequestBatch, schema: Schema, values: list) -> RequestBatch:
    named = dict(zip([f.name for f in (*schema.request, *schema.candidate)], values))
    return RequestBatch(
        request={n: named[n] for n in like.request},
        candidate={n: named[n] for n in like.candidate},
        candidate_to_request=named["<candidate_to_request>"],
        lengths=named.get("<lengths>"),
        layout=like.layout,
    )
