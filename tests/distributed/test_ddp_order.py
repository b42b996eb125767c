"""DDP and the compiled model, in both orders: ``rocs.compile(DDP(model))`` is refused in one line
saying to compile first; a DDP wrapping a parent of the compiled model's original is found, so
calls past it are refused, and calls through it (the parent's forward calling the compiled model)
train as eager DDP does. One gloo rank on 127.0.0.1, in-process.

Before: ``rocs.compile(DDP(model), ...)`` failed with "unknown input name" and then a capture
error; a training call through ``cm = rocs.compile(parent.tower, ...)`` with ``DDP(parent)``
went through without a word, its gradients never all-reduced.
"""

from __future__ import annotations

import copy
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from ddp_runs import Ranker, batch, compiled
from ranks import free_port
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import rocs_compiler as rocs


@pytest.fixture
def process_group():
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    try:
        yield
    finally:
        dist.destroy_process_group()


class Parent(nn.Module):
    """A module holding the ranker as its ``tower``, with a parameter of its own."""

    def __init__(self, tower: nn.Module):
        super().__init__()
        self.tower = tower
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, u, c):
        return self.scale * self.tower(u=u, c=c)


def _loss(out: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return ((out.squeeze(-1) - index.float() / 4) ** 2).mean()


def test_compiling_a_ddp_module_says_to_compile_first_in_one_line(process_group):
    u, c, index = batch(0, 0)
    example = {"u": u[index], "c": c}
    calls = [
        lambda: rocs.compile(DDP(Ranker()), ["u"], example_kwargs=example, training=True),
        # Not swallowed by the eager fallback: the fix is the user's order of wrapping.
        lambda: rocs.compile(DDP(Ranker().eval()), ["u"], example_kwargs=example, fallback="eager"),
    ]
    for call in calls:
        with pytest.raises(rocs.CompileError) as caught:
            call()
        message = str(caught.value)
        assert "compile the model first" in message and "DDP(rocs.compile(model" in message
        assert "\n" not in message


def test_calls_past_a_ddp_wrapping_a_parent_of_the_original_are_refused(process_group):
    torch.manual_seed(0)
    parent = Parent(Ranker())
    cm = compiled(parent.tower)
    wrapped = DDP(parent)  # after compiling: the original is its submodule
    u, c, index = batch(0, 1)
    with pytest.raises(rocs.InputError, match=r"DistributedDataParallel.*DDP\(rocs.compile\("):
        _loss(cm(u=u, c=c, candidate_to_request=index), index).backward()
    del wrapped


def test_a_parent_calling_the_compiled_model_inside_ddp_trains_as_eager_ddp(process_group):
    torch.manual_seed(0)
    tower = Ranker()
    eager = DDP(Parent(copy.deepcopy(tower)))
    parent = Parent(tower)
    parent.tower = cm = compiled(tower)  # the parent's forward calls the compiled model
    ddp = DDP(parent)
    for net in (eager, ddp):
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        for step in range(3):
            u, c, index = batch(0, step)
            opt.zero_grad()
            _loss(net(u[index], c), index).backward()
            opt.step()
    for (name, want), got in zip(eager.module.named_parameters(), parent.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=name)
    u, c, index = batch(0, 9)
    with pytest.raises(rocs.InputError, match="DistributedDataParallel"):
        cm(u=u, c=c, candidate_to_request=index).sum().backward()  # past the parent's DDP
    ddp.eval()  # and evaluation through it runs the eval-mode program
    with torch.no_grad():
        torch.testing.assert_close(ddp(u[index], c), eager.module.eval()(u[index], c))
