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


def test_an_unmarked_compile_exports_every_length_when_asked():
    """``rocs.export(cm, dynamic={input: dim})``: a model compiled from an example whose length
    nobody marked is compiled again with it dynamic, once, and its program takes every length;
    the compiled model itself then serves every length too."""
    model = din_model()
    cm = rocs.compile(
        model, list(din.REQUEST_INPUTS), example_kwargs=din.make_batch([4, 3]).replicated()
    )
    static = input_signature(rocs.export(cm))
    assert isinstance(static["hist_item_ids"]["shape"][1], int)  # the example's length
    with pytest.raises(rocs.InputError, match="'hist_ids', which is not an input"):
        rocs.export(cm, dynamic={"hist_ids": 1})
    with pytest.raises(rocs.InputError, match="a dim past the rows"):
        rocs.export(cm, dynamic={"hist_item_ids": 0})
    program = rocs.export(cm, dynamic={"hist_item_ids": 1, "hist_cat_ids": [1]})
    assert isinstance(input_signature(program)["hist_item_ids"]["shape"][1], str)
    grown = cm.graph_module
    assert rocs.export(cm, dynamic={"hist_item_ids": 1}) is not None
    assert cm.graph_module is grown  # dynamic already: no compile again
    run = program.module()
    with torch.no_grad():
        for length, kwargs, index in _calls():
            want = model(**replicated(kwargs, index))
            torch.testing.assert_close(
                run(**kwargs, candidate_to_request=index), want, rtol=1e-5, atol=1e-5
            )
            torch.testing.assert_close(
                cm(**kwargs, candidate_to_request=index), want, rtol=1e-5, atol=1e-5
            )
    assert cm.graph_module is grown


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


