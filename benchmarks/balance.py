"""Balanced data parallelism: the bubble of 2 real DDP ranks with random, equal-count and
equal-cost request assignment, and the bubble the cost model predicts at 2 to 256 ranks.

    python benchmarks/balance.py [--retain] [--steps 12] [--repeats 9] [--requests 16]

**Measured** (2 ranks, gloo on 127.0.0.1, one torch thread each): DIN (``models_zoo/din.py``,
eval mode so that no batch statistic depends on the split) compiled for training with its history
length marked dynamic, ``DDP(cm)``, SGD at learning rate 0. The training call groups each rank's
requests by history length (``runtime/call/jagged.py``), which the balancer reads from the
compiled model. Each rank's loader draws ``--requests`` requests per step: history lengths
log-normal, median 60, clipped to 8..2048, padded to the rank's longest; 1..64 impressions per
request. Every policy trains on the same loaded batches, interleaved step by step (background
load hits all alike), each with its next batch's exchange started before its step
(``balancer.start``), so the exchange overlaps it:

- ``random``: ``policy="keep"``, every request stays where the loader put it;
- ``count``: equal request counts (sorted by the calibrated cost and dealt);
- ``cost (FLOPs)``: equal predicted cost, the compiled model's FLOPs (``costs.flops_cost``);
- ``cost (ms)``: equal predicted cost in milliseconds, the compiled graph priced by one
  ``rocs.calibrate()`` of this machine (``costs.calibrated_cost``);
- ``same batch (noise floor)``: both ranks train on rank 0's batch: the bubble that timing noise
  alone makes (a perfect balance measures this much).

Per step and rank: **compute**, the calling thread's CPU time of forward, backward and the SGD
step (DDP's all-reduce runs on gloo's threads, and a wait takes no CPU), the median of
``--repeats`` runs of the step (learning rate 0: the same work each time); then each rank runs
the other's batch the same way, so that every batch is also timed on both ranks (their mean
takes out what makes one rank of this machine faster than the other). The **exposed exchange**:
wall time in ``start`` (costs gathered, partition, packing) and ``wait`` (what of the all-to-all
the step did not hide). **Bubble fraction** = sum over steps of (slowest rank - mean rank) / sum
of slowest, of compute; **steps/s** = steps / rank 0's wall time of its steps and exchanges;
**bound**: the mean over steps of the slowest rank's compute under random assignment over this
one's, what balancing can give steps/s at most.

``--retain``: every process (the ranks, and the calibration in the parent) runs with glibc's malloc
keeping freed memory (``allocator.py``), as a GPU rank's caching allocator keeps its blocks across
steps. By default a step's blocks of tens of megabytes come from fresh ``mmap`` pages on some runs
and not on others: the same batch timed twice in one process, medians of 9 runs each, differs by
7 % (standard deviation of the log ratio) by default and 2-4 % with ``--retain``, and that noise
is part of every measured bubble. ``--noise`` measures it first: each rank 0 batch of ``--steps``
steps timed twice in this process, two medians of ``--repeats`` runs.

**Simulated**: the same draws at ``--ranks`` ranks with ``--sim-requests`` requests each, loads
predicted by the calibrated cost, ranks running padded histories or grouped ones (the training
call's default).
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
from allocator import retain_freed_memory
from models_zoo import din
from rocs_compiler.distributed.histories import content_lengths

WORLD = 2
HISTORIES = ("hist_item_ids", "hist_cat_ids")
# name: (policy, weighed by a calibration's milliseconds rather than FLOPs)
POLICIES = {
    "random": ("keep", False),
    "count": ("count", True),
    "cost (FLOPs)": ("cost", False),
    "cost (ms)": ("cost", True),
}
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


def _rank(rank: int, port: int, tmp: str, args, calibration_json: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    if args.retain:
        retain_freed_memory()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=600))
    try:
        cm = compiled_din()
        ddp = DDP(cm)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.0)
        calibration = rocs.Calibration.from_json(calibration_json)
        names = [*POLICIES, SAME]
        balancers = {}
        for name in names:
            policy, by_ms = POLICIES.get(name, ("keep", False))
            balancers[name] = rocs.RequestBalancer(
                cm, policy=policy, calibration=calibration if by_ms else None
            )
        records = {p: [] for p in names}
        pending = {}

        def start(policy, step):
            begin = time.perf_counter()
            loader = 0 if policy == SAME else rank
            batch = draw_batch(loader, step, args.requests, args.impressions)
            drawn = time.perf_counter()
            pending[policy] = balancers[policy].start(batch)
            return time.perf_counter() - drawn, drawn - begin

        def timed_step(batch) -> tuple[float, float]:
            return timed_steps(ddp, opt, batch, args.repeats)

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
                cpu, wall = timed_step(local)
                # The peer's batch on this rank: each batch's compute, timed on both ranks.
                batches = [None] * WORLD
                dist.all_gather_object(batches, local)
                swapped, _ = timed_step(batches[1 - rank])
                if step:
                    records[policy].append({
                        "compute": cpu, "swapped": swapped,
                        "wall": wall + waited + exposed[policy],
                        "exposed": waited + exposed[policy],
                        "predicted": handle.partition.loads.tolist(),
                        "algorithm": handle.partition.algorithm,
                        "requests": local.num_requests, "candidates": local.num_candidates,
                        "width": local.request["hist_item_ids"].shape[1],
                        "features": batch_features(local, cm),
                        "split": cm._jagged.split_calls,
                        "lengths": content_lengths(local.request[HISTORIES[0]], 0).tolist(),
                        "counts": torch.bincount(
                            local.candidate_to_request, minlength=local.num_requests
                        ).tolist(),
                    })  # fmt: skip
                exposed[policy] = started
        torch.save(records, os.path.join(tmp, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def batch_features(batch, cm) -> list[float]:
    """What a rank's grouped call costs in (``runtime/call/jagged_groups.py``): requests, their
    power-of-two widths w, candidates k, sum of k * w, distinct widths; then the same at the
    widths of the groups the call plans (sum of w, sum of k * w, groups)."""
    from rocs_compiler.runtime.call.jagged_groups import plan_groups, power_of_two_widths

    history = batch.request[HISTORIES[0]]
    lengths = content_lengths(history, 0)
    widths = power_of_two_widths(lengths).double()
    k = torch.bincount(batch.candidate_to_request, minlength=lengths.shape[0]).double()
    groups = plan_groups(lengths, k.long(), history.shape[1], cm._jagged.costs, False)
    planned = torch.zeros_like(widths)
    for members, width in groups:
        planned[members] = width
    return [float(lengths.shape[0]), float(widths.sum()), float(k.sum()),
            float((k * widths).sum()), float(torch.unique(widths).numel()),
            float(planned.sum()), float((k * planned).sum()), float(len(groups))]  # fmt: skip


def timed_steps(model, opt, batch, repeats: int) -> tuple[float, float]:
    """Median CPU and wall seconds of ``repeats`` runs of a training step of ``model`` on
    ``batch`` (the same step again: the learning rate is 0)."""
    import torch.nn.functional as F

    cpus, walls = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.thread_time()
        out = model(**batch.inputs(leave_out=["label"]))
        losses = F.binary_cross_entropy_with_logits(out, batch.candidate["label"], reduction="none")
        batch.global_mean(losses).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        cpus.append(time.thread_time() - cpu)
        walls.append(time.perf_counter() - wall)
    return float(np.median(cpus)), float(np.median(walls))


def repeat_noise(args) -> float:
    """The standard deviation of the log ratio of two timings of the same batch (each the median
    of ``--repeats`` runs of a training step) in one process, over rank 0's loaded batches."""
    cm = compiled_din()
    opt = torch.optim.SGD(cm.parameters(), lr=0.0)
    ratios = []
    for step in range(1, args.steps + 1):
        batch = draw_batch(0, step, args.requests, args.impressions)
        timed_steps(cm, opt, batch, args.repeats)  # warm
        first, second = (timed_steps(cm, opt, batch, args.repeats)[0] for _ in range(2))
        ratios.append(np.log(first / second))
    return float(np.std(ratios))


