"""Serving benchmark: one model served three ways on the same local Ray Serve, and the transport
measured apart with a no-op model.

- ``per request``: the original model, one request per call (``plain``, ``max_batch_requests=1``);
- ``plain packed``: the original model on the same packing as ``rocs``, request rows replicated to
  the candidates (``plain``);
- ``rocs packed``: the compiled model, requests packed into the shared layout;
- ``no-op``: the same fields, checks, packing and splitting, and a model that returns zeros: what
  the server costs around any model.

Load, through the Python path (deployment handles, no JSON) on 127.0.0.1 only: requests from a
pool whose users are Zipf-distributed and whose candidates per request are log-uniform in
``[--min-candidates, --max-candidates]``. The numbers, framed so they mean the same on any
machine (a two-core machine's Ray proxy alone costs tens of milliseconds a request):

(a) **model compute**, inside the replica, no transport: the model call's time per candidate
    while an open-loop Poisson load runs at ``--fixed-qps`` (default half the per-request
    variant's closed-loop QPS); the ratio plain packed / rocs packed, next to the in-process
    speedup of the compiled call over the original one (bare calls, no server, interleaved) on
    the batches the rocs replica formed at that rate (their sizes set the share of each call's
    fixed cost), and on batches of ``--batch-requests`` requests of the mix. Goal: at least 0.9
    of the in-process speedup on the same batches.
(b) **requests/s and candidates/s at a p99 of ``--slo-ms``** (60): open-loop Poisson arrivals at
    rates stepped up by 1.5x from a quarter of the closed-loop QPS (at most ``--steps`` rates,
    ``--duration`` seconds each); the highest rate whose p99 stays under the SLO, and the
    candidates/s it scored.
(c) **transport**, stated apart: one request of ``--overhead-candidates`` (270: MLPerf's ranking
    queries' mean) at a time to the no-op model, through the handle and over HTTP (JSON); the
    client's p50 minus the replica's p50 is the fixed cost per request of Ray's routing (and
    the proxy and JSON, over HTTP).
(d) **in-replica cost outside the model call** for one request of 270 candidates at a time
    (``rocs packed``): its check, packing and splitting, p50, with the batch wait
    (``--batch-wait-ms``, spent waiting for company that does not come) apart. Goal: under 1 ms.

The compiled model is built with ``autotune`` off (``--autotune`` keeps it): with it on, the first
calls of every power-of-two bucket of (candidates, requests) alternate the shared and the plain
program (``runtime/choice/program_choice.py``), and a packed server sees many buckets, so a run of
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


def build_noop(name: str, threads: int):
    """The model's fields, checks and packing around a model that returns zeros."""
    from rocs_compiler.serving.served import ServedModel, served_model

    schema = served_model(build_compiled(name, threads)).schema

    def zeros(packed):
        return torch.zeros(packed.num_candidates)

    return ServedModel("no-op", schema, zeros, None, "no-op")


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


def max_qps_under_slo(handle, pool, start_rate, args) -> dict:
    """The open-loop run at the highest rate tried whose p99 is under the SLO (rate 0 and no
    requests when none is)."""
    best = {"rate": 0.0, "qps": 0.0, "candidates_per_s": 0.0, "p99_ms": float("nan")}
    rate = start_rate
    for step in range(args.steps):
        result = asyncio.run(open_loop(handle, pool, rate, args.duration, args.max_requests, step))
        if result["p99_ms"] > args.slo_ms:
            break
        best = {"rate": rate, **result}
        rate *= 1.5
    return best


def one_at_a_time(handle, pool, args) -> dict:
    """One client, one request at a time, ``--overhead-requests`` x 3 requests at most: the
    client's p50 and the replica's own account of the same requests (``Scorer.stats``)."""
    handle.stats.remote(reset=True).result()
    cap = args.overhead_requests * 3
    client = asyncio.run(closed_loop(handle, pool, 1, args.duration, cap))
    return {"client_p50_ms": client["p50_ms"], **handle.stats.remote().result()}


def http_one_at_a_time(url: str, pool, args) -> float:
    """The client's p50 of one JSON request at a time over HTTP (bodies encoded beforehand)."""
    import json
    import urllib.request

    bodies = [json.dumps(_jsonable(b)).encode() for b in pool]
    times = []
    end = time.perf_counter() + args.duration
    for i in range(args.overhead_requests * 3):
        if time.perf_counter() > end:
            break
        request = urllib.request.Request(
            url, data=bodies[i % len(bodies)], headers={"Content-Type": "application/json"}
        )
        start = time.perf_counter()
        with urllib.request.urlopen(request, timeout=60) as answer:
            answer.read()
        times.append(time.perf_counter() - start)
    return 1000 * _quantile(times, 0.5)


