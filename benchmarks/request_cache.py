"""The request cache: speedup over the same compiled model without it, against the hit rate.

For each model, one compiled model (program choice off, so both variants run the shared
program) is called on a bank of serving calls of R requests with N candidates each. A request
is, with probability ``hit``, a user already in the cache (drawn Zipf-distributed over a warm
pool that was put in the cache before timing), else a user never seen. Per call, in
alternating order, the time with the cache (``RequestCache(autotune=False)``: always on) and
without it (the same compiled model with the cache detached); means over the bank without its
highest and lowest call (``trimmed_mean``: a cached call's time falls in two groups, calls whose
rows all hit and calls with a miss, and a serving stack pays their mean), thread CPU time with
one torch thread. Also per model:

- ``entry KB``: the cache's bytes per request (boundary values and key);
- ``break-even``: the hit rate where the speedup crosses 1 (linear between swept points);
- ``choice``: whether the program choice (``RequestCache(autotune=True)``) kept the cache at
  that hit rate, after its warm-up and trials on the same kind of calls;
- ``zipf hit``: the hit rate an LRU cache of ``--budget-mb`` reaches on a stream of users
  Zipf-distributed (skew ``--skew``) over ``--users`` users, simulated with the entry size;
- ``state checks us``: what a call spends finding out that nothing it reads moved (the weight
  refresh's version counters and data pointers, and the byte comparison of the buffers the
  request program reads, ``runtime/follow/content_watch.py``), with the number of those buffers.

Usage::

    python benchmarks/request_cache.py
    python benchmarks/request_cache.py --models two_tower --hits 0 0.8 --calls 20
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time
from collections import OrderedDict

import torch

import rocs_compiler as rocs
from models_zoo import ZOO
from models_zoo.batch import get_leaf, set_leaf
from rocs_compiler.runtime.cache import request_cache
from rocs_compiler.runtime.cache.request_cache import trimmed_mean

MODELS = ["two_tower", "din", "target_attention", "hstu"]


def zipf_sampler(population: int, skew: float, rng: random.Random):
    weights = [1.0 / (k + 1) ** skew for k in range(population)]
    cumulative, total = [], 0.0
    for w in weights:
        total += w
        cumulative.append(total)
    return lambda: rng.choices(range(population), cum_weights=cumulative)[0]


class Users:
    """Request rows per user id, made once (``make_batch`` with the id as seed)."""

    def __init__(self, entry):
        self.entry, self.rows = entry, {}

    def row(self, user: int) -> dict:
        if user not in self.rows:
            batch = self.entry.make_batch([1], seed=1000 + user)
            self.rows[user] = {n: get_leaf(batch.kwargs, n) for n in self.entry.request_inputs}
        return self.rows[user]

    def batch(self, users: list[int], candidates: int, seed: int):
        batch = self.entry.make_batch([candidates] * len(users), seed=seed)
        for name in self.entry.request_inputs:
            set_leaf(batch.kwargs, name, torch.cat([self.row(u)[name] for u in users]))
        return batch


def make_bank(users: Users, hit: float, args, rng: random.Random, fresh: list[int]) -> list:
    draw = zipf_sampler(args.warm, args.skew, rng)
    bank = []
    for call in range(args.calls):
        picked = []
        for _ in range(args.requests):
            if rng.random() < hit:
                picked.append(draw())
            else:
                fresh[0] += 1
                picked.append(fresh[0])
        bank.append(users.batch(picked, args.candidates, seed=call))
    return bank


def call(cm, batch):
    return cm(**batch.kwargs, candidate_to_request=batch.candidate_to_request)


def warm_up(cm, users: Users, warm: int, requests: int) -> None:
    for start in range(0, warm, requests):
        call(cm, users.batch(list(range(start, min(start + requests, warm))), 1, seed=start))


def zipf_hit_rate(users: int, skew: float, capacity: int, draws: int, seed: int) -> float:
    """Hit rate of an LRU cache of ``capacity`` entries on a Zipf stream (simulated)."""
    rng = random.Random(seed)
    ranks = list(range(users))
    rng.shuffle(ranks)  # user ids unrelated to popularity
    weights = [1.0 / (k + 1) ** skew for k in range(users)]
    stream = rng.choices(ranks, weights=weights, k=draws)
    lru, hits = OrderedDict(), 0
    for i, user in enumerate(stream):
        if user in lru:
            lru.move_to_end(user)
            hits += i >= draws // 2  # the second half: a warm cache
        else:
            lru[user] = None
            if len(lru) > capacity:
                lru.popitem(last=False)
    return hits / (draws - draws // 2)


def state_checks(cm, graph) -> tuple[float, int]:
    """Microseconds per call of the checks that no state the request program reads moved (thread
    CPU time, median of 5 rounds of 2000), and how many buffers are compared by content."""
    weights = cm._weights
    watch = graph._watch_of(weights, cm._graph_runner())

    def check():
        weights.current()
        watch.changed()

    rounds = []
    for _ in range(5):
        start = time.thread_time()
        for _ in range(2000):
            check()
        rounds.append((time.thread_time() - start) / 2000 * 1e6)
    buffers = sum(len(views) + len(loose) for views, loose, *_ in watch._groups)
    return sorted(rounds)[2], buffers


def measure(name: str, args) -> list[dict]:
    entry = ZOO[name]
    model = entry.build(seed=0)
    example = entry.make_batch([4, 3]).replicated()
    compile_args = (model, list(entry.request_inputs))
    cm = rocs.compile(*compile_args, example_kwargs=example, options={"autotune": False})
    users = Users(entry)
    rows, fresh = [], [10**6]
    for hit in args.hits:
        rng = random.Random(int(hit * 1000))
        cache = rocs.RequestCache(args.budget_mb << 20, autotune=False)
        request_cache.attach(cm, cache)
        graph = cm._cache  # switched on and off below without building it again
        warm_up(cm, users, args.warm, args.requests)
        bank = make_bank(users, hit, args, rng, fresh)
        before = cache.stats()
        on, off = [], []
        for i, batch in enumerate(bank):
            order = [(graph, on), (None, off)]
            for cached, samples in order if i % 2 else order[::-1]:
                object.__setattr__(cm, "_cache", cached)
                start = time.thread_time()
                call(cm, batch)
                samples.append(time.thread_time() - start)
        stats = cache.stats()
        hits, misses = stats["hits"] - before["hits"], stats["misses"] - before["misses"]
        checks = state_checks(cm, graph)
        choice = chosen(cm, users, hit, args)
        request_cache.attach(cm, None)
        rows.append(
            {
                "model": name,
                "hit": hit,
                "measured_hit": hits / max(1, hits + misses),
                "off_ms": trimmed_mean(off) * 1e3,
                "on_ms": trimmed_mean(on) * 1e3,
                "entry_kb": stats["bytes"] / max(1, stats["entries"]) / 1024,
                "choice": choice,
                "checks": checks,
            }
        )
        rows[-1]["speedup"] = rows[-1]["off_ms"] / rows[-1]["on_ms"]
    return rows


def chosen(cm, users: Users, hit: float, args) -> str:
    """What the program choice keeps for these calls: "on" or "off"."""
    cache = rocs.RequestCache(args.budget_mb << 20, autotune=True)
    request_cache.attach(cm, cache)
    warm_up(cm, users, args.warm, args.requests)
    rng = random.Random(7 + int(hit * 1000))
    fresh = [5 * 10**6 + int(hit * 10**5)]
    settle = request_cache.WARMUP + 2 * request_cache.CACHE_TRIALS + 2
    saved = args.calls
    args.calls = settle
    bank = make_bank(users, hit, args, rng, fresh)
    args.calls = saved
    before = cm.cache_stats()["off_buckets"]
    for batch in bank:
        call(cm, batch)
    return "off" if len(cm.cache_stats()["off_buckets"]) > len(before) else "on"


def break_even(rows: list[dict]) -> str:
    for a, b in itertools.pairwise(rows):
        if a["speedup"] < 1.0 <= b["speedup"]:
            t = (1.0 - a["speedup"]) / (b["speedup"] - a["speedup"])
            return f"{a['hit'] + t * (b['hit'] - a['hit']):.2f}"
    return "< " + f"{rows[0]['hit']:.2f}" if rows[0]["speedup"] >= 1.0 else "none"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--hits", nargs="+", type=float, default=[0.0, 0.25, 0.5, 0.8, 0.95, 1.0])
    parser.add_argument("--requests", type=int, default=8, help="R per call")
    parser.add_argument("--candidates", type=int, default=256, help="per request")
    parser.add_argument("--calls", type=int, default=30, help="timed calls per hit rate")
    parser.add_argument("--warm", type=int, default=256, help="users in the cache before timing")
    parser.add_argument("--skew", type=float, default=1.1)
    parser.add_argument("--users", type=int, default=100_000)
    parser.add_argument("--budget-mb", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"R = {args.requests} requests x {args.candidates} candidates, {args.calls} calls per "
        f"point, {args.threads} torch thread(s), thread CPU time, trimmed means"
    )
    print("| model | hit rate | measured | without cache ms | with cache ms | speedup | choice |")
    print("|---|---:|---:|---:|---:|---:|---|")
    summary = []
    with torch.no_grad():
        for name in args.models:
            rows = measure(name, args)
            for r in rows:
                print(
                    f"| {name} | {r['hit']:.2f} | {r['measured_hit']:.2f} | {r['off_ms']:.2f} | "
                    f"{r['on_ms']:.2f} | {r['speedup']:.2f}x | {r['choice']} |",
                    flush=True,
                )
            entry_kb = max(r["entry_kb"] for r in rows)
            capacity = int((args.budget_mb << 20) / (entry_kb * 1024))
            zipf = zipf_hit_rate(args.users, args.skew, capacity, 200_000, seed=1)
            check_us = statistics.median(r["checks"][0] for r in rows)
            check = f"{check_us:.1f} ({rows[0]['checks'][1]} buffers)"
            summary.append((name, entry_kb, break_even(rows), capacity, zipf, check))
    print()
    print(f"| model | entry KB | break-even hit rate | entries in {args.budget_mb} MB | "
          f"Zipf({args.skew}) hit rate over {args.users} users | state checks us |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|")
    for name, kb, even, capacity, zipf, check in summary:
        print(f"| {name} | {kb:.1f} | {even} | {capacity} | {zipf:.2f} | {check} |")


if __name__ == "__main__":
    main()