def measured(args, calibration) -> dict:
    """``{policy: [rank 0's records, rank 1's records]}``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _rank, args=(port, tmp, args, calibration.to_json()), nprocs=WORLD,
            start_method="spawn",
        )  # fmt: skip
        ranks = [torch.load(os.path.join(tmp, f"{r}.pt")) for r in range(WORLD)]
    return {p: [ranks[r][p] for r in range(WORLD)] for p in ranks[0]}


def bubble_fraction(per_step: np.ndarray) -> float:
    """``per_step`` [steps, ranks]: sum of (slowest - mean) over sum of slowest."""
    top = per_step.max(1)
    return float((top - per_step.mean(1)).sum() / top.sum())


def measured_table(runs: dict) -> list[str]:
    lines = [
        (
            "| assignment | bubble (measured compute) | reduction vs random | bubble, each batch "
            "timed on both ranks | reduction vs random | bubble (predicted) "
            "| slowest rank's compute, ms/step | exposed exchange, ms/step | steps/s | speed-up "
            "vs random: steps/s / bound | requests per rank | width per rank |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = None
    for policy, ranks in runs.items():
        compute = np.array([[s["compute"] for s in r] for r in ranks]).T  # [steps, ranks]
        predicted = np.array([s["predicted"] for s in ranks[0]])
        exposed = np.mean([s["exposed"] for r in ranks for s in r])
        steps_per_s = len(ranks[0]) / sum(s["wall"] for s in ranks[0])
        swapped = np.array([[s["swapped"] for s in r] for r in ranks]).T  # peer's batch
        both = (compute + swapped[:, ::-1]) / 2  # [steps, ranks]: a batch's mean on both ranks
        bubble, bubble_both = bubble_fraction(compute), bubble_fraction(both)
        slowest = compute.max(1).mean()
        if base is None:
            base = (bubble, slowest, steps_per_s, bubble_both)
        cuts = ["" if policy in ("random", SAME) else f"{1 - b / b0:.0%}"
                for b, b0 in ((bubble, base[0]), (bubble_both, base[3]))]  # fmt: skip
        speedup = "" if policy == "random" else (
            f"{steps_per_s / base[2]:.2f} / {base[1] / slowest:.2f}"
        )  # fmt: skip
        requests = "/".join(f"{np.mean([s['requests'] for s in r]):.1f}" for r in ranks)
        widths = "/".join(f"{np.mean([s['width'] for s in r]):.0f}" for r in ranks)
        lines.append(
            f"| {policy} | {bubble:.3f} | {cuts[0]} | {bubble_both:.3f} | {cuts[1]} "
            f"| {bubble_fraction(predicted):.3f} | "
            f"{1e3 * slowest:.0f} | {1e3 * exposed:.1f} | {steps_per_s:.2f} | {speedup} "
            f"| {requests} | {widths} |"
        )
    return lines


HISTORY_MODES = {
    "padded": "ranks pad to their longest request",
    "grouped": "requests grouped by length, each at its length rounded up to a power of two "
    "and at most the rank's longest (the training call's default)",
}


def simulated_table(args, cost) -> list[str]:
    from rocs_compiler.distributed.partition import Requests, partition
    from rocs_compiler.runtime.call.jagged_groups import power_of_two_widths

    (ar, br), (ac, bc) = cost.request, cost.candidate
    lines = [
        (
            "| ranks | histories | random bubble | count bubble | cost bubble | cost's reduction "
            "vs random | slowest rank vs random (count / cost) | costliest request / mean rank "
            "load |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    names = {"random": "keep", "count": "count", "cost": "cost"}
    for world in args.ranks:
        rng = np.random.default_rng(world)
        for mode in HISTORY_MODES:
            bubbles = {p: [] for p in names}
            tops = {p: [] for p in names}
            single = []
            for _ in range(args.sim_steps):
                count = world * args.sim_requests
                lengths = draw_lengths(rng, count)
                k = rng.integers(1, args.impressions + 1, count)
                grouped = mode == "grouped"
                widths = power_of_two_widths(torch.from_numpy(lengths)).numpy()
                requests = Requests(
                    fixed=ar + k * ac, per_length=br + k * bc, lengths=lengths, candidates=k,
                    home=np.repeat(np.arange(world), args.sim_requests), padded=not grouped,
                    widths=widths if grouped else None,
                )  # fmt: skip
                for name, policy in names.items():
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
                f"| {world} | {mode} | {frac['random']:.3f} | "
                f"{frac['count']:.3f} | {frac['cost']:.4f} | "
                f"{1 - frac['cost'] / frac['random']:.1%} | {ratio[0]:.2f} / {ratio[1]:.2f} | "
                f"{max(single):.3f} |"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="counted steps per policy")
    parser.add_argument("--requests", type=int, default=16, help="requests per rank per step")
    parser.add_argument("--impressions", type=int, default=64, help="most candidates per request")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 8, 64, 256])
    parser.add_argument("--repeats", type=int, default=9, help="runs of each step (median)")
    parser.add_argument("--sim-requests", type=int, default=128, help="requests per rank")
    parser.add_argument("--sim-steps", type=int, default=20)
    parser.add_argument("--no-measure", action="store_true", help="the simulation only")
    parser.add_argument("--json", help="also write the measured per-step records here")
    parser.add_argument("--retain", action="store_true", help="malloc keeps freed memory")
    parser.add_argument("--noise", action="store_true", help="first time batches twice")
    args = parser.parse_args()
    if args.retain and not retain_freed_memory():
        print("# --retain: this malloc is not glibc's; it runs as it is")
    from rocs_compiler.distributed.costs import calibrated_cost, flops_cost

    torch.set_num_threads(1)
    cm = compiled_din()
    begin = time.perf_counter()
    calibration = rocs.calibrate()
    cost = calibrated_cost(cm, calibration)
    flops = flops_cost(cm)
    print(f"calibration: {time.perf_counter() - begin:.0f} s")
    print(f"cost model (FLOPs): request {flops.request}, candidate {flops.candidate}")
    print(f"cost model (ms):    request {cost.request}, candidate {cost.candidate}\n")
    if args.noise:
        print(f"a batch timed twice in one process: {repeat_noise(args):.1%} (standard "
              "deviation of the log ratio)\n")  # fmt: skip
    if not args.no_measure:
        begin = time.perf_counter()
        runs = measured(args, calibration)
        if args.json:
            Path(args.json).write_text(json.dumps(runs, indent=1))
        print(f"## 2 ranks, measured ({args.steps} steps per policy, {args.requests} requests "
              f"per rank, median of {args.repeats} runs of each step, "
              f"{'malloc keeping freed memory' if args.retain else 'default malloc'}, "
              f"{time.perf_counter() - begin:.0f} s)\n")  # fmt: skip
        print("\n".join(measured_table(runs)) + "\n")
    print(f"## Simulated from the calibrated cost ({args.sim_requests} requests per rank, "
          f"{args.sim_steps} steps)\n")  # fmt: skip
    for mode, meaning in HISTORY_MODES.items():
        print(f"- {mode}: {meaning}")
    print("\n" + "\n".join(simulated_table(args, cost)))


if __name__ == "__main__":
    main()