def _jsonable(body: dict) -> dict:
    return {part: {n: v.tolist() for n, v in rows.items()} for part, rows in body.items()}


# -- one model -----------------------------------------------------------------------------------


class InProcess:
    """The compiled model's served form in this process, no server: the in-process speedup of
    the compiled call over the original one (``plain``) on packed batches."""

    def __init__(self, name: str, pool, args):
        from rocs_compiler.serving.served import served_model

        self.served = served_model(build_compiled(name, args.threads, args.autotune))
        self.checked = [self.served.schema.check(b) for b in pool]
        self.by_count = {r.num_candidates: r for r in self.checked}
        self.repeats = args.repeats

    def speedup(self, batches: list[list[int]]) -> float:
        """Summed over ``batches`` (each the candidate counts of its requests, as a replica's
        ``stats()["recent"]`` lists them, built from the pool's requests of those counts): the
        original call's time over the compiled call's, each the median of ``repeats`` calls
        interleaved with the other's."""
        from rocs_compiler.serving.packing import pack

        served = self.served
        packed = [pack(served.schema, [self.by_count[n] for n in counts]) for counts in batches]
        for batch in packed[:4]:
            served(batch), served(batch, plain=True)
        plain = shared = 0.0
        for batch in packed:
            plains, shareds = [], []  # interleaved, so that a load change hits both alike
            for _ in range(self.repeats):
                plains.append(_timed(lambda: served(batch, plain=True)))
                shareds.append(_timed(lambda: served(batch)))
            plain += statistics.median(plains)
            shared += statistics.median(shareds)
        return plain / shared

    def mix(self, requests: int) -> list[list[int]]:
        """Batches of ``requests`` consecutive requests of the pool."""
        counts = [r.num_candidates for r in self.checked]
        return [counts[i : i + requests] for i in range(0, len(counts) - requests + 1, requests)]


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure_model(name: str, args) -> dict:
    from ray import serve

    from rocs_compiler.serving import launch
    from rocs_compiler.serving.deployment import deployment
    from rocs_compiler.serving.settings import ServeSettings

    pool = request_pool(
        name, args.pool, args.min_candidates, args.max_candidates, args.users, args.seed
    )
    fixed = args.overhead_candidates
    singles = request_pool(name, args.overhead_requests, fixed, fixed, args.users, args.seed + 7)
    in_process = InProcess(name, pool, args)
    model = functools.partial(build_compiled, name, args.threads, args.autotune)
    common = {
        "max_batch_candidates": args.max_batch_candidates,
        "batch_wait_ms": args.batch_wait_ms,
        "threads": args.threads,
        "replica_cpus": 0,
    }
    variants = {
        "per request": (model, ServeSettings(plain=True, max_batch_requests=1, **common)),
        "plain packed": (model, ServeSettings(plain=True, **common)),
        "rocs packed": (model, ServeSettings(**common)),
        "no-op": (functools.partial(build_noop, name, args.threads), ServeSettings(**common)),
    }
    rows = {}
    fixed_qps = args.fixed_qps
    for variant, (factory, settings) in variants.items():
        app_name = f"{name}-{variant.replace(' ', '-')}"
        handle = launch.run(
            deployment(factory, settings, name=app_name), name=app_name, route_prefix=f"/{app_name}"
        )
        for body in pool[:4]:
            handle.score.remote(body).result()  # warm up (and the program choice's first calls)
        run = asyncio.run
        row = {}
        if variant != "no-op":
            run(closed_loop(handle, pool, args.clients, min(args.duration, 2.0), args.max_requests))
            row = run(closed_loop(handle, pool, args.clients, args.duration, args.max_requests))
            if fixed_qps is None:
                fixed_qps = max(1.0, row["qps"] / 2)
            row["slo"] = max_qps_under_slo(handle, pool, max(1.0, row["qps"] / 4), args)
            handle.stats.remote(reset=True).result()
            at_fixed = run(open_loop(handle, pool, fixed_qps, args.duration, args.max_requests, 99))
            inside = handle.stats.remote().result()
            row["batches"] = [counts for counts in inside["recent"] if counts]
            row["fixed"] = {**at_fixed, "qps_target": fixed_qps}
            row["model_us_per_candidate"] = 1e6 * inside["model_s"] / max(inside["candidates"], 1)
        if variant in ("rocs packed", "no-op"):
            row["alone"] = one_at_a_time(handle, singles, args)
        if variant == "no-op":
            row["http_p50_ms"] = http_one_at_a_time(
                f"http://127.0.0.1:{args.port}/{app_name}/score", singles, args
            )
        rows[variant] = row
        serve.delete(app_name)
    per_candidate = {v: row.get("model_us_per_candidate") for v, row in rows.items()}
    compute = per_candidate["plain packed"] / per_candidate["rocs packed"]
    bare = {
        # on the batches the rocs replica formed at the fixed rate (their sizes set the share of
        # fixed per-call cost), and on batches of --batch-requests requests of the mix
        "served_batches_speedup": in_process.speedup(rows["rocs packed"]["batches"]),
        "in_process_speedup": in_process.speedup(in_process.mix(args.batch_requests)),
        "requests_per_batch": statistics.mean(map(len, rows["rocs packed"]["batches"])),
    }
    return {"model": name, "rows": rows, "bare": bare, "compute_ratio": compute}