@pytest.mark.parametrize("inductor", [False, True])
def test_the_torch_compile_backend_takes_every_length_with_one_graph_and_one_rewrite(inductor):
    """Dynamo traces the length as a size; once it changes, the rewrite of its graph takes it
    dynamic too, so one rocs program (and, with Inductor, one lowered graph) serves every later
    length: a rewrite per length cost seconds per new length with Inductor."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = din_model()
    backend = rocs.backend(list(din.REQUEST_INPUTS), inductor=inductor)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    graphs, start = [], counters["stats"]["unique_graphs"]  # a count over the whole process
    with torch.no_grad():
        for length, kwargs, index in [*_calls(), *list(_calls())[1:]]:
            as_replicated = replicated(kwargs, index)
            want = model(**as_replicated)
            got = compiled(**as_replicated)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"length {length}")
            assert (want - want[0]).abs().max() > 1e-3, "outputs barely vary across rows"
            got = rocs.shared_call(compiled, **kwargs, candidate_to_request=index)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"shared {length}")
            graphs.append(counters["stats"]["unique_graphs"] - start)
    # Dynamo specializes a size of 1 (its own rule, whatever the backend): the first length, 1,
    # compiles a graph of its own; every other length shares one graph. Its rewrite fixes the
    # length it first sees and takes it dynamic once a second one comes (as dynamo's automatic
    # dynamic shapes do); no later length compiles anything. (With Inductor the count also
    # holds the lowered graphs' own frames.)
    assert len(set(graphs[2:])) == 1, f"a new length compiled a graph: {graphs}"
    if not inductor:
        assert graphs[:2] == [1, 2], graphs
    rewrites = [len(subgraph.variants) for subgraph in backend.subgraphs]
    assert rewrites == [1, 1], f"rocs programs per dynamo graph: {rewrites}"


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


def _padded_histories(lengths: list[int], seed: int):
    """Shared-layout DIN inputs whose request r has ``lengths[r]`` events, padded with 0."""
    batch = din.make_batch([3, 1, 4, 2][: len(lengths)], seed=seed, shuffle=True)
    g = torch.Generator().manual_seed(seed)
    width, kwargs = max(lengths), dict(batch.kwargs)
    valid = torch.arange(width) < torch.tensor(lengths)[:, None]
    for name, vocab in zip(("hist_item_ids", "hist_cat_ids"), (din.NUM_ITEMS, din.NUM_CATS)):
        ids = torch.randint(1, vocab, (len(lengths), width), generator=g)
        kwargs[name] = ids.masked_fill(~valid, 0)
    return kwargs, batch.candidate_to_request


def test_the_torch_compile_backend_runs_a_shared_call_jagged():
    """Through ``torch.compile`` too, a shared call whose histories are padded far past most
    requests' lengths runs as groups cut to their lengths (the rewrite's truncation proof, as
    ``rocs.compile`` has it), exact against the model on the padded, replicated batch."""
    model = din_model()
    backend = rocs.backend(list(din.REQUEST_INPUTS))
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        for i, lengths in enumerate(([5, 9, 3], [7, 2], [300, 4, 6, 5], [200, 3, 2])):
            kwargs, index = _padded_histories(lengths, seed=40 + i)
            want = model(**replicated(kwargs, index))
            got = rocs.shared_call(compiled, **kwargs, candidate_to_request=index)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=str(lengths))
            assert (want - want[0]).abs().max() > 1e-3, "outputs barely vary across rows"
    runners = [v.runner for s in backend.subgraphs for v in s.variants.values()]
    jagged = [r._jagged for r in runners if getattr(r, "_jagged", None) is not None]
    assert jagged and sum(j.split_calls for j in jagged) >= 2, "no call ran jagged"


PADDED = ([5, 9, 3], [7, 2], [300, 4, 6, 5], [200, 3, 2])  # requests' history lengths per call


def _check_jagged(run, model, jagged):
    """``run``'s shared calls of padded histories equal the model's, and ran cut to lengths."""
    with torch.no_grad():
        for i, lengths in enumerate(PADDED):
            kwargs, index = _padded_histories(lengths, seed=60 + i)
            want = model(**replicated(kwargs, index))
            got = run(**kwargs, candidate_to_request=index)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=str(lengths))
            assert (want - want[0]).abs().max() > 1e-3, "outputs barely vary across rows"
    assert jagged.split_calls >= 2, "the long histories did not run jagged"


@pytest.mark.parametrize("portable", [False, True])
def test_a_saved_program_runs_a_padded_call_jagged(model_and_compiled, portable, tmp_path):
    """``rocs.export`` carries the compiled model's jagged plan; ``rocs.save`` and ``rocs.load``
    keep it, and the loaded program cuts each padded call to its requests' lengths."""
    model, cm = model_and_compiled
    program = rocs.export(cm, portable=portable)
    plan = rocs.jagged_plan(program)
    assert plan["histories"] == {"hist_item_ids": [1], "hist_cat_ids": [1]}
    rocs.save(program, tmp_path / "din.pt2")
    loaded = rocs.load(tmp_path / "din.pt2")
    assert rocs.jagged_plan(loaded) == plan
    _check_jagged(loaded, model, loaded._jagged)
    kwargs, index = _padded_histories([40, 3], seed=70)  # positional arguments too
    args = [kwargs[name] for name in loaded.argument_names[:-1]]
    lengths = torch.tensor([40, 3])
    nested = {  # histories as jagged nested tensors: padded with 0, as the compiled model pads
        name: torch.nested.nested_tensor_from_jagged(
            torch.cat([row[:n] for row, n in zip(kwargs[name], lengths.tolist())]),
            torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
        )
        for name in ("hist_item_ids", "hist_cat_ids")
    }
    with torch.no_grad():
        want = model(**replicated(kwargs, index))
        torch.testing.assert_close(loaded(*args, candidate_to_request=index), want)
        torch.testing.assert_close(loaded(**{**kwargs, **nested}, candidate_to_request=index), want)


def test_onnx_runtime_runs_a_padded_call_jagged(model_and_compiled, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    model, cm = model_and_compiled
    path = rocs.export_onnx(rocs.export(cm, portable=True), tmp_path / "din.onnx")
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(path, options)
    names = [i.name for i in session.get_inputs()]

    def run(**feeds):
        outputs = session.run(None, {n: feeds[n].numpy() for n in names})
        return torch.from_numpy(outputs[0])

    jagged = rocs.JaggedProgram(run, rocs.jagged_plan(session.get_modelmeta().custom_metadata_map))
    _check_jagged(jagged, model, jagged)


@pytest.mark.slow  # an AOTInductor build takes minutes on two cores
def test_an_aoti_package_runs_a_padded_call_jagged(model_and_compiled, tmp_path):
    model, cm = model_and_compiled
    package = rocs.aoti_package(rocs.export(cm, portable=True), tmp_path / "din.pt2")
    runner = torch._inductor.aoti_load_package(package)
    jagged = rocs.JaggedProgram(runner, rocs.jagged_plan(runner.get_metadata()))
    _check_jagged(jagged, model, jagged)
