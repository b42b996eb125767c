"""What each rank runs in the DDP tests: the same steps through eager DDP and through
``DDP(rocs.compile(model, ..., training=True))``, on rank-dependent ragged batches.

Oracle: eager DistributedDataParallel over a copy of the same model, on the same batches (in
the drop-in layout the same call; in the shared layout the request rows gathered to one per
candidate); SGD, so parameters after the steps differ only by the re-association of sums in
the gradients.
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import rocs_compiler as rocs

STEPS = 20
COUNTS = [1, 3, 5, 2]  # candidates per request


class Ranker(nn.Module):
    """A two-tower ranker with a request tower worth sharing; ``unused`` adds a layer forward
    never calls (DDP's ``find_unused_parameters``)."""

    def __init__(self, unused: bool = False):
        super().__init__()
        self.user = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
        self.item = nn.Linear(8, 16)
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(16, 1))
        if unused:
            self.spare = nn.Linear(16, 1)

    def forward(self, u, c):
        return self.head(self.user(u) * self.item(c))


def batch(rank: int, step: int):
    """(request rows [R, 8], candidate rows [N, 8], candidate_to_request [N]), shuffled."""
    gen = torch.Generator().manual_seed(1000 * rank + step)
    index = torch.repeat_interleave(torch.arange(len(COUNTS)), torch.tensor(COUNTS))
    index = index[torch.randperm(len(index), generator=gen)]
    return torch.randn(len(COUNTS), 8, generator=gen), torch.randn(len(index), 8, generator=gen), index


def _example():
    u, c, index = batch(0, -1)
    return {"u": u[index], "c": c}


def compiled(model: nn.Module, **options) -> nn.Module:
    return rocs.compile(model, ["u"], example_kwargs=_example(), training=True, options=options)


def _call(net, layout: str, u, c, index, through_rocs: bool):
    if layout == "shared" and through_rocs:
        return net(u=u, c=c, candidate_to_request=index)
    return net(u=u[index], c=c)


def train(ddp: nn.Module, layout: str, through_rocs: bool, no_sync: bool, rank: int) -> None:
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(STEPS):
        u, c, index = batch(rank, step)
        accumulate = no_sync and step % 2 == 0
        with ddp.no_sync() if accumulate else contextlib.nullcontext():
            out = _call(ddp, layout, u, c, index, through_rocs)
            ((out.squeeze(-1) - index.float() / 4) ** 2).mean().backward()
        if not accumulate:
            opt.step()
            opt.zero_grad()


def ddp_against_eager(rank: int, world: int, configs: list) -> list:
    """Per config ``(layout, ddp_kwargs, rocs_options)``: the parameters after eager DDP and
    after DDP of the compiled model, and the compiled model's program choices."""
    results = []
    for layout, kwargs, options in configs:
        kwargs = dict(kwargs)
        no_sync = kwargs.pop("no_sync", False)
        torch.manual_seed(0)
        model = Ranker(unused=kwargs.get("find_unused_parameters", False))
        eager = copy.deepcopy(model)
        train(DDP(eager, **kwargs), layout, False, no_sync, rank)
        cm = compiled(model, **options)
        train(DDP(cm, **kwargs), layout, True, no_sync, rank)
        results.append(
            {
                "eager": {n: p.detach().clone() for n, p in eager.named_parameters()},
                "compiled": {n: p.detach().clone() for n, p in model.named_parameters()},
                "choices": cm.program_choices(),
            }
        )
    return results


def ddp_checks(rank: int, world: int, configs: list) -> tuple[list, str]:
    """``ddp_against_eager`` and ``call_past_ddp`` in one process group (one start-up)."""
    return ddp_against_eager(rank, world, configs), call_past_ddp(rank, world)


def call_past_ddp(rank: int, world: int) -> str:
    """``DDP(model)`` with calls through a compiled ``model``: the error each rank gets."""
    torch.manual_seed(0)
    model = Ranker()
    cm = compiled(model)
    wrapped = DDP(model)
    u, c, index = batch(rank, 0)
    try:
        cm(u=u, c=c, candidate_to_request=index).sum().backward()
    except Exception as err:  # noqa: BLE001 - the test asserts on it
        message = f"{type(err).__name__}: {err}"
    else:
        message = "no error"
    del wrapped
    return message
