"""The DDP column of ``training.py``: one training step per rank under DistributedDataParallel
(gloo, 2 ranks on 127.0.0.1, one torch thread each), eager vs the training compile.

Each rank builds the model as ``training.py`` does, wraps a copy in ``DDP`` (``eager``) and the
compiled model in ``DDP`` (``rocs``: ``DDP(rocs.compile(model, ..., training=True))``, the shared
layout, through the program choice's trials first), and times one step (forward, backward with
its all-reduce, SGD step at learning rate 0) by wall time, which includes the rank's wait for
the other rank at the all-reduce, and by the calling thread's CPU time: the step's own compute
(forward, backward, DDP's hooks and bucket copies, the optimizer) without the all-reduce, which
gloo runs on threads of its own, nor time preempted by other processes. Blocks of ``block`` counted steps per variant, in a seeded
random order of variants that both ranks share (their collectives must pair up), the first step
of a block not counted; the median over the rounds, rank 0's (the ranks wait for each other, so
their times agree). Each rank draws its own batch of R requests with k impressions each.
"""

from __future__ import annotations

import os
import random
import socket
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def ddp_times(name: str, ks: list[int], requests: int, repeats: int, block: int) -> dict:
    """``{k: {"ddp_eager_wall_ms": ..., "ddp_rocs_cpu_ms": ...}}``, per step on rank 0 of a
    2-rank DDP run (wall and calling-thread CPU time)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _rank, args=(port, tmp, name, ks, requests, repeats, block), nprocs=WORLD,
            start_method="spawn",
        )  # fmt: skip  (joins every rank; a failure in one stops the others)
        return torch.load(os.path.join(tmp, "0.pt"))


def _rank(rank, port, tmp, name, ks, requests, repeats, block) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import rocs_compiler as rocs
    from training_models import WARMUP, build, loss_of

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=300))
    try:
        model, entry = build(name)
        import copy

        eager = DDP(copy.deepcopy(model))
        example = entry.make_batch([2, 3], seed=1).replicated()
        cm = rocs.compile(model, list(entry.request_inputs), example_kwargs=example, training=True)
        compiled = DDP(cm)
        result = {}
        for k in ks:
            batch = entry.make_batch([k] * requests, seed=2 + rank)
            replicated = batch.replicated()
            shared = dict(batch.kwargs, candidate_to_request=batch.candidate_to_request)
            steps = {"eager": (eager, replicated), "rocs": (compiled, shared)}
            opts = {v: torch.optim.SGD(net.parameters(), lr=0.0) for v, (net, _) in steps.items()}

            def step(v):
                net, kwargs = steps[v]
                opts[v].zero_grad(set_to_none=True)
                loss_of(net(**kwargs)).backward()
                opts[v].step()

            for v in steps:
                for _ in range(WARMUP):
                    step(v)
            times = {(v, c): [] for v in steps for c in ("wall", "cpu")}
            order = random.Random(k)
            for _ in range(repeats):
                variants = list(steps)
                order.shuffle(variants)
                for v in variants:
                    for counted in [False] + [True] * block:
                        start, cpu = time.perf_counter(), time.thread_time()
                        step(v)
                        if counted:
                            times[v, "wall"].append(time.perf_counter() - start)
                            times[v, "cpu"].append(time.thread_time() - cpu)
            result[k] = {
                f"ddp_{v}_{c}_ms": 1e3 * statistics.median(t) for (v, c), t in times.items()
            }
        torch.save(result, os.path.join(tmp, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()
