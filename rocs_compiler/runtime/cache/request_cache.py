"""A bounded cache of request-side values across calls.

The same request comes back (the next page of a feed, a refresh, several surfaces asking for
one user): its request region computes the same values again. :class:`RequestCache` keeps, for
recent requests, the values that cross from the request region into the rest of the graph (the
*boundary values* of ``runtime/cache/request_split.py``), keyed by the bits of that request's inputs.
A call looks its requests up; the rows that hit skip the request program, the rows that miss
are computed together, and the rest of the graph runs once on the rows put together.

Identity: row r of a boundary value is a function of request r's inputs and of the weights
(``request_split.py``); the key is every bit of those inputs (with their dtypes and shapes, so
two layouts of the same bytes never meet), and the cache is emptied whenever the weights move
(``WeightRefresh.generation`` moves on every refresh that found a write, ``runtime/follow/weights.py``;
buffers and shared constants, which kernels and ``.data`` write without a version counter
seeing it, are compared by content per call, ``runtime/follow/content_watch.py``, and a change
refreshes). So a hit hands out the bits that the request program computed for those very
inputs and weights. A request program that draws random numbers is never cached
(``request_split.py`` refuses it). Rows are put together in the layout the request program
gives them (same strides), so a call whose every row hits computes the same bits as the call
that filled the entries.

Memory: entries are copies of their rows (never views of a batch), counted by their storage
plus their key, evicted least recently used; an insert that would pass ``max_bytes`` evicts
first, and a single request larger than the budget is not kept. Thread safety: one lock per
cache around lookups, inserts and counters; computing runs outside it, and entries are never
written after they are made.

Whether it pays: hashing the request inputs and putting rows together cost time on every
call; where the request region is cheap or requests rarely repeat, that is a loss. Per call
bucket (sizes and length class, as the program choice buckets them) the cache runs alone for a
warm-up, then ``CACHE_TRIALS`` calls per arm alternate with and without it, and the bucket keeps
the cache only if its mean time (the highest and lowest call aside) leads by ``CACHE_MARGIN``
(``CacheChoice``); a bucket that drops it computes exactly as without one.
"""

from __future__ import annotations

import statistics
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from ...analysis.batch_axis import BatchAxis, row_dim, split_shape
from ...errors import OptionsError
from ..follow.content_watch import ContentWatch
from ..program.direct import direct_program
from ..choice.program_choice import PLAIN, SHARED, TRIALS, ProgramChoice, bucket, call_clock
from .request_split import RequestSplit, SplitRefused, split_request_region

CACHED, UNCACHED = SHARED, PLAIN  # the two arms of a bucket's choice
WARMUP = 2 * TRIALS  # calls of a bucket that fill the cache before it is measured
# Timed calls per arm (the first of each discarded): the arms' times spread widely from call to
# call (hits and misses, other processes on the machine), and trial calls compute exactly.
CACHE_TRIALS = 10
# The lead the cached arm needs to be kept: a cache that only breaks even costs memory, and on a
# loaded machine a close race goes either way.
CACHE_MARGIN = 0.05


