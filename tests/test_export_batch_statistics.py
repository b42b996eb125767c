"""An exported program refuses a call with one value per channel of a batch norm that uses batch
statistics, as ``F.batch_norm`` refuses it in the original model (``export/input_checks.py``,
``runtime/program/eager_checks.py``): the loaded program with eager's ``ValueError`` message, ONNX Runtime
at the check's named node; calls with more rows get the original model's scores."""

from __future__ import annotations

import pytest
import torch
from models_for_tests import BATCH_NORM_NO_STATS, eager
from torch.fx import _pytree as fx_pytree

import rocs_compiler as rocs
from rocs_compiler.export.onnx import VALUES_PER_CHANNEL_NODE_NAME


@pytest.fixture(scope="module")
def compiled():
    model = BATCH_NORM_NO_STATS.build()
    return model, BATCH_NORM_NO_STATS.compile(model)


def _call(batch) -> dict:
    return {**batch.kwargs, "candidate_to_request": batch.candidate_to_request}


def test_a_loaded_program_refuses_one_row_and_answers_two(compiled, tmp_path):
    model, cm = compiled
    path = tmp_path / "batch_norm.pt2"
    rocs.save(rocs.export(cm), path)
    program = rocs.load(path)
    one = BATCH_NORM_NO_STATS.batch([1], seed=3, shuffle=False)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        eager(model, one.replicated())
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        program(**_call(one))
    for counts in ([1, 1], [2], [3, 1, 2]):
        batch = BATCH_NORM_NO_STATS.batch(counts, seed=4, shuffle=True)
        torch.testing.assert_close(program(**_call(batch)), eager(model, batch.replicated()))


def test_onnx_runtime_refuses_one_row_at_the_named_check(compiled, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    model, cm = compiled
    program = rocs.export(cm, portable=True)
    session = ort.InferenceSession(rocs.export_onnx(program, tmp_path / "batch_norm.onnx"))

    def run(batch):
        flat = fx_pytree.tree_flatten_spec(((), _call(batch)), program.call_spec.in_spec)
        feeds = {spec.name: t.numpy() for spec, t in zip(session.get_inputs(), flat)}
        return torch.from_numpy(session.run(None, feeds)[0])

    with pytest.raises(Exception, match="rocs input check failed") as refused:
        run(BATCH_NORM_NO_STATS.batch([1], seed=3, shuffle=False))
    assert VALUES_PER_CHANNEL_NODE_NAME in str(refused.value)
    batch = BATCH_NORM_NO_STATS.batch([3, 1, 2], seed=4, shuffle=True)
    torch.testing.assert_close(run(batch), eager(model, batch.replicated()), rtol=1e-4, atol=1e-5)


def test_an_aoti_package_refuses_one_row_and_answers_two(compiled, tmp_path):
    model, cm = compiled
    path = rocs.aoti_package(rocs.export(cm, portable=True), tmp_path / "batch_norm_aoti.pt2")
    runner = torch._inductor.aoti_load_package(path)
    with pytest.raises(RuntimeError, match="more than 1 value per channel"):
        runner(**_call(BATCH_NORM_NO_STATS.batch([1], seed=3, shuffle=False)))
    batch = BATCH_NORM_NO_STATS.batch([3, 1, 2], seed=4, shuffle=True)
    torch.testing.assert_close(runner(**_call(batch)), eager(model, batch.replicated()))
