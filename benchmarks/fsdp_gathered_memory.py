"""Gathered parameter memory of one FSDP2 training step, eager vs the compiled model.

``fully_shard`` per layer plus the root (gloo, 2 ranks on 127.0.0.1, CPU), the figure
docs/distributed.md quotes: per rank, the bytes of all-gathered (unsharded) parameters held at
once, at its peak over a step and right after forward, for eager FSDP2 and for the compiled
model as the root unit. FSDP2 changes these bytes only when a parameter group unshards or
reshards, so the peak is read exactly after each of those calls (their storages are freed to
size 0 when resharded).

Run: ``python benchmarks/fsdp_gathered_memory.py`` (a minute or two on two cores).
"""

from __future__ import annotations

import copy
import os
import sys

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "distributed"))
from ranks import run_ranks

import rocs_compiler as rocs

WIDTH, DEPTH = 512, 4  # request tower: DEPTH layers of WIDTH x WIDTH
COUNTS = [4, 8, 2, 6]  # candidates per request


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.user = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])
        self.item = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, u, c):
        return self.head(torch.relu(self.user(u)) * self.item(c))

    def units(self) -> list[nn.Module]:
        return [*self.user, self.item, self.head]


class Gathered:
    """The bytes of unsharded parameters every group holds, and their peak."""

    def __init__(self):
        self.groups: list[FSDPParamGroup] = []
        self.peak = 0

    def now(self) -> int:
        total = 0
        for group in self.groups:
            for param in group.fsdp_params:
                for tensor in getattr(param, "all_gather_outputs", []):
                    total += tensor.untyped_storage().nbytes()
        return total

    def sample(self) -> None:
        self.peak = max(self.peak, self.now())


GATHERED = Gathered()


def _watch(method):
    def watched(self, *args, **kwargs):
        result = method(self, *args, **kwargs)
        if self not in GATHERED.groups:
            GATHERED.groups.append(self)
        GATHERED.sample()
        return result

    return watched


FSDPParamGroup.unshard = _watch(FSDPParamGroup.unshard)
FSDPParamGroup.wait_for_unshard = _watch(FSDPParamGroup.wait_for_unshard)
FSDPParamGroup.reshard = _watch(FSDPParamGroup.reshard)


def _step(net: nn.Module, u, c, index, through_rocs: bool) -> tuple[int, int]:
    """(gathered bytes right after forward, peak gathered bytes over forward and backward)."""
    GATHERED.groups, GATHERED.peak = [], 0
    if through_rocs:
        out = net(u=u, c=c, candidate_to_request=index)
    else:
        out = net(u[index], c)
    for unit in net.modules():  # groups that unsharded before being watched
        if isinstance(unit, FSDPModule):
            group = unit._get_fsdp_state()._fsdp_param_group
            if group is not None and group not in GATHERED.groups:
                GATHERED.groups.append(group)
    GATHERED.sample()
    after_forward = GATHERED.now()
    out.square().mean().backward()
    GATHERED.sample()
    return after_forward, GATHERED.peak


def measure(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = Tower()
    eager = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(rank)
    index = torch.repeat_interleave(torch.arange(len(COUNTS)), torch.tensor(COUNTS))
    u = torch.randn(len(COUNTS), WIDTH, generator=gen)
    c = torch.randn(len(index), WIDTH, generator=gen)
    for unit in eager.units():
        fully_shard(unit, mesh=mesh)
    fully_shard(eager, mesh=mesh)
    cm = rocs.compile(model, ["u"], example_kwargs={"u": u[index], "c": c}, training=True)
    for unit in model.units():
        fully_shard(unit, mesh=mesh)
    fully_shard(cm, mesh=mesh)
    whole = sum(p.numel() * p.element_size() for p in Tower().parameters())
    result = {"model bytes": whole}
    for name, net, through_rocs in (("eager", eager, False), ("compiled", cm, True)):
        for _ in range(2):  # the second step: FSDP2's lazy initialization is behind
            after_forward, peak = _step(net, u, c, index, through_rocs)
        result[name] = {"after forward": after_forward, "peak": peak}
    return result


if __name__ == "__main__":
    for rank, result in enumerate(run_ranks(measure)):
        whole = result["model bytes"]
        print(f"rank {rank}: model parameters {whole / 2**20:.2f} MiB")
        for name in ("eager", "compiled"):
            after, peak = result[name]["after forward"], result[name]["peak"]
            print(
                f"  {name:9s} gathered after forward {after / 2**20:6.2f} MiB "
                f"({after / whole:4.0%}), peak {peak / 2**20:6.2f} MiB ({peak / whole:4.0%})"
            )