class RequestCache:
    """Configuration and contents of a request cache: ``rocs.compile(...,
    request_cache=rocs.RequestCache(max_bytes=64 << 20))``.

    ``max_bytes``: the most the entries may hold (their tensors and keys). ``autotune``: turn
    the cache off per call bucket where it measures slower (else it always runs).
    A cache serves one compiled model.
    """

    def __init__(self, max_bytes: int, *, autotune: bool = True):
        if type(max_bytes) is not int or max_bytes <= 0:
            raise OptionsError(
                "rocs.RequestCache", [f"max_bytes must be a positive int, got {max_bytes!r}"], ""
            )
        self.max_bytes = max_bytes
        self.autotune = autotune
        self._entries: OrderedDict[tuple, tuple[tuple[torch.Tensor, ...], int]] = OrderedDict()
        self._bytes = 0
        self._counts = {"hits": 0, "misses": 0, "evictions": 0, "invalidations": 0, "too_large": 0}
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._stamp: Any = None  # (weight generation, runner) the entries were computed with

    def __repr__(self) -> str:
        return f"RequestCache(max_bytes={self.max_bytes}, autotune={self.autotune})"

    def lookup(self, keys: list[tuple]) -> list[tuple[torch.Tensor, ...] | None]:
        """The entries of ``keys`` (None where absent), each hit made most recent."""
        found = []
        with self._lock:
            entries = self._entries
            for key in keys:
                entry = entries.get(key)
                if entry is None:
                    found.append(None)
                else:
                    entries.move_to_end(key)
                    found.append(entry[0])
            hits = sum(f is not None for f in found)
            self._counts["hits"] += hits
            self._counts["misses"] += len(keys) - hits
        return found

    def insert(self, items: list[tuple[tuple, tuple[torch.Tensor, ...]]], stamp: Any) -> None:
        """Keep ``items`` (key, rows), evicting the least recently used; nothing when the
        weights moved since ``stamp`` (the rows were computed with the old ones)."""
        with self._lock:
            if stamp != self._stamp:
                return
            entries = self._entries
            for key, rows in items:
                if key in entries:
                    continue
                size = sum(t.untyped_storage().nbytes() for t in rows) + _key_bytes(key)
                if size > self.max_bytes:
                    self._counts["too_large"] += 1
                    continue
                while self._bytes + size > self.max_bytes:
                    _, (_, freed) = entries.popitem(last=False)
                    self._bytes -= freed
                    self._counts["evictions"] += 1
                entries[key] = (rows, size)
                self._bytes += size

    def follow(self, stamp: Any) -> None:
        """Empty the cache when the weights' ``stamp`` is not the one its entries were made
        with."""
        if stamp == self._stamp:
            return
        with self._lock:
            if stamp != self._stamp:
                if self._entries:
                    self._counts["invalidations"] += 1
                self._entries.clear()
                self._bytes = 0
                self._stamp = stamp

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return dict(
                self._counts, entries=len(self._entries), bytes=self._bytes,
                max_bytes=self.max_bytes,
            )  # fmt: skip

    def claim(self, owner: object) -> None:
        """Bind this cache to one compiled model: entries are keyed by inputs, not models."""
        if self._owner is not None and self._owner != id(owner):
            raise OptionsError(
                "rocs.compile", ["a RequestCache serves one compiled model; make one per model"], ""
            )
        self._owner = id(owner)


def _key_bytes(key: tuple) -> int:
    return len(key[1])