def table(results: list[dict], args) -> str:
    """The (a)-(d) tables of the module docstring."""
    slo = f"{args.slo_ms:g}"
    lines = [
        "(a) model compute in the replica (no transport), at a fixed open-loop rate; in-process:",
        "the same calls without a server, on the batches the rocs replica formed and on batches",
        f"of {args.batch_requests} requests",
        "",
        "| model | plain packed us/candidate | rocs packed us/candidate | ratio | requests per "
        "batch | in-process on those batches | ratio / in-process | in-process, "
        f"{args.batch_requests} requests |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        plain = r["rows"]["plain packed"]["model_us_per_candidate"]
        rocs_ = r["rows"]["rocs packed"]["model_us_per_candidate"]
        bare = r["bare"]
        same = bare["served_batches_speedup"]
        lines.append(
            f"| {r['model']} | {plain:.2f} | {rocs_:.2f} | {r['compute_ratio']:.2f}x | "
            f"{bare['requests_per_batch']:.1f} | {same:.2f}x | {r['compute_ratio'] / same:.2f} | "
            f"{bare['in_process_speedup']:.2f}x |"
        )
    lines += [
        "",
        f"(b) open-loop Poisson arrivals: the highest rate tried with p99 < {slo} ms",
        "",
        f"| model | variant | requests/s at p99 < {slo} ms | candidates/s | p99 ms there | "
        f"closed-loop QPS ({args.clients} clients) | p50 / p99 ms at fixed QPS |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for variant, row in r["rows"].items():
            if "slo" not in row:
                continue
            slo_row, fixed = row["slo"], row["fixed"]
            lines.append(
                f"| {r['model']} | {variant} | {slo_row['qps']:.1f} | "
                f"{slo_row['candidates_per_s']:.0f} | {slo_row['p99_ms']:.1f} | {row['qps']:.1f} | "
                f"{fixed['p50_ms']:.1f} / {fixed['p99_ms']:.1f} at {fixed['qps_target']:.1f} |"
            )
    n = args.overhead_candidates
    lines += [
        "",
        f"(c) transport and (d) the replica's own work, one request of {n} candidates at a time",
        "",
        "| model | no-op: handle p50 ms | no-op: in replica p50 ms | transport, handle ms | "
        "transport, HTTP ms | rocs: check+pack+split p50 ms | rocs: model call p50 ms | "
        "batch wait ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        noop, rocs_ = r["rows"]["no-op"]["alone"], r["rows"]["rocs packed"]["alone"]
        http = r["rows"]["no-op"]["http_p50_ms"]
        lines.append(
            f"| {r['model']} | {noop['client_p50_ms']:.2f} | {noop['replica_ms_p50']:.2f} | "
            f"{noop['client_p50_ms'] - noop['replica_ms_p50']:.2f} | "
            f"{http - noop['replica_ms_p50']:.2f} | {rocs_['outside_ms_p50']:.3f} | "
            f"{rocs_['call_ms_p50']:.2f} | {args.batch_wait_ms:g} |"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--models", nargs="+", default=MODELS, choices=MODELS)
    add("--duration", type=float, default=5.0, help="seconds per load phase (default 5)")
    add("--max-requests", type=int, default=20000, help="requests per load phase, at most")
    add("--clients", type=int, default=8, help="closed-loop clients (default 8)")
    add("--steps", type=int, default=5, help="open-loop rates tried for the SLO (default 5)")
    add("--slo-ms", type=float, default=60.0)
    add("--fixed-qps", type=float, default=None)
    add("--min-candidates", type=int, default=50)
    add("--max-candidates", type=int, default=2000)
    add("--users", type=int, default=1000, help="distinct users, Zipf-distributed")
    add("--pool", type=int, default=64, help="distinct requests cycled through")
    add("--batch-requests", type=int, default=8, help="requests of the in-process batch")
    add("--overhead-requests", type=int, default=8)
    add("--overhead-candidates", type=int, default=270, help="candidates of (c) and (d)'s requests")
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

    args.port = launch.free_port()
    launch.start(args.port, num_cpus=args.cpus, pythonpath=[str(ROOT)])
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
