"""``DDP(rocs.compile(model, ..., training=True))`` trains as eager DDP does (gloo, 2 ranks on
127.0.0.1), in the shared and drop-in layouts, with DDP's options; calls through a compiled
model whose original is wrapped in DDP (no gradient sync) are refused, naming DDP.

Before: ``DDP(cm)`` refused to start (the compiled model had no parameters), and ``DDP(model)``
with calls through ``cm`` never synced gradients, without a word (two ranks' parameters 0.2
apart after 20 steps).
"""

from __future__ import annotations

import pytest
import torch

from ddp_runs import ddp_against_eager, ddp_checks
from ranks import run_ranks

LAYOUTS = ["shared", "dropin"]
FIXED = {"autotune": False}  # the compiled program in every step (no choice of eager's)


def _check(configs, results_per_rank):
    for i, config in enumerate(configs):
        first = results_per_rank[0][i]
        for rank, results in enumerate(results_per_rank):
            got = results[i]
            for name, want in got["eager"].items():
                torch.testing.assert_close(
                    got["compiled"][name], want, rtol=1e-4, atol=1e-6,
                    msg=lambda m, name=name: f"{config} rank {rank} {name}: {m}",
                )  # fmt: skip
                # The ranks agree: gradients were all-reduced.
                torch.testing.assert_close(got["compiled"][name], first["compiled"][name])


# Both layouts with the compiled program in every step, and the shared layout with the program
# choice (as a user compiles).
CONFIGS = [(layout, {}, FIXED) for layout in LAYOUTS] + [("shared", {}, {})]


@pytest.fixture(scope="module")
def ddp_runs():
    """The CI checks in one process group of 2 ranks (their start-up dominates)."""
    return run_ranks(ddp_checks, CONFIGS)


def test_ddp_of_a_compiled_model_equals_eager_ddp_in_both_layouts(ddp_runs):
    _check(CONFIGS, [results for results, _ in ddp_runs])


@pytest.mark.slow
def test_ddp_options_with_a_compiled_model():
    options = [
        {"find_unused_parameters": True},
        {"gradient_as_bucket_view": True},
        {"no_sync": True},
        {"static_graph": True},
    ]
    configs = [(layout, kwargs, FIXED) for layout in LAYOUTS for kwargs in options]
    _check(configs, run_ranks(ddp_against_eager, configs))


def test_calls_past_a_ddp_wrapping_the_original_are_refused(ddp_runs):
    for _, message in ddp_runs:
        assert message.startswith("InputError"), message
        assert "DistributedDataParallel" in message and "DDP(rocs.compile(model" in message
