"""FSDP2: ``fully_shard`` per layer plus the root, applied after compiling (the compiled model
is the root unit), trains as eager FSDP2 does (gloo, 2 ranks on 127.0.0.1, CPU); sharding
before compiling is refused in one line saying to compile first.

Before: per-layer ``fully_shard`` after compiling with the default options (the program choice
on) deadlocked in the drop-in layout; per-layer ``fully_shard`` after compiling was refused ("model.item was replaced since
compile (Linear -> FSDPLinear)"), and compiling a sharded model failed in capture on its
DTensor parameters with a page of tensor values.
"""

from __future__ import annotations

import pytest
import torch

from fsdp_runs import fsdp_against_eager, shard_then_compile
from ranks import run_ranks


@pytest.mark.slow
def test_fully_shard_per_layer_after_compile_equals_eager_fsdp2():
    layouts = ["shared", "dropin"]
    for rank, results in enumerate(run_ranks(fsdp_against_eager, layouts, {"autotune": False})):
        for layout, got in zip(layouts, results):
            for name, want in got["eager"].items():
                torch.testing.assert_close(
                    got["compiled"][name], want, rtol=1e-4, atol=1e-6,
                    msg=lambda m, name=name: f"{layout} rank {rank} {name}: {m}",
                )  # fmt: skip


@pytest.mark.slow
def test_fully_shard_with_the_program_choice_on_runs_the_program_on_every_rank():
    """With the default options each rank used to time its own trials of the program and of the
    original model, settle buckets differently and run different collectives: the drop-in
    layout waited until gloo's timeout. Under FSDP2 no training bucket is timed."""
    layouts = ["shared", "dropin"]
    runs = run_ranks(fsdp_against_eager, layouts, {}, timeout=200.0)
    for rank, results in enumerate(runs):
        for layout, got in zip(layouts, results):
            assert not any(key[0].startswith("train") for key in got["choices"]), got["choices"]
            for name, want in got["eager"].items():
                torch.testing.assert_close(
                    got["compiled"][name], want, rtol=1e-4, atol=1e-6,
                    msg=lambda m, at=f"{layout} rank {rank} {name}": f"{at}: {m}",
                )  # fmt: skip


@pytest.mark.slow
def test_compiling_a_sharded_model_is_refused_in_one_line():
    for message in run_ranks(shard_then_compile):
        assert message.startswith("CompileError: parameter user.0.weight is sharded by FSDP2")
        assert "fully_shard(cm) last" in message and "\n" not in message
