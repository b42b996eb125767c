"""Portable programs in ONNX Runtime (``rocs.export_onnx``): dynamic R and N, scores equal to the
original model's (rtol 1e-4) for zoo models and a DeepCTR-Torch model, misused calls refused by
ONNX Runtime at the program's check node, and a program with rocs:: ops refused with their names.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.fx import _pytree as fx_pytree
from torch.utils import _pytree as pytree

import rocs_compiler as rocs
from models_zoo import get_entry
from rocs_compiler.export import input_signature
from rocs_compiler.export.onnx import CHECK_NODE_NAME

ort = pytest.importorskip("onnxruntime")

# ragged batches: R > 1 with 1, 3 and 17 candidates, R = 1, and R = N (one candidate each)
BATCHES = [([3, 1, 17], True), ([1], False), ([5], False), ([1, 1, 1], True)]


def _session(program, path) -> "ort.InferenceSession":
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(rocs.export_onnx(program, path), options)


def _run(session, program, kwargs: dict) -> list[np.ndarray]:
    flat = fx_pytree.tree_flatten_spec(((), kwargs), program.call_spec.in_spec)
    feeds = {spec.name: t.numpy() for spec, t in zip(session.get_inputs(), flat)}
    return session.run(None, feeds)


def _assert_exact(got: list[np.ndarray], expected, what: str) -> None:
    want = pytree.tree_leaves(expected)
    assert len(got) == len(want), what
    for a, b in zip(got, want):
        torch.testing.assert_close(torch.from_numpy(a), b, rtol=1e-4, atol=1e-5, msg=what)


def _zoo_session(name, tmp_path):
    entry = get_entry(name)
    model = entry.build()
    example = entry.make_batch([3, 1, 5]).replicated()
    cm = rocs.compile(model, list(entry.request_inputs), example_kwargs=example)
    program = rocs.export(cm, portable=True)
    return entry, model, cm, program, _session(program, tmp_path / f"{name}.onnx")


def _check_zoo_model(name, tmp_path):
    entry, model, cm, program, session = _zoo_session(name, tmp_path)
    dynamic = {d for i in session.get_inputs() for d in i.shape if isinstance(d, str)}
    assert len(dynamic) >= 2, f"R and N are dynamic ONNX dims: {dynamic}"
    for i, (counts, shuffle) in enumerate(BATCHES):
        batch = entry.make_batch(counts, seed=50 + i, shuffle=shuffle)
        kwargs = {**batch.kwargs, "candidate_to_request": batch.candidate_to_request}
        with torch.no_grad():
            expected = model(**batch.replicated())
        _assert_exact(_run(session, program, kwargs), expected, f"{name} {counts}")
    return entry, program, session


@pytest.mark.parametrize("name", ["dlrm", "target_attention"])
def test_zoo_models_run_in_onnx_runtime(name, tmp_path):
    _check_zoo_model(name, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["dcnv2", "finalmlp", "wukong", "din", "bst", "two_tower", "mmoe", "hstu"]
)
def test_every_other_zoo_model_runs_in_onnx_runtime(name, tmp_path):
    _check_zoo_model(name, tmp_path)


def test_onnx_runtime_refuses_a_misused_call(tmp_path):
    entry, model, cm, program, session = _zoo_session("dcnv2", tmp_path)
    batch = entry.make_batch([2, 3], seed=1)
    index = batch.candidate_to_request
    _assert_exact(_run(session, program, {**batch.kwargs, "candidate_to_request": index}),
                  model(**batch.replicated()), "dcnv2")  # fmt: skip
    calls = {
        "replicated request rows": {**batch.replicated(), "candidate_to_request": index},
        "index past R": {**batch.kwargs, "candidate_to_request": index + 1},
        "negative index": {**batch.kwargs, "candidate_to_request": index - 1},
    }
    for what, kwargs in calls.items():
        with pytest.raises(Exception, match="rocs input check failed") as refused:
            _run(session, program, kwargs)
        assert CHECK_NODE_NAME in str(refused.value), what


def test_a_program_with_rocs_ops_is_refused_naming_them(tmp_path):
    entry = get_entry("dlrm")
    cm = rocs.compile(
        entry.build(), list(entry.request_inputs), example_kwargs=entry.make_batch([2]).replicated()
    )
    with pytest.raises(rocs.CompileError, match=r"rocs\.broadcast_\w+.*portable=True"):
        rocs.export_onnx(rocs.export(cm), tmp_path / "fused.onnx")


def test_a_deepctr_model_runs_in_onnx_runtime(tmp_path):
    pytest.importorskip("deepctr_torch")
    from models_zoo.deepctr_models import build, draw, request_ranges

    model, user, _ = build("din")
    example, _ = draw(model, user, [2, 1, 3], seed=0)
    cm = rocs.compile(model, request_ranges(model, user), example_kwargs={"X": example})
    program = rocs.export(cm, portable=True)
    session = _session(program, tmp_path / "deepctr_din.onnx")
    for seed, counts in enumerate([[3, 1, 17], [1], [4, 2]]):
        x, index = draw(model, user, counts, seed=seed + 1)
        starts = torch.tensor([int((index == r).nonzero()[0]) for r in range(len(counts))])
        pieces = {}
        for leaf in input_signature(program):
            if leaf.startswith("X."):  # a column range "X.first:last", R rows if request-side
                first, last = (int(v) for v in leaf.removeprefix("X.").split(":"))
                request = leaf in cm.contract.request_inputs
                pieces[leaf.removeprefix("X.")] = x[starts if request else slice(None), first:last]
        with torch.no_grad():
            expected = model(x)
        kwargs = {"X": pieces, "candidate_to_request": index}
        _assert_exact(_run(session, program, kwargs), expected, f"deepctr din {counts}")

