"""Serving benchmark: one model served three ways on the same local Ray Serve.

- ``per request``: the original model, one request per call (``plain``, ``max_batch_requests=1``);
- ``plain packed``: the original model on the same packing as ``rocs``, request rows replicated to
  the candidates (``plain``);
- ``rocs packed``: the compiled model, requests packed into the shared layout.

Load, through the Python path (deployment handles, no JSON), on 127.0.0.1 only: requests from a
pool whose users are Zipf-distributed and whose candidates per request are log-uniform in
``[--min-candidates, --max-candidates]``. For each variant:

- a closed loop of ``--clients`` clients for ``--duration`` seconds: QPS, candidates scored per
  second, p50/p99 latency;
- open-loop Poisson arrivals at rates stepped up from a fraction of the closed-loop QPS: the
  highest rate whose p99 stays under ``--slo-ms`` (at most ``--steps`` rates, each for
  ``--duration`` seconds);
- p50/p99 at a fixed rate (``--fixed-qps``, default half the per-request variant's closed-loop QPS).

Two more numbers per model: the in-process speedup of the compiled call over the original one on
a packed batch of the same mix (``--batch-requests`` requests, bare calls, no server), and the
server's per-request overhead: the p50 latency of one request at a time through the handle minus
the p50 of the bare call on the same requests, and the part of it spent in the replica outside
the model call (the check, the batch queue, packing and splitting; the rest is Ray's transport).

The compiled model is built with ``autotune`` off (``--autotune`` keeps it): with it on, the first
calls of every power-of-two bucket of (candidates, requests) alternate the shared and the plain
program (``runtime/program_choice.py``), and a packed server sees many buckets, so a run of
seconds would measure mostly those trials rather than the steady state.

Every loop is bounded in count (``--max-requests``) and time. Usage::

    python benchmarks/serving.py --models two_tower --duration 2 --steps 3     # a quick look
    python benchmarks/serving.py                                               # the SPEED.md table
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = ["two_tower", "dlrm", "din", "target_attention", "glm_dcnv2"]


# -- models (built in each replica; pickled by value from this script) ---------------------------


def _entry(name: str):
    from models_zoo import ZOO

    return ZOO["dcnv2" if name == "glm_dcnv2" else name]


def build_model(name: str):
    """The original model in eval mode (``glm_dcnv2``: DCNv2 with GLM masks, half request lanes)."""
    import rocs_compiler as rocs

    entry = _entry(name)
    model = entry.build()
    if name == "glm_dcnv2":
        model = rocs.apply_glm(model, list(entry.request_inputs), request_fraction=0.5).eval()
    return model


def build_compiled(name: str, threads: int, autotune: bool = False):
    import rocs_compiler as rocs

    torch.set_num_threads(threads)
    entry = _entry(name)
    example = entry.make_batch([4, 3], seed=1).replicated()
    return rocs.compile(
        build_model(name),
        list(entry.request_inputs),
        example_kwargs=example,
        options={"autotune": autotune},
    )


# -- load ----------------------------------------------------------------------------------------


def request_pool(name: str, size: int, low: int, high: int, users: int, seed: int) -> list[dict]:
    """``size`` requests: Zipf-drawn users (one row of request features each) and log-uniform
    candidate counts in ``[low, high]``; bodies of tensors, as the Python path takes them."""
    entry = _entry(name)
    g = torch.Generator().manual_seed(seed)
    counts = torch.exp(torch.empty(size).uniform_(math.log(low), math.log(high), generator=g))
    counts = [int(c) for c in counts.round()]
    candidates = entry.make_batch(counts, seed=seed)
    people = entry.make_batch([1] * users, seed=seed + 1)
    ranks = torch.arange(1, users + 1, dtype=torch.float64)
    user_of = torch.multinomial(1 / ranks, size, replacement=True, generator=g).tolist()
    flat_c, flat_u = _flat(candidates.kwargs), _flat(people.kwargs)
    requests = set(_request_leaves(entry, flat_u))
    index = candidates.candidate_to_request
    bodies = []
    for r, user in enumerate(user_of):
        rows = (index == r).nonzero().flatten()
        bodies.append(
            {
                "request": {n: v[user] for n, v in flat_u.items() if n in requests},
                "candidates": {n: v[rows] for n, v in flat_c.items() if n not in requests},
            }
        )
    return bodies


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _request_leaves(entry, leaves: dict) -> list[str]:
    return [n for n in leaves if any(n == r or n.startswith(r + ".") for r in entry.request_inputs)]


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def closed_loop(handle, pool, clients: int, duration: float, cap: int) -> dict:
    latencies, candidates = [], 0
    sent = 0
    end = time.perf_counter() + duration

    async def client(k: int):
        nonlocal sent, candidates
        i = k
        while time.perf_counter() < end and sent < cap:
            sent += 1
            body = pool[i % len(pool)]
            start = time.perf_counter()
            await handle.score.remote(body)
            latencies.append(time.perf_counter() - start)
            candidates += body_candidates(body)
            i += clients

    start = time.perf_counter()
    await asyncio.gather(*(client(k) for k in range(clients)))
    elapsed = time.perf_counter() - start
    return _summary(latencies, candidates, elapsed)


async def open_loop(handle, pool, rate: float, duration: float, cap: int, seed: int) -> dict:
    """Poisson arrivals at ``rate`` per second for ``duration`` seconds (at most ``cap``)."""
    g = torch.Generator().manual_seed(seed)
    count = min(cap, max(1, int(rate * duration)))
    gaps = torch.empty(count).exponential_(rate, generator=g).tolist()
    latencies, candidates = [], 0

    async def one(body):
        nonlocal candidates
        start = time.perf_counter()
        await handle.score.remote(body)
        latencies.append(time.perf_counter() - start)
        candidates += body_candidates(body)

    tasks = []
    start = time.perf_counter()
    due = start
    for i, gap in enumerate(gaps):
        due += gap
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(pool[i % len(pool)])))
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=max(60.0, 4 * duration))
    return _summary(latencies, candidates, time.perf_counter() - start)


def body_candidates(body: dict) -> int:
    return int(next(iter(body["candidates"].values())).shape[0])


def _summary(latencies: list[float], candidates: int, elapsed: float) -> dict:
    return {
        "requests": len(latencies),
        "qps": len(latencies) / elapsed,
        "candidates_per_s": candidates / elapsed,
        "p50_ms": 1000 * _quantile(latencies, 0.5),
        "p99_ms": 1000 * _quantile(latencies, 0.99),
    }


def max_qps_under_slo(handle, pool, start_rate, args) -> float:
    """The highest rate tried whose p99 is under the SLO (0 when none is)."""
    best, rate = 0.0, start_rate
    for step in range(args.steps):
        result = asyncio.run(open_loop(handle, pool, rate, args.duration, args.max_requests, step))
        if result["p99_ms"] > args.slo_ms:
            break
        best = rate
        rate *= 1.5
    return best


# -- one model -----------------------------------------------------------------------------------


def bare_times(name: str, pool, args) -> dict:
    """In-process: one request alone through the compiled call (p50), and a packed batch of
    ``--batch-requests`` requests through the original and the compiled call."""
    from rocs_compiler.serving.packing import pack
    from rocs_compiler.serving.served import served_model

    served = served_model(build_compiled(name, args.threads, args.autotune))
    checked = [served.schema.check(b) for b in pool]

    def timed(fn, repeats):
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    singles = [pack(served.schema, [c]) for c in checked[: args.overhead_requests]]
    for p in singles[:3]:
        served(p)
    alone = statistics.median(timed(lambda p=p: served(p), 3) for p in singles)
    batch = pack(served.schema, checked[: args.batch_requests])
    for _ in range(2):
        served(batch), served(batch, plain=True)
    plain = timed(lambda: served(batch, plain=True), args.repeats)
    shared = timed(lambda: served(batch), args.repeats)
    return {"alone_ms": 1000 * alone, "in_process_speedup": plain / shared}


def measure_model(name: str, args) -> dict:
    from ray import serve

    from rocs_compiler.serving import launch
    from rocs_compiler.serving.deployment import deployment
    from rocs_compiler.serving.settings import ServeSettings

    pool = request_pool(
        name, args.pool, args.min_candidates, args.max_candidates, args.users, args.seed
    )
    bare = bare_times(name, pool, args)
    factory = functools.partial(build_compiled, name, args.threads, args.autotune)
    common = {
        "max_batch_candidates": args.max_batch_candidates,
        "batch_wait_ms": args.batch_wait_ms,
        "threads": args.threads,
        "replica_cpus": 0,
    }
    variants = {
        "per request": ServeSettings(plain=True, max_batch_requests=1, **common),
        "plain packed": ServeSettings(plain=True, **common),
        "rocs packed": ServeSettings(**common),
    }
    rows = {}
    fixed_qps = args.fixed_qps
    for variant, settings in variants.items():
        app_name = f"{name}-{variant.replace(' ', '-')}"
        handle = launch.run(
            deployment(factory, settings, name=app_name), name=app_name, route_prefix=f"/{app_name}"
        )
        for body in pool[:4]:
            handle.score.remote(body).result()  # warm up (and the program choice's first calls)
        run = asyncio.run
        run(closed_loop(handle, pool, args.clients, min(args.duration, 2.0), args.max_requests))
        row = run(closed_loop(handle, pool, args.clients, args.duration, args.max_requests))
        if fixed_qps is None:
            fixed_qps = max(1.0, row["qps"] / 2)
        start = max(1.0, row["qps"] / 4)
        row["max_qps_slo"] = max_qps_under_slo(handle, pool, start, args)
        fixed = run(open_loop(handle, pool, fixed_qps, args.duration, args.max_requests, 99))
        row["fixed_qps"], row["fixed_p50_ms"], row["fixed_p99_ms"] = (
            fixed_qps,
            fixed["p50_ms"],
            fixed["p99_ms"],
        )
        if variant == "rocs packed":
            handle.stats.remote(reset=True).result()
            one = run(
                closed_loop(
                    handle,
                    pool[: args.overhead_requests],
                    1,
                    args.duration,
                    args.overhead_requests * 3,
                )
            )
            inside = handle.stats.remote().result()
            row["overhead_ms"] = one["p50_ms"] - bare["alone_ms"]
            # in the replica, beyond the model call: check, batch queue, pack, split
            row["replica_overhead_ms"] = inside["replica_ms_p50"] - inside["call_ms_p50"]
        rows[variant] = row
        serve.delete(app_name)
    served_speedup = rows["rocs packed"]["qps"] / rows["plain packed"]["qps"]
    return {"model": name, "rows": rows, "bare": bare, "served_speedup": served_speedup}


def table(results: list[dict], args) -> str:
    head = (
        f"| model | variant | closed-loop QPS | candidates/s | p50 / p99 ms | max QPS at p99 < "
        f"{args.slo_ms:g} ms | p50 / p99 ms at fixed QPS | notes |"
    )
    lines = [head, "|" + "---|" * 8]
    for result in results:
        for variant, row in result["rows"].items():
            note = ""
            if variant == "rocs packed":
                note = (
                    f"served {result['served_speedup']:.2f}x over plain packed; in-process "
                    f"{result['bare']['in_process_speedup']:.2f}x; overhead "
                    f"{row['overhead_ms']:.1f} ms at p50 over the bare call, of which "
                    f"{row['replica_overhead_ms']:.1f} ms in the replica"
                )
            cells = [
                result["model"],
                variant,
                f"{row['qps']:.1f}",
                f"{row['candidates_per_s']:.0f}",
                f"{row['p50_ms']:.1f} / {row['p99_ms']:.1f}",
                f"{row['max_qps_slo']:.1f}",
                f"{row['fixed_p50_ms']:.1f} / {row['fixed_p99_ms']:.1f} at {row['fixed_qps']:.1f}",
                note,
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--models", nargs="+", default=MODELS, choices=MODELS)
    add("--duration", type=float, default=5.0, help="seconds per load phase (default 5)")
    add("--max-requests", type=int, default=20000, help="requests per load phase, at most")
    add("--clients", type=int, default=8, help="closed-loop clients (default 8)")
    add("--steps", type=int, default=5, help="open-loop rates tried for the SLO (default 5)")
    add("--slo-ms", type=float, default=100.0)
    add("--fixed-qps", type=float, default=None)
    add("--min-candidates", type=int, default=50)
    add("--max-candidates", type=int, default=2000)
    add("--users", type=int, default=1000, help="distinct users, Zipf-distributed")
    add("--pool", type=int, default=64, help="distinct requests cycled through")
    add("--batch-requests", type=int, default=8, help="requests of the in-process batch")
    add("--overhead-requests", type=int, default=8)
    add("--repeats", type=int, default=10)
    add("--max-batch-candidates", type=int, default=8192)
    add("--batch-wait-ms", type=float, default=2.0)
    add("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    add("--cpus", type=int, default=None, help="CPUs of the local Ray (default: all)")
    add("--seed", type=int, default=0)
    add(
        "--autotune",
        action="store_true",
        help="keep the program choice on (its first ~12 calls per batch-size bucket alternate "
        "two programs, which a short run mostly measures)",
    )
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    from rocs_compiler.serving import launch

    launch.start(launch.free_port(), num_cpus=args.cpus, pythonpath=[str(ROOT)])
    try:
        results = []
        for name in args.models:
            print(f"[serving] {name} ...", file=sys.stderr, flush=True)
            results.append(measure_model(name, args))
    finally:
        launch.stop()
    print(table(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
