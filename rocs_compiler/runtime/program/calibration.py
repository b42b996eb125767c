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
              + streamed(bytes) * bytes of a GEMM                    (its operands past the caches)

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
   (about 1 ns a byte on this VM, a page fault per 4 KiB). So is a GEMM that streams its operands
   from memory: ``linear`` of 320 to 80 features at 2,048 to 32,768 rows, whose time per FLOP
   over the smallest's, per byte, gives ``streamed``, the extra seconds per byte at each size
   (none in the caches; 40-100 ps at 13 MiB and 100-140 ps past 25 MiB on a 2-core AMD EPYC),
   interpolated between the sizes: a step at one size put GEMMs just below it a third under
   their time.

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
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

from rocs_compiler.analysis.call_cost import node_seconds
from .calibration_samples import (
    MIB, Chain, Sample, counted, median_seconds, randn, single_ops,
)  # fmt: skip

aten = torch.ops.aten

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
    # (bytes, extra seconds per byte) of a GEMM past the caches, rising with the bytes.
    streamed: tuple[tuple[float, float], ...] = ()
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
        unknown = sorted(data.keys() - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(
                f"calibration has fields this version does not know ({', '.join(unknown)}): "
                "measured by another rocs version; run rocs.calibrate() again"
            )
        data["streamed"] = tuple(tuple(point) for point in data.get("streamed", ()))
        for key in ("families", "ops"):
            data[key] = {name: Rates(**rates) for name, rates in data[key].items()}
        return cls(**data)


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
        fresh = Sample(aten.fill.Scalar, lambda: torch.empty(numel).fill_(1.0), ())
        again = Sample(aten.fill.Scalar, lambda: kept.fill_(1.0), ())
        spent = [median_seconds(call, 0.0, clock) for call in (fresh, again)]
        extra.append(max(0.0, spent[0] - spent[1]) / (mib * MIB))
    return statistics.median(extra)


# Rows of the streamed GEMM's samples (``linear`` of 320 to 80 features: 2.6 to 42 MB of input;
# the first two in the caches of the machines measured).
_STREAMED_ROWS = (2048, 4096, 8192, 12_288, 16_384, 24_576, 32_768)
_STREAMED_ROUNDS = 3


def rising(values: list[float]) -> list[float]:
    """The non-decreasing sequence nearest ``values`` in least squares (adjacent violators
    pooled into their mean)."""
    blocks: list[list[float]] = []  # [mean, count]
    for value in values:
        blocks.append([value, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (mean, count), (last, n) = blocks[-2], blocks.pop()
            blocks[-1] = [(mean * count + last * n) / (count + n), count + n]
    return [mean for mean, count in blocks for _ in range(int(count))]


def _streamed_gemm(calibration: Calibration, clock: Callable[[], float]) -> Calibration:
    """``streamed``: at each sample's bytes, its time per FLOP over the in-cache one (the lower
    of the first two samples'), times its FLOPs per byte; each the median of it and its
    neighbours', made to rise with the bytes (a GEMM's operands only fall out of faster caches
    as they grow); the first sample's is 0. The sizes are timed in turn, round after round, so
    a slow phase of the machine does not fall on one size alone."""
    weight, bias = randn(80, 320), randn(80)
    samples = [Sample(aten.linear.default, F.linear, (randn(rows, 320), weight, bias))
               for rows in _STREAMED_ROWS]  # fmt: skip
    times: list[list[float]] = [[] for _ in samples]
    for _ in range(_STREAMED_ROUNDS):
        for spent, sample in zip(times, samples):
            sample()  # its operands back in the caches they fit in, as the rates measure
            for _ in range(3):
                start = clock()
                sample()
                spent.append(clock() - start)
    found = []
    for spent, sample in zip(times, samples):
        counts = counted(sample)[2]
        per_flop = statistics.median(spent) / counts["flops"]
        found.append((counts["bytes"], per_flop, counts["flops"] / counts["bytes"]))  # FLOP/byte
    in_cache = min(found[0][1], found[1][1])
    excess = [0.0] + [(per_flop - in_cache) * density for _, per_flop, density in found[1:]]
    smoothed = [0.0] + [statistics.median(excess[i - 1 : i + 2]) for i in range(1, len(excess))]
    points = tuple(
        (float(nbytes), max(0.0, float(e))) for (nbytes, *_), e in zip(found, rising(smoothed))
    )
    return dataclasses.replace(calibration, streamed=points)


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
            samples = single_ops()
            budget = seconds / len(samples)
            single = [(*counted(s), median_seconds(s, budget, clock)) for s in samples]
            chained = [
                m
                for rows, widths in _CHAINS
                for m in Chain(rows, widths).measure(7 if rows < 10_000 else 3)
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
