"""Profiler labels: a compiled model's regions and fused ops are named ranges in torch.profiler."""

from __future__ import annotations

import torch
from models_for_tests import zoo_compiled

from models_zoo import ZOO
from rocs_compiler.runtime.program.direct import DirectProgram


def _call(name: str):
    compiled = zoo_compiled(name)
    batch = ZOO[name].make_batch([3, 5], seed=1)
    index = batch.candidate_to_request
    return compiled, lambda: compiled(**batch.kwargs, candidate_to_request=index)


def test_regions_and_fused_ops_are_named_ranges():
    compiled, call = _call("dlrm")
    expected = call()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = call()
    names = {event.key for event in prof.key_averages()}
    assert {"rocs::request_region", "rocs::candidate_region"} <= names
    fused = {
        str(n.target).split(".")[1]
        for n in compiled.graph_module.graph.nodes
        if getattr(n.target, "namespace", "") == "rocs"
    }
    assert fused, "dlrm's compiled graph has fused ops"
    assert {f"rocs::{op}" for op in fused} <= names
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_without_a_profiler_the_plain_program_runs():
    compiled, call = _call("dlrm")
    call()
    runner = compiled._graph_runner()
    assert isinstance(runner, DirectProgram)
    assert "_range" not in runner.source and "rocs::request_region" in runner.profiled_source
    # The program runs the request region first, so each region is one range per call.
    assert runner.profiled_source.count("rocs::request_region") == 1
    assert runner.profiled_source.count("rocs::candidate_region") == 1
