"""IKBO op micro-benchmarks: each fused op against its materialized-broadcast baseline.

Baseline = ``rocs_compiler.kernels.ROCS_OPS[name].reference``: gather the request tensors to N rows with
``index_select``, then the plain op (what a graph without IKBO runs). For the two GEMMs a
third row, ``replicated``, is the original layer before ROCS: the request features are
gathered and concatenated, and the full weight runs on N rows
(``linear(cat(u[idx], c))``, ``W @ cat(Eu[idx], Ec)``).

Per case: median wall time over repeats, peak memory allocated during one call above
what was allocated before it (inputs excluded; output included), and the max abs
difference to the baseline. Peak memory: CUDA ``max_memory_allocated``; CPU the
allocation events of ``torch.profiler`` (``profile_memory=True``).

    python benchmarks/kernels.py --device cpu --quick           # CPU-friendly shapes
    python benchmarks/kernels.py --device cuda --json out.json  # full shapes, float16
    python benchmarks/kernels.py --tiny                         # smoke test (seconds)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import rocs_compiler.kernels as cg


@dataclass
class Case:
    op: str
    shape: str
    make: Callable  # (device, dtype) -> (fused_fn, {variant: fn})
    notes: str = ""


@dataclass
class Result:
    op: str
    variant: str
    shape: str
    ms: float
    peak_mb: float
    max_abs_err: float | None = None
    extra: dict = field(default_factory=dict)


def _index(num_requests: int, num_candidates: int, device) -> torch.Tensor:
    """Ragged but balanced counts (e.g. 1024 from 15 -> 68 or 69 each), shuffled order."""
    gen = torch.Generator().manual_seed(0)
    idx = torch.arange(num_candidates) * num_requests // num_candidates
    return idx[torch.randperm(num_candidates, generator=gen)].to(device)


def _randn(*shape, device, dtype, scale=1.0):
    return (torch.randn(*shape, device=device, dtype=torch.float32) * scale).to(dtype)


def _without_k_padding(fn):
    def call():
        old = os.environ.get("ROCS_LINEAR_PAD_K")
        os.environ["ROCS_LINEAR_PAD_K"] = "0"
        try:
            return fn()
        finally:
            if old is None:
                del os.environ["ROCS_LINEAR_PAD_K"]
            else:
                os.environ["ROCS_LINEAR_PAD_K"] = old

    return call


def linear_case(n, r, ku, kc, m):
    def make(device, dtype):
        idx = _index(r, n, device)
        u = _randn(r, ku, device=device, dtype=dtype)
        c = _randn(n, kc, device=device, dtype=dtype)
        w = _randn(m, ku + kc, device=device, dtype=dtype, scale=(ku + kc) ** -0.5)
        b = _randn(m, device=device, dtype=dtype)
        w_u, w_c = w[:, :ku].contiguous(), w[:, ku:].contiguous()
        request_term = F.linear(u, w_u)  # once per request, outside the op

        def replicated():
            return F.linear(torch.cat([u.index_select(0, idx), c], 1), w, b)

        variants = {
            "baseline": lambda: cg.ROCS_OPS["broadcast_linear"].reference(c, w_c, b, request_term, idx),
            "replicated": replicated,
        }
        if device.type == "cuda" and dtype != torch.float32 and kc % 8:
            variants["fused, K not padded"] = _without_k_padding(
                lambda: torch.ops.rocs.broadcast_linear(c, w_c, b, request_term, idx)
            )
        return lambda: torch.ops.rocs.broadcast_linear(c, w_c, b, request_term, idx), variants

    return Case("broadcast_linear", f"N={n} R={r} Ku={ku} K={kc} M={m}", make)


def compression_case(n, r, ku, kc, m, d):
    def make(device, dtype):
        idx = _index(r, n, device)
        eu = _randn(r, ku, d, device=device, dtype=dtype)
        ec = _randn(n, kc, d, device=device, dtype=dtype)
        w = _randn(m, ku + kc, device=device, dtype=dtype, scale=(ku + kc) ** -0.5)
        w_u, w_c = w[:, :ku].contiguous(), w[:, ku:].contiguous()
        request_term = torch.matmul(w_u, eu)  # [R, M, D], once per request

        def replicated():
            return torch.matmul(w, torch.cat([eu.index_select(0, idx), ec], 1))

        return (
            lambda: torch.ops.rocs.broadcast_linear_compression(ec, w_c, request_term, idx),
            {
                "baseline": lambda: cg.ROCS_OPS["broadcast_linear_compression"].reference(
                    ec, w_c, request_term, idx
                ),
                "replicated": replicated,
            },
        )

    return Case("broadcast_linear_compression", f"N={n} R={r} Ku={ku} Kc={kc} M={m} D={d}", make)


def attention_case(n, r, h, lq, key_len, d):
    def make(device, dtype):
        idx = _index(r, n, device)
        q = _randn(n, h, lq, d, device=device, dtype=dtype)
        k = _randn(r, h, key_len, d, device=device, dtype=dtype)
        v = _randn(r, h, key_len, d, device=device, dtype=dtype)
        gen = torch.Generator().manual_seed(1)
        mask = (torch.rand(r, key_len, generator=gen) > 0.1).to(device)
        return (
            lambda: torch.ops.rocs.broadcast_attention(q, k, v, idx, mask, None),
            {"baseline": lambda: cg.ROCS_OPS["broadcast_attention"].reference(q, k, v, idx, mask, None)},
        )

    return Case("broadcast_attention", f"N={n} R={r} H={h} Lq={lq} L={key_len} D={d}", make)


def interaction_case(n, r, fu, fc, d):
    def make(device, dtype):
        idx = _index(r, n, device)
        rs = _randn(r, fu, d, device=device, dtype=dtype)
        cs = _randn(n, fc, d, device=device, dtype=dtype)
        return (
            lambda: torch.ops.rocs.broadcast_interaction(rs, cs, idx),
            {"baseline": lambda: cg.ROCS_OPS["broadcast_interaction"].reference(rs, cs, idx)},
        )

    return Case("broadcast_interaction", f"N={n} R={r} Fu={fu} Fc={fc} D={d}", make)


POINTWISE_PROGRAM = "mul(sigmoid(add(c0, r0)), r1)"


def pointwise_case(n, r, trailing):
    def make(device, dtype):
        idx = _index(r, n, device)
        c0 = _randn(n, *trailing, device=device, dtype=dtype)
        r0, r1 = (_randn(r, *trailing, device=device, dtype=dtype) for _ in range(2))
        return (
            lambda: torch.ops.rocs.broadcast_pointwise(POINTWISE_PROGRAM, [c0], [r0, r1], idx),
            {
                "baseline": lambda: cg.ROCS_OPS["broadcast_pointwise"].reference(
                    POINTWISE_PROGRAM, [c0], [r0, r1], idx
                )
            },
        )

    shape = f"N={n} R={r} S={tuple(trailing)} {POINTWISE_PROGRAM}"
    return Case("broadcast_pointwise", shape, make)


SHAPES = {
    "full": [
        linear_case(n=1024, r=15, ku=1178, kc=866, m=512),
        compression_case(n=1024, r=15, ku=1178, kc=866, m=433, d=256),
        attention_case(n=2048, r=32, h=2, lq=64, key_len=1024, d=128),
        interaction_case(n=1024, r=15, fu=64, fc=32, d=128),
        pointwise_case(n=1024, r=15, trailing=(433, 256)),
    ],
    "quick": [
        linear_case(n=1024, r=15, ku=1178, kc=866, m=433),
        compression_case(n=256, r=4, ku=160, kc=120, m=96, d=64),
        attention_case(n=256, r=8, h=2, lq=16, key_len=256, d=64),
        interaction_case(n=1024, r=15, fu=32, fc=16, d=64),
        pointwise_case(n=1024, r=15, trailing=(64, 32)),
    ],
    "tiny": [
        linear_case(n=24, r=3, ku=12, kc=10, m=20),
        compression_case(n=6, r=2, ku=5, kc=7, m=9, d=16),
        attention_case(n=6, r=2, h=2, lq=4, key_len=24, d=16),
        interaction_case(n=8, r=3, fu=5, fc=4, d=16),
        pointwise_case(n=8, r=3, trailing=(5, 3)),
    ],
}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device, repeats, warmup):
    for _ in range(warmup):
        fn()
    _sync(device)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def peak_bytes(fn, device) -> float:
    """Peak bytes allocated during one call, above what was allocated before it."""
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        _sync(device)
        return torch.cuda.max_memory_allocated(device) - before
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    allocs = []

    def walk(event):
        extra = getattr(event, "extra_fields", None)
        if extra is not None and hasattr(extra, "alloc_size"):
            allocs.append((event.start_time_ns, extra.alloc_size, extra.total_allocated))
        for child in event.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    if not allocs:
        return 0.0
    allocs.sort()
    start = allocs[0][2] - allocs[0][1]
    return max(total for _, _, total in allocs) - start


def run(cases, device, dtype, repeats, warmup):
    results = []
    for case in cases:
        fused, variants = case.make(device, dtype)
        with torch.no_grad():
            reference = variants["baseline"]()
            out = fused()
            err = (out.float() - reference.float()).abs().max().item() if out.numel() else 0.0
            del out, reference
            for variant, fn in [("fused", fused), *variants.items()]:
                ms = time_ms(fn, device, repeats, warmup)
                peak = peak_bytes(fn, device) / 2**20
                results.append(
                    Result(
                        case.op, variant, case.shape, ms, peak, err if variant == "fused" else None
                    )
                )
                print(f"  {case.op:<30} {variant:<20} {ms:9.3f} ms {peak:9.1f} MB", file=sys.stderr)
        del fused, variants
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def table(results) -> str:
    lines = [
        "| op | shape | variant | time (ms) | vs baseline | peak mem (MB) | max abs err |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    base = {(r.op, r.shape): r for r in results if r.variant == "baseline"}
    for r in results:
        b = base.get((r.op, r.shape))
        speed = f"{b.ms / r.ms:.2f}x" if b and r.ms > 0 else ""
        err = f"{r.max_abs_err:.1e}" if r.max_abs_err is not None else ""
        lines.append(
            f"| {r.op} | {r.shape} | {r.variant} | {r.ms:.3f} | {speed} | {r.peak_mb:.1f} | {err} |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="CPU-friendly shapes")
    parser.add_argument("--tiny", action="store_true", help="smoke-test shapes")
    parser.add_argument(
        "--dtype", default=None, help="float16 | bfloat16 | float32 (default: float16 on cuda)"
    )
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--ops", default=None, help="comma-separated op names to run")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--json", default=None, help="write results to this file")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype_name = args.dtype or ("float16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)
    size = "tiny" if args.tiny else "quick" if args.quick else "full"
    cases = SHAPES[size]
    if args.ops:
        wanted = set(args.ops.split(","))
        cases = [c for c in cases if c.op in wanted]
    repeats = args.repeats or (3 if size == "tiny" else 7 if device.type == "cpu" else 20)
    warmup = args.warmup if args.warmup is not None else (1 if device.type == "cpu" else 3)

    torch.manual_seed(0)
    results = run(cases, device, dtype, repeats, warmup)
    header = (
        f"IKBO kernels: device={device} ({_device_name(device)}), dtype={dtype_name}, "
        f"shapes={size}, median of {repeats}, torch {torch.__version__}, "
        f"threads={torch.get_num_threads()}"
    )
    print(header)
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "header": header,
                    "results": [r.__dict__ for r in results],
                },
                f,
                indent=1,
            )
    return results


def _device_name(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


if __name__ == "__main__":
    main()
