"""Seconds per unit of work of each op family on this machine, measured in one short run.

``calibrate()`` times single ops as a direct program calls them (``direct.py``: an ATen op
through torch's generated binding, a ``rocs::`` op through its ``run``, without checks): GEMMs,
batched products of small matrices, attentions, embedding lookups and row gathers, views, the
elementwise, normalization and reduction ops of ranking models, and the ``rocs::`` IKBO ops, at a
few sizes each. Each call is counted exactly as a node of a graph is
(``analysis/call_cost.py::op_counts``) and its time is modelled by the one formula of
``analysis/call_cost.py::node_seconds``:

    seconds = ops_s + flops_s * FLOPs + bytes_s * bytes + items_s * items    (rates, in cache)
              + launch_s + spill_s * max(0, bytes - cache_bytes)             (in a program)
              + fresh_s * (allocated if allocated >= fresh_bytes)
              + mapped_s * (allocated if allocated > 32 MiB) + cold_row_s * rows gathered
              + streamed_flop_s * (FLOPs of a GEMM if bytes >= streamed_bytes)

fitted by non-negative least squares on relative error (a call of a few microseconds weighs as
much as one of a few milliseconds), in two stages.

1. *Rates*, from each op repeated on the same inputs, in cache: per family, and per elementwise
   or ``rocs::`` op over its own samples (their time per byte differs tenfold: ``relu`` against
   ``sigmoid``).
2. *In a program*, from a synthetic chain of ops (lookups, a concatenation, three linear
   layers, pointwise ops, a batched product: no model of the zoo) run back to back at 64 to
   131,072 rows, each op timed where it runs (``time.perf_counter`` around it; the thread's clock
   is a system call of about a microsecond here): there the interpreter and the op's code are no
   longer warm, an op's inputs come from other ops, its output from pages the allocator hands out
   afresh and its tables from memory that other ops evicted, which costs a memory-bound op two to
   three times its time in cache (docs/SPEED.md, "The cost model against measured time").
   ``cache_bytes`` and ``fresh_bytes`` by a search over a few sizes; there an op's relative
   error weighs by the square root of its time, so the long ops that make up a large call decide
   what a spilled byte costs. ``rocs::embedding_bag_rows`` has rates per variant: a mean or a
   padding index costs 2-3 times a plain sum (``analysis/call_cost.py::op_key``). ``mapped_s``
   is measured by itself: a tensor of 36 or 48 MiB allocated and filled against one filled again
   (about 1 ns a byte on this VM, a page fault per 4 KiB). So is a GEMM that streams its input from
   memory: ``linear`` of 320 to 80 features at 2,048 to 32,768 rows; from the size where its time
   per FLOP first rises by a sixth over the smallest's (``streamed_bytes``: 12.6 or 25 MiB on a
   2-core AMD EPYC, where a FLOP then costs half as much again), each FLOP costs ``streamed_flop_s``
   more (the median excess of that size and the larger ones).

No model is timed. The per-call overhead of a compiled model's call path (``call_s``) is not an
op and not measured here (0 unless given; ``benchmarks/cost_model.py`` measures it on a
one-layer model). One torch thread by default, timed with the thread's CPU clock
(``time.thread_time``), which a busy machine disturbs less than the wall clock; with more threads,
the wall clock.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from rocs_compiler.analysis.call_cost import (
    NARROW_HEAD, node_seconds, op_counts, op_family, op_key,
)  # fmt: skip
from rocs_compiler.kernels import ROCS_OPS

aten = torch.ops.aten
MIB = 2**20

# The counts each fit may use; the others stay 0 (its samples cannot tell them apart).
_FITTED = {
    "gemm": ("ops", "flops", "bytes"),
    "bmm": ("ops", "flops", "bytes", "items"),
    "attention": ("ops", "flops", "bytes", "items"),
    "gather": ("ops", "bytes", "items"),
    "memory": ("ops", "bytes"),
    "view": ("ops",),
}
_IN_CACHE = 2 * MIB  # bytes of a call of the first stage
# The memory terms' fit weighs each large op of the chains by (its time / the median) to this
# power: at 0 every op's relative error counts alike, and the many ops of a few hundred KiB, which
# hardly spill, decided the terms (spill_s 8-11 ps a byte on a 2-core AMD EPYC); at 1 the few
# longest ops alone did, with the page faults the default allocator adds to them. Cells of
# benchmarks/cost_model.py within 25 % on that VM, by default / with malloc keeping its memory:
# 113-116 / 103-105 of 126 at 0, 115-117 / 106-123 at 0.5 (two runs each), 99 / 124 at 1 (one).
_TIME_WEIGHT = 0.5
_CACHE_SIZES = (1 * MIB, 2 * MIB, 4 * MIB, 8 * MIB, 16 * MIB, 32 * MIB)
_FRESH_SIZES = (MIB // 8, MIB // 2, 2 * MIB, 8 * MIB, 32 * MIB)
# Variants of an op too far from their family to share its rates (an attention's narrow heads do a
# quarter of the FLOPs of the family's per query row): fitted by themselves, not in the family.
_OWN_RATES = frozenset({"aten::scaled_dot_product_attention[narrow]"})
# (rows, widths of the two hidden layers) of the chains: ranking-model-like layers, and narrow
# ones at many rows (a history's tokens), whose tensors spill out of the caches.
_CHAINS = ((64, (512, 256)), (512, (512, 256)), (2048, (512, 256)), (8192, (512, 256)),
           (16_384, (32, 16)), (131_072, (32, 16)))  # fmt: skip


@dataclass(frozen=True)
class Rates:
    """Seconds per launch, per FLOP, per byte and per item of one op family (or one op)."""

    ops_s: float = 0.0
    flops_s: float = 0.0
    bytes_s: float = 0.0
    items_s: float = 0.0


@dataclass(frozen=True)
class Calibration:
    """Fitted :class:`Rates` per op family and per op measured by itself (``ops``, by schema
    name: ``"aten::sigmoid"``, ``"rocs::broadcast_linear"``), the machine's memory terms, the
    per-call overhead of a compiled model's call path outside its ops (``call_s``, 0 unless
    given), and how they were measured. ``Calibration.from_json(c.to_json()) == c``."""

    families: dict[str, Rates]
    ops: dict[str, Rates] = field(default_factory=dict)
    cache_bytes: float = float(_IN_CACHE)
    spill_s: float = 0.0
    fresh_bytes: float = float(_FRESH_SIZES[-1])
    fresh_s: float = 0.0
    cold_row_s: float = 0.0
    launch_s: float = 0.0
    mapped_s: float = 0.0
    streamed_bytes: float = 0.0
    streamed_flop_s: float = 0.0
    call_s: float = 0.0
    threads: int = 1
    torch_version: str = ""
    samples: int = 0
    median_error: float = 0.0  # relative, of the fitted model on the chains' ops

    def rates(self, family: str, op: Optional[str] = None) -> Rates:
        """The rates of ``op`` where it was measured by itself (a variant, ``op[mean]``, where
        measured, else the op's plain form), else of its ``family``."""
        if op in self.ops:
            return self.ops[op]
        plain = op.split("[", 1)[0] if op else op
        if plain in self.ops:
            return self.ops[plain]
        return self.families.get(family, Rates())

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Calibration":
        data = json.loads(text)
        for key in ("families", "ops"):
            data[key] = {name: Rates(**rates) for name, rates in data[key].items()}
        return cls(**data)


@dataclass(frozen=True)
class _Sample:
    target: Any  # the op that ``fn(*args)`` computes, whose counts the call has
    fn: Callable[..., Any]
    args: tuple

    def __call__(self) -> Any:
        return self.fn(*self.args)


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape)


