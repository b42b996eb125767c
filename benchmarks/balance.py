"""Balanced data parallelism: the bubble of 2 real DDP ranks with random, equal-count and
equal-cost request assignment, and the bubble the cost model predicts at 8, 64 and 256 ranks.

    python benchmarks/balance.py [--steps 6] [--requests 16] [--sim-steps 20]

**Measured** (2 ranks, gloo on 127.0.0.1, one torch thread each): DIN (``models_zoo/din.py``,
eval mode so that no batch statistic depends on the split) compiled for training with its history
length marked dynamic, ``DDP(cm)``, SGD at learning rate 0. Each rank's loader draws
``--requests`` requests per step: history lengths log-normal, median 60, clipped to 8..2048, padded
to the rank's longest; 1..64 impressions per request. Every policy trains on the same loaded
batches, interleaved step by step (background load hits all three alike), each with its next
batch's exchange started before its step (``balancer.start``), so the exchange overlaps it:

- ``random``: ``policy="keep"``, every request stays where the loader put it;
- ``count``: equal request counts (sorted by cost and dealt);
- ``cost``: equal predicted cost (``docs/distributed.md``, "Balanced data parallelism");
- ``same batch (noise floor)``: both ranks train on rank 0's batch: the bubble that timing noise
  alone makes (a perfect balance measures this much).

Per step and rank: **compute**, the calling thread's CPU time of forward, backward and the SGD
step (DDP's all-reduce runs on gloo's threads, and a wait takes no CPU); the **exposed exchange**,
wall time in ``start`` (costs gathered, partition, packing) and ``wait`` (what of the all-to-all
the step did not hide). **Bubble fraction** = sum over steps of (slowest rank - mean rank) / sum
of slowest, of compute; **steps/s** = steps / rank 0's wall time of its steps and exchanges.

**Simulated**: the same draws at ``--ranks`` ranks with ``--sim-requests`` requests each, loads
predicted by the cost model (``flops_cost`` of the compiled DIN), ranks running padded histories
(the training call) and jagged ones (each request at its own length).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import rocs_compiler as rocs
from models_zoo import din

WORLD = 2
HISTORIES = ("hist_item_ids", "hist_cat_ids")
POLICIES = {"random": "keep", "count": "count", "cost": "cost"}
# Not an assignment: both ranks train on rank 0's batch, the bubble of timing noise alone.
SAME = "same batch (noise floor)"


def draw_lengths(rng: np.random.Generator, count: int) -> np.ndarray:
    """History lengths: log-normal with median 60, clipped to 8..2048."""
    return np.clip(np.round(np.exp(rng.normal(np.log(60), 1.0, count))), 8, 2048).astype(np.int64)


def draw_batch(rank: int, step: int, requests: int, impressions: int):
    """A rank's loaded batch (a ``rocs.RequestBatch``, shared layout, labels included)."""
    rng = np.random.default_rng([rank, step])
    g = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    lengths = torch.from_numpy(draw_lengths(rng, requests))
    counts = torch.from_numpy(rng.integers(1, impressions + 1, requests))
    width = int(lengths.max())
    pad = torch.arange(width) >= lengths[:, None]
    index = torch.repeat_interleave(torch.arange(requests), counts)
    n = index.shape[0]
    request = {
        "user_profile": torch.stack(
            [torch.randint(1, v, (requests,), generator=g) for v in din.PROFILE_VOCABS], 1
        ),
        "hist_item_ids": torch.randint(1, din.NUM_ITEMS, (requests, width), generator=g),
        "hist_cat_ids": torch.randint(1, din.NUM_CATS, (requests, width), generator=g),
    }
    for name in HISTORIES:
        request[name] = request[name].masked_fill(pad, 0)
    candidate = {
        "item_id": torch.randint(1, din.NUM_ITEMS, (n,), generator=g),
        "item_cat": torch.randint(1, din.NUM_CATS, (n,), generator=g),
        "label": torch.randint(0, 2, (n,), generator=g).float(),
    }
    return rocs.RequestBatch(request, candidate, index)


def compiled_din():
    model = din.build(seed=0).eval()
    example = din.make_batch([4, 3]).replicated()
    for name in HISTORIES:
        torch._dynamo.mark_dynamic(example[name], 1)
    cm = rocs.compile(
        model, list(din.REQUEST_INPUTS), example_kwargs=example, training=True,
        options={"autotune": False},
    )  # fmt: skip
    return cm