def row_keys(tensors: list[torch.Tensor], rows: int) -> list[tuple]:
    """One key per row: the row's bits in every tensor, with the tensors' dtypes and row shapes."""
    signature = tuple((t.dtype, t.shape[1:]) for t in tensors)
    parts = [_as_bytes(t.reshape(rows, t.numel() // rows)) for t in tensors]
    matrix = parts[0] if len(parts) == 1 else torch.cat(parts, 1)
    data = matrix.cpu().numpy().tobytes()
    width = matrix.shape[1]
    return [(signature, data[r * width : (r + 1) * width]) for r in range(rows)]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes, ``[rows, row bytes]``. Not ``contiguous()`` alone: a dim of size 1 counts
    as contiguous whatever its stride (a single request's strided row of a drop-in call),
    and a view to bytes needs the last stride to be 1."""
    if not t.is_contiguous() or t.stride(-1) != 1:
        t = t.clone(memory_format=torch.contiguous_format)
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def trimmed_mean(times: list[float]) -> float:
    """The mean of ``times`` without its highest and lowest value (when there are three or more):
    a call's cost over many calls, one preempted or lucky call aside."""
    if len(times) >= 3:
        times = sorted(times)[1:-1]
    return statistics.fmean(times)


class CacheChoice(ProgramChoice):
    """The program choice with a trimmed mean instead of the minimum, timed by
    :func:`call_clock`. The cached arm's time depends on how many rows hit: a call whose rows all
    hit skips the request program, a call with one miss pays most of it, so its times fall in two
    groups. What a bucket costs over many calls is their mean; the minimum would pick its luckiest
    call and the median whichever group holds more calls (at a 95 % hit rate per request, 8
    requests all hit in 66 % of calls: the median is an all-hit call, the mean is not)."""

    def __init__(self, trials: int = CACHE_TRIALS):
        super().__init__(trials)

    def record(self, key: tuple, program: str, seconds: float) -> None:
        with self._lock:
            if key in self._decided:
                return
            times = self._times.setdefault(key, {SHARED: [], PLAIN: []})
            times[program].append(seconds)
            if min(len(t) for t in times.values()) >= self._trials:
                typical = {p: trimmed_mean(t[1:]) for p, t in times.items()}
                lead = 1.0 - self._margins.pop(key, 0.0)
                kept = typical[CACHED] <= typical[UNCACHED] * lead
                self._decided[key] = CACHED if kept else UNCACHED
                del self._times[key]

    def run(self, key, cached, uncached, margin: float = 0.0) -> Any:
        program = self.decided(key)
        if program is not None:
            return cached() if program == CACHED else uncached()
        program = self.next_trial(key, margin)
        clock = call_clock()
        start = clock()
        result = cached() if program == CACHED else uncached()
        self.record(key, program, clock() - start)
        return result


class CachedGraph:
    """A compiled model's graph run through its request cache (held by the compiled model)."""

    def __init__(self, cache: RequestCache, graph_module: Any):
        self.cache = cache
        self.refused: str | None = None
        self._split: RequestSplit | None = None
        if not isinstance(graph_module, fx.GraphModule):
            self.refused = "the model runs without a graph of its own (eager fallback or lowered)"
        else:
            try:
                self._split = split_request_region(graph_module)
            except SplitRefused as err:
                self.refused = str(err)
        self._programs: tuple[Callable, Callable] | None = None
        self._programs_of: Any = None  # the runner they were built beside
        self._layouts: dict[int, tuple[int, ...]] = {}  # boundary value -> dim order, as computed
        self._choice = CacheChoice()
        self._calls: dict[tuple, int] = {}
        self._watch: ContentWatch | None = None
        self._watch_key: Any = None  # (weight generation, runner) the watch was made for

    def over(self, graph_module: Any) -> "CachedGraph":
        """This cache, emptied, over another graph of the same model (compiled again at new
        sizes, ``runtime/modes/new_sizes.py``): its entries hold the old graph's boundary."""
        self.cache.clear()
        return CachedGraph(self.cache, graph_module)

    def run(self, model: Any, runner: Callable, inputs: list, index: torch.Tensor) -> list:
        """The outputs of ``runner(*inputs, index)`` (the compiled graph's program), with the
        request program skipped for the rows the cache holds."""
        if self.refused is not None or torch.compiler.is_compiling():
            return runner(*inputs, index)
        requests = [inputs[p] for p in self._split.request_positions]
        rows = requests[0].shape[0] if requests[0].dim() else 0
        if rows == 0:
            return runner(*inputs, index)
        # A refresh that found a weight written moves ``generation``; a rebinding or a move
        # (new devices, dtypes) also replaces the runner. Buffers written where no version
        # counter counts (batch norm's statistics) are found by content, and refresh everything.
        weights = model._weights
        programs = self._programs_for(model, runner)
        if weights is not None and self._watch_of(weights, runner).changed():
            weights.refresh(force=True)
            runner = model._graph_runner()
            programs = self._programs_for(model, runner)
        stamp = (0 if weights is None else weights.generation, runner)
        self.cache.follow(stamp)
        if not self.cache.autotune:
            return self._cached(programs, inputs, requests, rows, index, stamp)
        lengths = () if model._lengths is None else model._lengths.of_inputs(inputs)
        key = bucket("cache", index.shape[0], rows, lengths)
        choice = self._choice
        program = choice.decided(key)
        if program is None and self._calls.get(key, 0) < WARMUP:
            self._calls[key] = self._calls.get(key, 0) + 1
            program = CACHED
        if program == CACHED:
            return self._cached(programs, inputs, requests, rows, index, stamp)
        if program == UNCACHED:
            return runner(*inputs, index)
        return choice.run(
            key,
            lambda: self._cached(programs, inputs, requests, rows, index, stamp),
            lambda: runner(*inputs, index),
            margin=CACHE_MARGIN,
        )

    def _cached(self, programs, inputs, requests, rows, index, stamp) -> list:
        request_program, rest_program = programs
        keys = row_keys(requests, rows)
        found = self.cache.lookup(keys)
        missing = [r for r, f in enumerate(found) if f is None]
        if len(missing) == rows:
            values = list(request_program(*requests))
            self._note_layouts(values)
            self.cache.insert(list(zip(keys, self._rows_of(values, rows))), stamp)
        else:
            if missing:
                picked = torch.tensor(missing, device=requests[0].device)
                computed = list(request_program(*[t.index_select(0, picked) for t in requests]))
                self._note_layouts(computed)
                fresh = self._rows_of(computed, len(missing))
                self.cache.insert([(keys[r], f) for r, f in zip(missing, fresh)], stamp)
                for r, f in zip(missing, fresh):
                    found[r] = f
            values = self._assemble(found)
        return rest_program(*inputs, index, *values)

    def _programs_for(self, model: Any, runner: Callable) -> tuple[Callable, Callable]:
        """The request and rest programs over the compiled graph's current tensors, rebuilt
        whenever the compiled model rebuilt its own program (weights rebound, a move)."""
        if self._programs_of is not runner:
            gm = model.graph_module
            split = split_request_region(gm)
            programs = (
                direct_program(fx.GraphModule(gm, split.request_graph)),
                direct_program(fx.GraphModule(gm, split.rest_graph)),
            )
            self._split, self._programs, self._programs_of = split, programs, runner
        return self._programs

    def _watch_of(self, weights: Any, runner: Callable) -> ContentWatch:
        """The watch over the buffers (and lifted constants) the request program reads, made
        again (their bytes as they are now) after every refresh that found a write, and with
        every new runner."""
        key = (weights.generation, runner)
        if self._watch_key != key:
            attrs = [n.target for n in self._split.request_graph.nodes if n.op == "get_attr"]
            self._watch, self._watch_key = ContentWatch(weights.read_by_content(attrs)), key
        return self._watch

    def _note_layouts(self, values: list[torch.Tensor]) -> None:
        if len(self._layouts) < len(values):
            self._layouts = {i: _dim_order(v) for i, v in enumerate(values)}

    def _rows_of(self, values: list[torch.Tensor], rows: int) -> list[tuple]:
        """Per row, a copy of that row of every boundary value (its own storage, so that an
        entry's bytes are freed when it is evicted)."""
        split = [_split_rows(v, a, rows) for v, a in zip(values, self._split.axes)]
        per_value = [[p.clone() for p in s.split(1, d)] for s, d in split]
        return list(zip(*per_value))

    def _assemble(self, found: list[tuple]) -> list[torch.Tensor]:
        """The boundary values of every row, from one entry per row, in the layout the request
        program gives them (so the rest program sees the strides it was traced with)."""
        values = []
        for i, axis in enumerate(self._split.axes):
            pieces = [f[i] for f in found]
            order = self._layouts.get(i)
            dim = row_dim(axis)
            if order is None or not axis.plain or len(order) != pieces[0].dim():
                joined = torch.cat(pieces, dim)
            else:
                inverse = sorted(range(len(order)), key=order.__getitem__)
                permuted = [p.permute(order) for p in pieces]
                joined = torch.cat(permuted, order.index(dim)).permute(inverse)
            if not axis.plain:
                shape = list(joined.shape)
                merged = shape[: axis.dim] + [axis.outer * len(found) * axis.inner]
                joined = joined.reshape(merged + shape[dim + 1 + (axis.inner > 1) :])
            values.append(joined)
        return values

    def stats(self) -> dict[str, Any]:
        out = self.cache.stats()
        out["refused"] = self.refused
        out["off_buckets"] = sorted(k for k, p in self._choice.decisions().items() if p == UNCACHED)
        if self._split is not None:
            out["boundary"] = list(self._split.names)
            out["recomputed"] = list(self._split.recomputed)
        return out

    def annotate(self, report: Any) -> Any:
        """``report`` with a line on the cache in its note."""
        from ..follow.mislabel import add_note

        s = self.stats()
        if s["refused"]:
            line = f"request cache: not used ({s['refused']})"
        else:
            line = (
                f"request cache: {s['hits']} hits, {s['misses']} misses, {s['evictions']} "
                f"evictions, {s['bytes']} of {s['max_bytes']} bytes in {s['entries']} entries; "
                f"{len(s['boundary'])} boundary values"
            )
            if s["off_buckets"]:
                buckets = ", ".join(_describe(k) for k in s["off_buckets"])
                line += f"; off where it measured slower: {buckets}"
        return add_note(report, line)


def _describe(key: tuple) -> str:
    _, n_bits, r_bits, *length_bits = key
    lengths = "".join(f", L<{1 << bits}" for bits in length_bits)
    return f"N<{1 << n_bits}, R<{1 << r_bits}{lengths}"


def _split_rows(value: torch.Tensor, axis: BatchAxis, rows: int) -> tuple[torch.Tensor, int]:
    """``value`` with its request rows on a dim of their own, and that dim."""
    if axis.plain:
        return value, axis.dim
    return value.reshape(split_shape(value.shape, axis, rows)), row_dim(axis)


def _dim_order(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s dims from the largest stride to the smallest (ties in dim order)."""
    strides = t.stride()
    return tuple(sorted(range(t.dim()), key=lambda d: -strides[d]))


def attach(model: Any, cache: RequestCache | None) -> None:
    """Give ``model`` (a compiled model) ``cache``; None removes it."""
    if cache is None:
        object.__setattr__(model, "_cache", None)
        return
    if not isinstance(cache, RequestCache):
        raise OptionsError(
            "rocs.compile", [f"request_cache must be a rocs.RequestCache, got {cache!r}"], ""
        )
    cache.claim(model)
    object.__setattr__(model, "_cache", CachedGraph(cache, model.graph_module))