def _ids(vocab: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, vocab, shape)


def _index(requests: int, candidates: int) -> torch.Tensor:
    return torch.arange(requests).repeat_interleave(candidates // requests)


def _elementwise(x: torch.Tensor, y: torch.Tensor) -> list[tuple[Any, Callable, tuple]]:
    """The elementwise, normalization and reduction ops measured one by one, on ``[n, 64]``."""
    mask, width = x > 0, x.shape[1]
    ones, zeros = torch.ones(width), torch.zeros(width)
    nn = torch._C._nn
    return [
        (aten.add.Tensor, torch.add, (x, y)), (aten.sub.Tensor, torch.sub, (x, y)),
        (aten.mul.Tensor, torch.mul, (x, y)), (aten.div.Tensor, torch.div, (x, y)),
        (aten.rsub.Scalar, torch.rsub, (x, 1.0)), (aten.relu.default, torch.relu, (x,)),
        (aten.leaky_relu.default, nn.leaky_relu, (x, 0.01)),
        (aten.prelu.default, torch.prelu, (x, ones[:1])),
        (aten.clamp_min.default, torch.clamp_min, (x, 0.0)),
        (aten.sigmoid.default, torch.sigmoid, (x,)), (aten.tanh.default, torch.tanh, (x,)),
        (aten.exp.default, torch.exp, (x,)), (aten.silu.default, nn.silu, (x,)),
        (aten.gelu.default, nn.gelu, (x,)), (aten.softmax.int, torch.softmax, (x, -1)),
        (aten.layer_norm.default, torch.layer_norm, (x, [width])),
        (aten.batch_norm.default, torch.batch_norm,
         (x, ones, zeros, zeros, ones, False, 0.1, 1e-5, False)),
        (aten.masked_fill.Scalar, torch.masked_fill, (x, mask, 0.0)),
        (aten.where.self, torch.where, (mask, x, y)), (aten.eq.Scalar, torch.eq, (x, 0.0)),
        (aten.ne.Scalar, torch.ne, (x, 0.0)), (aten.le.Scalar, torch.le, (x, 0.0)),
        (aten.bitwise_not.default, torch.bitwise_not, (mask,)),
        (aten.__and__.Tensor, torch.bitwise_and, (mask, mask)),
        (aten.cat.default, torch.cat, ([x, y], 1)), (aten.clone.default, torch.clone, (x,)),
        (aten.sum.dim_IntList, torch.sum, (x, [1])), (aten.mean.dim, torch.mean, (x, [1])),
        (aten.linalg_vector_norm.default, torch.linalg.vector_norm, (x, 2, [1])),
        (aten.zeros_like.default, torch.zeros_like, (x,)),
    ]  # fmt: skip


def _rocs_ops(requests: int, candidates: int) -> list[tuple[Any, Callable, tuple]]:
    """The ``rocs::`` ops measured one by one, at R requests of N / R candidates each."""
    r, n, idx = requests, candidates, _index(requests, candidates)
    op = {name: (record.overload, record.run) for name, record in ROCS_OPS.items()}
    out = []
    for k, m in ((16, 64), (128, 256)):
        out.append((*op["broadcast_linear"], (_randn(n, k), _randn(m, k), _randn(m),
                                              _randn(r, m), idx)))  # fmt: skip
    out.append((*op["broadcast_linear_compression"],
                (_randn(n, 8, 16), _randn(4, 8), _randn(r, 4, 16), idx)))  # fmt: skip
    for fu, fc, d in ((5, 3, 32), (9, 4, 16)):
        out.append((*op["broadcast_interaction"], (_randn(r, fu, d), _randn(n, fc, d), idx)))
    for length in (16, 64):
        q, k, v = _randn(n, 2, 1, 32), _randn(r, 2, length, 32), _randn(r, 2, length, 32)
        mask = torch.rand(r, length) > 0.2
        out.append((*op["broadcast_attention"], (q, k, v, idx, mask)))
    table, ids = _randn(50_000, 16), _ids(50_000, n, 8)
    padded = ids.masked_fill(torch.rand(n, 8) < 0.3, 0)  # a history's padding
    for mode, padding_idx in ((0, None), (1, None), (0, 0), (1, 0)):  # each variant (``op_key``)
        out.append((*op["embedding_bag_rows"], (table, padded, mode, padding_idx)))
    return out


def _samples() -> list[_Sample]:
    """The ops of the first stage: about the sizes of a ranking model's layers at R and N from 1
    to 4096, in cache."""
    out = []

    def add(target, fn, *args):
        out.append(_Sample(target, fn, args))

    for rows, (k, n) in itertools.product((1, 16, 256, 2048), ((16, 64), (64, 256), (512, 256))):
        add(aten.linear.default, F.linear, _randn(rows, k), _randn(n, k), _randn(n))
    products = ((5, 32, 5), (1, 50, 32), (1, 8, 8), (16, 16, 16), (21, 32, 21), (1, 64, 1))
    for batch, (m, k, n) in itertools.product((16, 256, 2048), products):
        add(aten.bmm.default, torch.bmm, _randn(batch, m, k), _randn(batch, k, n))
    shapes = ((1, 64), (21, 21), (1, 256))
    for batch, (lq, lk), masked in itertools.product((1, 16, 256), shapes, (False, True)):
        q, k, v = _randn(batch, 2, lq, 32), _randn(batch, 2, lk, 32), _randn(batch, 2, lk, 32)
        mask = torch.rand(batch, 1, 1, lk) > 0.2 if masked else None
        add(aten.scaled_dot_product_attention.default, F.scaled_dot_product_attention,
            q, k, v, mask)  # fmt: skip
    # Narrow heads (``op_key``'s ``[narrow]``): 4 heads of 8, as a small transformer over a
    # history splits a 32-wide token.
    for batch, (lq, lk), masked in itertools.product((8, 32, 96), ((1, 64), (21, 21)), (0, 1)):
        q = _randn(batch, 4, lq, NARROW_HEAD)
        k, v = _randn(batch, 4, lk, NARROW_HEAD), _randn(batch, 4, lk, NARROW_HEAD)
        mask = torch.rand(batch, 1, 1, lk) > 0.2 if masked else None
        add(aten.scaled_dot_product_attention.default, F.scaled_dot_product_attention,
            q, k, v, mask)  # fmt: skip
    for width, ids in itertools.product((16, 64), (1, 64, 1024, 8192)):
        add(aten.embedding.default, torch.embedding, _randn(50_000, width), _ids(50_000, ids))
    for ids, length in ((16, 50), (256, 50)):
        add(aten.embedding.default, torch.embedding, _randn(50_000, 16), _ids(50_000, ids, length))
    for width, ids in itertools.product((32, 256), (64, 2048)):
        add(aten.index_select.default, torch.index_select, _randn(64, width), 0, _ids(64, ids))
    for rows in (4, 128, 2048):
        for target, fn, args in _elementwise(_randn(rows, 64), _randn(rows, 64)):
            add(target, fn, *args)
    for requests, candidates in ((1, 64), (4, 512), (16, 2048)):
        for target, fn, args in _rocs_ops(requests, candidates):
            add(target, fn, *args)
    x = _randn(16, 32)
    add(aten.unsqueeze.default, torch.unsqueeze, x, 1)
    add(aten.view.default, torch.Tensor.view, x, [512])
    add(aten.transpose.int, torch.transpose, x, 0, 1)
    add(aten.select.int, torch.select, x, 1, 0)
    add(aten.expand.default, torch.Tensor.expand, x[:, None], [16, 4, 32])
    return out


def _counts(target: Any, args: tuple, result: Any, flops: Any) -> tuple[str, str, dict]:
    counts = op_counts(target, args, {}, result, flops)
    family = op_family(target, args, result)
    return op_key(target, args), family, {c: float(v) for c, v in counts.items()}


def _counted(sample: _Sample) -> tuple[str, str, dict]:
    with FlopCounterMode(display=False) as counter:
        result = sample()
    return _counts(sample.target, sample.args, result, counter.get_total_flops())


class _Chain:
    """The second stage's program: a synthetic chain of ops on ``rows`` rows (R = rows / 64
    requests) with hidden layers of ``widths``, each op timed where it runs."""

    def __init__(self, rows: int, widths: tuple[int, int]):
        self.rows, requests = rows, max(1, rows // 64)
        self.ids = (_ids(50_000, rows, 4), _ids(1_000, rows))
        self.tables = (_randn(50_000, 32), _randn(1_000, 64))
        self.user = _randn(requests, 128)
        self.index = _index(requests, rows)
        shapes = ((320, widths[0]), (widths[0], widths[1]), (widths[1] + 16, 1))
        self.layers = [(_randn(m, k), _randn(m)) for k, m in shapes]

    def run(self, step: Callable) -> Any:
        """One pass; ``step(target, fn, *args)`` runs each op and returns its result."""
        n = self.rows
        (w1, b1), (w2, b2), (w3, b3) = self.layers
        e = step(aten.embedding.default, torch.embedding, self.tables[0], self.ids[0])
        f = step(aten.embedding.default, torch.embedding, self.tables[1], self.ids[1])
        u = step(aten.index_select.default, torch.index_select, self.user, 0, self.index)
        flat = step(aten.view.default, torch.Tensor.view, e, [n, 128])
        h = step(aten.cat.default, torch.cat, [flat, f, u], 1)
        a = step(aten.relu.default, torch.relu, step(aten.linear.default, F.linear, h, w1, b1))
        b = step(aten.sigmoid.default, torch.sigmoid,
                 step(aten.linear.default, F.linear, a, w2, b2))  # fmt: skip
        c = step(aten.mul.Tensor, torch.mul, b, step(aten.add.Tensor, torch.add, b, 1.0))
        pairs = step(aten.bmm.default, torch.bmm, e,
                     step(aten.transpose.int, torch.transpose, e, 1, 2))  # fmt: skip
        both = step(aten.cat.default, torch.cat, [c, pairs.view(n, 16)], 1)
        step(aten.sum.dim_IntList, torch.sum, both, [1])
        return step(aten.linear.default, F.linear, both, w3, b3)

    def measure(self, rounds: int) -> list[tuple]:
        """``(op, family, counts, seconds)`` per op: the median of its time over ``rounds``."""
        clock = time.perf_counter
        counted = []

        def count(target, fn, *args):
            with FlopCounterMode(display=False) as counter:
                result = fn(*args)
            counted.append(_counts(target, args, result, counter.get_total_flops()))
            return result

        self.run(count)
        times: list[list[float]] = [[] for _ in counted]

        def timed(target, fn, *args):
            start = clock()
            result = fn(*args)
            times[len(spent)].append(clock() - start)
            spent.append(None)
            return result

        for _ in range(rounds + 1):
            spent: list = []
            self.run(timed)
        return [(*c, statistics.median(t[1:])) for c, t in zip(counted, times)]


def _seconds(call: Callable[[], Any], budget: float, clock: Callable[[], float]) -> float:
    """Median seconds of one call over five rounds that together last about ``budget``."""
    call()
    start = clock()
    call()
    once = max(clock() - start, 1e-7)
    loops = max(1, int(budget / 5 / once))
    rounds = []
    for _ in range(5):
        start = clock()
        for _ in range(loops):
            call()
        rounds.append((clock() - start) / loops)
    return statistics.median(rounds)


def nnls(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, float]:
    """Non-negative least squares by trying every subset of columns (a few: 2^columns fits)."""
    best, best_error = np.zeros(a.shape[1]), float(np.sum(b**2))
    for used in itertools.product((False, True), repeat=a.shape[1]):
        columns = [i for i, u in enumerate(used) if u]
        if not columns:
            continue
        solution, *_ = np.linalg.lstsq(a[:, columns], b, rcond=None)
        if (solution < 0).any():
            continue
        theta = np.zeros(a.shape[1])
        theta[columns] = solution
        error = float(np.sum((a @ theta - b) ** 2))
        if error < best_error:
            best, best_error = theta, error
    return best, best_error


def _fit(samples: list[tuple[dict, float]], counts: tuple[str, ...]) -> Rates:
    """Rates for ``counts`` fitted on relative error."""
    a = np.array([[row[c] for c in counts] for row, _ in samples], dtype=np.float64)
    t = np.array([s for _, s in samples], dtype=np.float64)
    theta, _ = nnls(a / t[:, None], np.ones_like(t))
    return Rates(**{f"{c}_s": float(v) for c, v in zip(counts, theta)})


def _mapped_s(clock: Callable[[], float]) -> float:
    """Seconds per byte that an output of more than 32 MiB costs besides its writes: the pages
    the C library maps for it afresh at each allocation, faulted in on first write (a tensor
    allocated and filled, against one filled again)."""
    extra = []
    for mib in (36, 48):
        numel = mib * MIB // 4
        kept = torch.empty(numel)
        fresh = _Sample(aten.fill.Scalar, lambda: torch.empty(numel).fill_(1.0), ())
        again = _Sample(aten.fill.Scalar, lambda: kept.fill_(1.0), ())
        spent = [_seconds(call, 0.0, clock) for call in (fresh, again)]
        extra.append(max(0.0, spent[0] - spent[1]) / (mib * MIB))
    return statistics.median(extra)


# Rows of the streamed GEMM's samples (``linear`` of 320 to 80 features: 2.6 to 42 MB of input;
# the first in the caches of the machines measured), and the rise of a sample's time per FLOP over
# the first's that marks it streamed.
_STREAMED_ROWS = (2048, 4096, 8192, 16_384, 32_768)
_STREAMED_RISE = 1 / 6


def _streamed_gemm(calibration: Calibration, clock: Callable[[], float]) -> Calibration:
    """``streamed_bytes``, the bytes of the first sample whose time per FLOP exceeds the first
    sample's by more than :data:`_STREAMED_RISE`, and ``streamed_flop_s``, the median excess per
    FLOP of it and the larger ones (none where no sample rises so)."""
    weight, bias = _randn(80, 320), _randn(80)
    found = []
    for rows in _STREAMED_ROWS:
        sample = _Sample(aten.linear.default, F.linear, (_randn(rows, 320), weight, bias))
        counts = _counted(sample)[2]
        found.append((counts["bytes"], _seconds(sample, 0.0, clock) / counts["flops"]))
    in_cache = found[0][1]
    rises = [per_flop > in_cache * (1 + _STREAMED_RISE) for _, per_flop in found]
    streamed = [i for i, rise in enumerate(rises) if rise]
    if not streamed:
        return calibration
    first = streamed[0]
    excess = statistics.median(per_flop - in_cache for _, per_flop in found[first:])
    return dataclasses.replace(
        calibration, streamed_bytes=float(found[first][0]), streamed_flop_s=float(excess)
    )


def _program_terms(calibration: Calibration, measured: list) -> Calibration:
    """The terms of an op in a program but ``mapped_s``, from what the rates leave unexplained in
    each op of the chains: ``launch_s`` from the ops of at most 256 KiB, mostly launches; then,
    with it, ``spill_s``, ``fresh_s`` and ``cold_row_s`` from the larger ones (each weighed by
    its time to the power :data:`_TIME_WEIGHT`), ``cache_bytes`` and ``fresh_bytes`` by a search
    over a few sizes."""
    small = [m for m in measured if m[2]["bytes"] <= _IN_CACHE / 8]
    a = np.array([[counts["ops"] / spent] for _, _, counts, spent in small])
    b = np.array([1.0 - node_seconds(f, c, calibration.rates(f, op), calibration) / spent
                  for op, f, c, spent in small])  # fmt: skip
    (launch_s,), _ = nnls(a, b)
    calibration = dataclasses.replace(calibration, launch_s=float(launch_s))
    large = [m for m in measured if m[2]["bytes"] > _IN_CACHE / 8]
    typical = statistics.median(spent for *_, spent in large)
    weights = [(spent / typical) ** _TIME_WEIGHT for *_, spent in large]
    best, best_error = calibration, float("inf")
    for cache, fresh in itertools.product(_CACHE_SIZES, _FRESH_SIZES):
        zero = dataclasses.replace(calibration, cache_bytes=cache, fresh_bytes=fresh)
        a, b = [], []
        for op, family, counts, spent in large:
            spill = max(0.0, counts["bytes"] - cache)
            fresh_bytes = counts["allocated"] if counts["allocated"] >= fresh else 0.0
            rows = counts["items"] if family == "gather" else 0.0
            w = weights[len(a)]
            a.append([w * c / spent for c in (spill, fresh_bytes, rows)])
            rates = calibration.rates(family, op)
            b.append(w * (1.0 - node_seconds(family, counts, rates, zero) / spent))
        theta, error = nnls(np.array(a), np.array(b))
        if error < best_error:
            names = ("spill_s", "fresh_s", "cold_row_s")
            best = dataclasses.replace(zero, **dict(zip(names, map(float, theta))))
            best_error = error
    return best


def _rates(single: list) -> tuple[dict, dict]:
    """The first stage's rates, fitted on the samples in cache: per family, and per op measured
    by itself (elementwise and ``rocs::`` ops, and the variants of :data:`_OWN_RATES`)."""
    in_cache = [m for m in single if m[2]["bytes"] <= _IN_CACHE]
    families, ops = {}, {}
    for family, counts in _FITTED.items():
        mine = [(c, s) for op, f, c, s in in_cache if f == family and op not in _OWN_RATES]
        if mine:
            families[family] = _fit(mine, counts)
    by_itself = {
        op: f for op, f, _, _ in in_cache
        if f == "memory" or op.startswith("rocs::") or op in _OWN_RATES
    }  # fmt: skip
    for name, family in sorted(by_itself.items()):
        ops[name] = _fit([(c, s) for op, _, c, s in in_cache if op == name], _FITTED[family])
    return families, ops


def calibrate(seconds: float = 3.0, threads: Optional[int] = 1) -> Calibration:
    """Measure a :class:`Calibration` of this machine with about ``seconds`` of timed single ops
    (building them, the chains and the mapped pages add several more: 12 s in all by default on
    a 2-core VM, 4 s at ``seconds=0.05``), with ``threads`` torch threads (None: the calling
    process's count), under ``torch.no_grad()``; torch's random state is left as it was."""
    previous = torch.get_num_threads()
    threads = previous if threads is None else int(threads)
    clock = time.thread_time if threads == 1 else time.perf_counter
    random_state = torch.random.get_rng_state()
    torch.manual_seed(0)
    try:
        torch.set_num_threads(threads)
        with torch.no_grad():
            samples = _samples()
            budget = seconds / len(samples)
            single = [(*_counted(s), _seconds(s, budget, clock)) for s in samples]
            chained = [
                m
                for rows, widths in _CHAINS
                for m in _Chain(rows, widths).measure(7 if rows < 10_000 else 3)
            ]
            mapped_s = _mapped_s(clock)
            calibration = Calibration(
                *_rates(single), mapped_s=mapped_s, threads=threads,
                torch_version=torch.__version__,
            )  # fmt: skip
            calibration = _streamed_gemm(calibration, clock)
    finally:
        torch.set_num_threads(previous)
        torch.random.set_rng_state(random_state)
    calibration = _program_terms(calibration, chained)
    errors = [abs(node_seconds(f, c, calibration.rates(f, op), calibration) - s) / s
              for op, f, c, s in chained]  # fmt: skip
    return dataclasses.replace(
        calibration, samples=len(single) + len(chained), median_error=statistics.median(errors)
    )