def _rank(rank: int, port: int, tmp: str, args) -> None:
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=600))
    try:
        cm = compiled_din()
        ddp = DDP(cm)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.0)
        names = [*POLICIES, SAME]
        balancers = {p: rocs.RequestBalancer(cm, policy=POLICIES.get(p, "keep")) for p in names}
        records = {p: [] for p in names}
        pending = {}

        def start(policy, step):
            begin = time.perf_counter()
            loader = 0 if policy == SAME else rank
            batch = draw_batch(loader, step, args.requests, args.impressions)
            drawn = time.perf_counter()
            pending[policy] = balancers[policy].start(batch)
            return time.perf_counter() - drawn, drawn - begin

        exposed = {p: start(p, 0)[0] for p in names}
        order = random.Random(0)  # both ranks draw the same order: their collectives pair up
        for step in range(args.steps + 1):  # step 0 warms up, uncounted
            policies = list(names)
            order.shuffle(policies)
            for policy in policies:
                begin = time.perf_counter()
                handle = pending.pop(policy)
                local = handle.wait()
                waited = time.perf_counter() - begin
                started = start(policy, step + 1)[0] if step < args.steps else 0.0
                wall, cpu = time.perf_counter(), time.thread_time()
                out = ddp(**local.inputs(leave_out=["label"]))
                losses = F.binary_cross_entropy_with_logits(
                    out, local.candidate["label"], reduction="none"
                )
                local.global_mean(losses).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                cpu = time.thread_time() - cpu
                wall = time.perf_counter() - wall
                if step:
                    records[policy].append({
                        "compute": cpu, "wall": wall + waited + exposed[policy],
                        "exposed": waited + exposed[policy],
                        "predicted": handle.partition.loads.tolist(),
                        "algorithm": handle.partition.algorithm,
                        "requests": local.num_requests, "candidates": local.num_candidates,
                        "width": local.request["hist_item_ids"].shape[1],
                    })  # fmt: skip
                exposed[policy] = started
        torch.save(records, os.path.join(tmp, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def measured(args) -> dict:
    """``{policy: [rank 0's records, rank 1's records]}``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(port, tmp, args), nprocs=WORLD, start_method="spawn")
        ranks = [torch.load(os.path.join(tmp, f"{r}.pt")) for r in range(WORLD)]
    return {p: [ranks[r][p] for r in range(WORLD)] for p in ranks[0]}


def bubble_fraction(per_step: np.ndarray) -> float:
    """``per_step`` [steps, ranks]: sum of (slowest - mean) over sum of slowest."""
    top = per_step.max(1)
    return float((top - per_step.mean(1)).sum() / top.sum())


def measured_table(runs: dict) -> list[str]:
    lines = [
        (
            "| assignment | bubble (measured compute) | reduction vs random | bubble (predicted) "
            "| slowest rank's compute, ms/step | exposed exchange, ms/step | steps/s | requests "
            "per rank | width per rank |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base = None
    for policy, ranks in runs.items():
        compute = np.array([[s["compute"] for s in r] for r in ranks]).T  # [steps, ranks]
        predicted = np.array([s["predicted"] for s in ranks[0]])
        exposed = np.mean([s["exposed"] for r in ranks for s in r])
        wall = sum(s["wall"] for s in ranks[0])
        bubble = bubble_fraction(compute)
        base = bubble if base is None else base
        cut = "" if policy in ("random", SAME) else f"{1 - bubble / base:.0%}"
        requests = "/".join(f"{np.mean([s['requests'] for s in r]):.1f}" for r in ranks)
        widths = "/".join(f"{np.mean([s['width'] for s in r]):.0f}" for r in ranks)
        lines.append(
            f"| {policy} | {bubble:.3f} | {cut} | {bubble_fraction(predicted):.3f} | "
            f"{1e3 * compute.max(1).mean():.0f} | {1e3 * exposed:.1f} | {len(ranks[0]) / wall:.2f} "
            f"| {requests} | {widths} |"
        )
    return lines


def simulated_table(args, cost) -> list[str]:
    from rocs_compiler.distributed.partition import Requests, partition

    (ar, br), (ac, bc) = cost.request, cost.candidate
    lines = [
        (
            "| ranks | histories | random bubble | count bubble | cost bubble | cost's reduction "
            "vs random | slowest rank vs random (count / cost) | costliest request / mean rank "
            "load |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for world in args.ranks:
        rng = np.random.default_rng(world)
        for padded in (True, False):
            bubbles = {p: [] for p in POLICIES}
            tops = {p: [] for p in POLICIES}
            single = []
            for _ in range(args.sim_steps):
                count = world * args.sim_requests
                lengths = draw_lengths(rng, count)
                k = rng.integers(1, args.impressions + 1, count)
                requests = Requests(
                    fixed=ar + k * ac, per_length=br + k * bc, lengths=lengths, candidates=k,
                    home=np.repeat(np.arange(world), args.sim_requests), padded=padded,
                )  # fmt: skip
                for name, policy in POLICIES.items():
                    loads = partition(requests, world, policy).loads
                    bubbles[name].append((loads.max(), loads.mean()))
                    tops[name].append(loads.max())
                single.append(requests.own.max() / (requests.own.sum() / world))
            frac = {}
            for name, pairs in bubbles.items():
                top, mean = np.array(pairs).T
                frac[name] = float((top - mean).sum() / top.sum())
            ratio = [np.sum(tops[p]) / np.sum(tops["random"]) for p in ("count", "cost")]
            lines.append(
                f"| {world} | {'padded' if padded else 'jagged'} | {frac['random']:.3f} | "
                f"{frac['count']:.3f} | {frac['cost']:.4f} | "
                f"{1 - frac['cost'] / frac['random']:.1%} | {ratio[0]:.2f} / {ratio[1]:.2f} | "
                f"{max(single):.3f} |"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="counted steps per policy")
    parser.add_argument("--requests", type=int, default=16, help="requests per rank per step")
    parser.add_argument("--impressions", type=int, default=64, help="most candidates per request")
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--sim-requests", type=int, default=128, help="requests per rank")
    parser.add_argument("--sim-steps", type=int, default=20)
    parser.add_argument("--no-measure", action="store_true", help="the simulation only")
    parser.add_argument("--json", help="also write the measured per-step records here")
    args = parser.parse_args()
    from rocs_compiler.distributed.costs import flops_cost

    cost = flops_cost(compiled_din())
    print(f"cost model (FLOPs): request {cost.request}, candidate {cost.candidate}\n")
    if not args.no_measure:
        begin = time.perf_counter()
        runs = measured(args)
        if args.json:
            Path(args.json).write_text(json.dumps(runs, indent=1))
        print(f"## 2 ranks, measured ({args.steps} steps per policy, {args.requests} requests "
              f"per rank, {time.perf_counter() - begin:.0f} s)\n")  # fmt: skip
        print("\n".join(measured_table(runs)) + "\n")
    print(f"## Simulated ({args.sim_requests} requests per rank, {args.sim_steps} steps)\n")
    print("\n".join(simulated_table(args, cost)))


if __name__ == "__main__":
    main()
