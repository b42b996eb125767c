"""A history length that changes between calls, through the other doors: ``rocs.export`` (plain
and portable), ONNX Runtime and the ``torch.compile`` backend each take one program for every
length, exact against the original model on ragged batches (``rocs.compile`` itself:
``tests/runtime/test_dynamic_lengths.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.fx._pytree as fx_pytree

import rocs_compiler as rocs
from models_zoo import din
from dynamic_histories import at_length, din_model, marked_example, replicated
from rocs_compiler.export import input_signature

LENGTHS = (1, 4, 50, 90)


def _calls():
    for i, length in enumerate(LENGTHS):
        batch = din.make_batch([3, 1, 4][: 1 + i % 3], seed=20 + i, shuffle=True)
        yield length, at_length(batch, length, seed=20 + i), batch.candidate_to_request


@pytest.fixture(scope="module")
def model_and_compiled():
    model = din_model()
    return model, rocs.compile(model, list(din.REQUEST_INPUTS), example_kwargs=marked_example())


@pytest.mark.parametrize("portable", [False, True])
def test_an_exported_program_takes_every_length(model_and_compiled, portable):
    model, cm = model_and_compiled
    program = rocs.export(cm, portable=portable)
    shapes = input_signature(program)
    assert shapes["hist_item_ids"]["shape"][1] == shapes["hist_cat_ids"]["shape"][1]
    assert isinstance(shapes["hist_item_ids"]["shape"][1], str)  # a size, not a constant
    run = program.module()
    with torch.no_grad():
        for length, kwargs, index in _calls():
            want = model(**replicated(kwargs, index))
            got = run(**kwargs, candidate_to_request=index)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"length {length}")


def test_onnx_runtime_takes_every_length(model_and_compiled, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    model, cm = model_and_compiled
    program = rocs.export(cm, portable=True)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(rocs.export_onnx(program, tmp_path / "din.onnx"), options)
    dims = {i.name: i.shape for i in session.get_inputs()}
    assert dims["hist_item_ids"] == ["R", "L_hist_item_ids"] == dims["hist_cat_ids"]
    with torch.no_grad():
        for length, kwargs, index in _calls():
            want = model(**replicated(kwargs, index)).numpy()
            flat = fx_pytree.tree_flatten_spec(
                ((), {**kwargs, "candidate_to_request": index}), program.call_spec.in_spec
            )
            feeds = {spec.name: t.numpy() for spec, t in zip(session.get_inputs(), flat)}
            got = session.run(None, feeds)[0]
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"length {length}")


def test_the_torch_compile_backend_takes_every_length_with_one_graph():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = din_model()
    options = {"request_inputs": list(din.REQUEST_INPUTS), "inductor": False}
    compiled = torch.compile(model, backend="rocs", options=options, dynamic=True)
    graphs, start = [], counters["stats"]["unique_graphs"]  # a count over the whole process
    with torch.no_grad():
        for length, kwargs, index in _calls():
            as_replicated = replicated(kwargs, index)
            want = model(**as_replicated)
            torch.testing.assert_close(compiled(**as_replicated), want, rtol=1e-5, atol=1e-5)
            graphs.append(counters["stats"]["unique_graphs"] - start)
    # Dynamo specializes a size of 1 (its own rule, whatever the backend): the first length, 1,
    # compiles a graph of its own; every other length shares one graph.
    assert graphs == [1, 2, 2, 2], graphs


@pytest.mark.slow  # an AOTInductor build takes minutes on two cores
def test_an_aoti_package_takes_every_length(model_and_compiled, tmp_path):
    model, cm = model_and_compiled
    package = rocs.aoti_package(rocs.export(cm, portable=True), tmp_path / "din.pt2")
    runner = torch._inductor.aoti_load_package(package)
    with torch.no_grad():
        for length, kwargs, index in _calls():
            want = model(**replicated(kwargs, index))
            got = runner(**kwargs, candidate_to_request=index)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"length {length}")
