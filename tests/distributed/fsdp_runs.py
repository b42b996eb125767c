"""What each rank runs in the FSDP2 tests: ``fully_shard`` per layer plus the root, eager and
with the compiled model, the same steps on rank-dependent batches."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ddp_runs import Ranker, _call, batch, compiled

STEPS = 10


def _layers(model: Ranker) -> list[nn.Module]:
    return [model.user[0], model.user[2], model.item, model.head[1]]


def _train(net: nn.Module, layout: str, through_rocs: bool, rank: int) -> None:
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    for step in range(STEPS):
        u, c, index = batch(rank, step)
        out = _call(net, layout, u, c, index, through_rocs)
        ((out.squeeze(-1) - index.float() / 4) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()


def _full(model: nn.Module) -> dict:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def fsdp_against_eager(rank: int, world: int, layouts: list, options: dict) -> list:
    mesh = init_device_mesh("cpu", (world,))
    results = []
    for layout in layouts:
        torch.manual_seed(0)
        model = Ranker()
        eager = copy.deepcopy(model)
        for layer in _layers(eager):
            fully_shard(layer, mesh=mesh)
        fully_shard(eager, mesh=mesh)
        _train(eager, layout, False, rank)
        cm = compiled(model, **options)
        for layer in _layers(model):
            fully_shard(layer, mesh=mesh)
        fully_shard(cm, mesh=mesh)
        _train(cm, layout, True, rank)
        results.append(
            {"eager": _full(eager), "compiled": _full(model), "choices": cm.program_choices()}
        )
    return results


def shard_then_compile(rank: int, world: int) -> str:
    mesh = init_device_mesh("cpu", (world,))
    model = Ranker()
    for layer in _layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    try:
        compiled(model)
    except Exception as err:  # noqa: BLE001 - the test asserts on it
        return f"{type(err).__name__}: {err}"
    return "no error"
