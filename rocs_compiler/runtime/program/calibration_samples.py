"""What ``calibrate()`` times (``calibration.py``): the first stage's single ops, about the sizes of
a ranking model's layers, each repeated on the same inputs in cache; the second stage's synthetic
chain of ops, each timed where it runs; and the clock's median of a few rounds. Each call is
counted as a node of a graph is (``analysis/call_cost.py::op_counts``)."""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from rocs_compiler.analysis.call_cost import NARROW_HEAD, op_counts, op_family, op_key
from rocs_compiler.kernels import ROCS_OPS

aten = torch.ops.aten
MIB = 2**20


@dataclass(frozen=True)
class Sample:
    """One timed call: ``fn(*args)``, which computes ``target``."""

    target: Any  # the op that ``fn(*args)`` computes, whose counts the call has
    fn: Callable[..., Any]
    args: tuple

    def __call__(self) -> Any:
        return self.fn(*self.args)


def randn(*shape: int) -> torch.Tensor:
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
        (aten.layer_norm.default, torch.layer_norm, (x, [width], ones, zeros)),
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
        out.append((*op["broadcast_linear"], (randn(n, k), randn(m, k), randn(m),
                                              randn(r, m), idx)))  # fmt: skip
    out.append((*op["broadcast_linear_compression"],
                (randn(n, 8, 16), randn(4, 8), randn(r, 4, 16), idx)))  # fmt: skip
    for fu, fc, d in ((5, 3, 32), (9, 4, 16)):
        out.append((*op["broadcast_interaction"], (randn(r, fu, d), randn(n, fc, d), idx)))
    for length in (16, 64):
        q, k, v = randn(n, 2, 1, 32), randn(r, 2, length, 32), randn(r, 2, length, 32)
        mask = torch.rand(r, length) > 0.2
        out.append((*op["broadcast_attention"], (q, k, v, idx, mask)))
    table, ids = randn(50_000, 16), _ids(50_000, n, 8)
    padded = ids.masked_fill(torch.rand(n, 8) < 0.3, 0)  # a history's padding
    for mode, padding_idx in ((0, None), (1, None), (0, 0), (1, 0)):  # each variant (``op_key``)
        out.append((*op["embedding_bag_rows"], (table, padded, mode, padding_idx)))
    return out


def single_ops() -> list[Sample]:
    """The ops of the first stage: about the sizes of a ranking model's layers at R and N from 1
    to 4096, in cache."""
    out = []

    def add(target, fn, *args):
        out.append(Sample(target, fn, args))

    for rows, (k, n) in itertools.product((1, 16, 256, 2048), ((16, 64), (64, 256), (512, 256))):
        add(aten.linear.default, F.linear, randn(rows, k), randn(n, k), randn(n))
    products = ((5, 32, 5), (1, 50, 32), (1, 8, 8), (16, 16, 16), (21, 32, 21), (1, 64, 1))
    for batch, (m, k, n) in itertools.product((16, 256, 2048), products):
        add(aten.bmm.default, torch.bmm, randn(batch, m, k), randn(batch, k, n))
    shapes = ((1, 64), (21, 21), (1, 256))
    for batch, (lq, lk), masked in itertools.product((1, 16, 256), shapes, (False, True)):
        q, k, v = randn(batch, 2, lq, 32), randn(batch, 2, lk, 32), randn(batch, 2, lk, 32)
        mask = torch.rand(batch, 1, 1, lk) > 0.2 if masked else None
        add(aten.scaled_dot_product_attention.default, F.scaled_dot_product_attention,
            q, k, v, mask)  # fmt: skip
    # Narrow heads (``op_key``'s ``[narrow]``): 4 heads of 8, as a small transformer over a
    # history splits a 32-wide token.
    for batch, (lq, lk), masked in itertools.product((8, 32, 96), ((1, 64), (21, 21)), (0, 1)):
        q = randn(batch, 4, lq, NARROW_HEAD)
        k, v = randn(batch, 4, lk, NARROW_HEAD), randn(batch, 4, lk, NARROW_HEAD)
        mask = torch.rand(batch, 1, 1, lk) > 0.2 if masked else None
        add(aten.scaled_dot_product_attention.default, F.scaled_dot_product_attention,
            q, k, v, mask)  # fmt: skip
    for width, ids in itertools.product((16, 64), (1, 64, 1024, 8192)):
        add(aten.embedding.default, torch.embedding, randn(50_000, width), _ids(50_000, ids))
    for ids, length in ((16, 50), (256, 50)):
        add(aten.embedding.default, torch.embedding, randn(50_000, 16), _ids(50_000, ids, length))
    for width, ids in itertools.product((32, 256), (64, 2048)):
        add(aten.index_select.default, torch.index_select, randn(64, width), 0, _ids(64, ids))
    for rows in (4, 128, 2048):
        for target, fn, args in _elementwise(randn(rows, 64), randn(rows, 64)):
            add(target, fn, *args)
    for requests, candidates in ((1, 64), (4, 512), (16, 2048)):
        for target, fn, args in _rocs_ops(requests, candidates):
            add(target, fn, *args)
    x = randn(16, 32)
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


def counted(sample: Sample) -> tuple[str, str, dict]:
    with FlopCounterMode(display=False) as counter:
        result = sample()
    return _counts(sample.target, sample.args, result, counter.get_total_flops())


class Chain:
    """The second stage's program: a synthetic chain of ops on ``rows`` rows (R = rows / 64
    requests) with hidden layers of ``widths``, each op timed where it runs."""

    def __init__(self, rows: int, widths: tuple[int, int]):
        self.rows, requests = rows, max(1, rows // 64)
        self.ids = (_ids(50_000, rows, 4), _ids(1_000, rows))
        self.tables = (randn(50_000, 32), randn(1_000, 64))
        self.user = randn(requests, 128)
        self.index = _index(requests, rows)
        shapes = ((320, widths[0]), (widths[0], widths[1]), (widths[1] + 16, 1))
        self.layers = [(randn(m, k), randn(m)) for k, m in shapes]

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


def median_seconds(call: Callable[[], Any], budget: float, clock: Callable[[], float]) -> float:
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
