"""Start a gloo process group of a few ranks on 127.0.0.1 and run one function on every rank.

Each rank is a fresh process (``torch.multiprocessing``, spawn) with one intra-op thread; the
group is torch.distributed's gloo backend over TCP on 127.0.0.1 at a free port. The function's
return value comes back per rank (saved with ``torch.save``). Every process is stopped before
:func:`run_ranks` returns: at the end, when a rank raised (its traceback is raised here), or when
``timeout`` passed.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(target, *args, world: int = 2, timeout: float = 240.0) -> list:
    """``[target(rank, world, *args) for rank in range(world)]``, each in its own process."""
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(
            _entry, args=(target, free_port(), world, tmp, args), nprocs=world, join=False,
            start_method="spawn",
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{target.__name__} did not finish in {timeout} s")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join()
        return [torch.load(os.path.join(tmp, f"{rank}.pt")) for rank in range(world)]


def _entry(rank: int, target, port: int, world: int, tmp: str, args: tuple) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    try:
        result = target(rank, world, *args)
        torch.save(result, os.path.join(tmp, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()
