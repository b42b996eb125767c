"""The zoo's models that take any history length up to a cap (target attention, HSTU), through
the export doors: ``rocs.export`` (plain and portable) takes every length up to the cap, exact,
and refuses a longer one naming the input and the cap (export's range of the length's symbol,
checked by ``program.module()`` before the graph runs); ONNX Runtime takes every length up to
the cap, and refuses a longer one at the program's input check (ONNX keeps no ranges: the check
is traced into the graph, ``export/input_checks.py``); an AOTInductor package refuses a longer one by its input checks (``rocs.compile``
itself: ``tests/runtime/test_zoo_history_lengths.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.fx._pytree as fx_pytree

import rocs_compiler as rocs
from rocs_compiler.export import input_signature

from dynamic_histories import CAPPED


@pytest.fixture(scope="module", params=sorted(CAPPED))
def compiled(request):
    zoo = CAPPED[request.param]
    model = zoo.model()
    return zoo, model, zoo.compile(model)


@pytest.mark.parametrize("portable", [False, True])
def test_an_exported_program_takes_every_length_up_to_the_cap_and_refuses_a_longer_one(
    compiled, portable
):
    zoo, model, cm = compiled
    program = rocs.export(cm, portable=portable)
    shapes = input_signature(program)
    assert isinstance(shapes["hist_item_ids"]["shape"][1], str)  # a size, not a constant
    run = program.module()
    with torch.no_grad():
        for i, length in enumerate((1, 7, zoo.cap)):
            kwargs, index, as_replicated = zoo.call(length, seed=30 + i)
            got = run(**kwargs, candidate_to_request=index)
            want = model(**as_replicated)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"length {length}")
        kwargs, index, _ = zoo.call(zoo.cap + 1, seed=33)
        with pytest.raises(AssertionError, match=rf"hist_item_ids.*<= {zoo.cap}"):
            run(**kwargs, candidate_to_request=index)


def test_onnx_runtime_takes_every_length_up_to_the_cap_and_fails_past_it(compiled, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    zoo, model, cm = compiled
    program = rocs.export(cm, portable=True)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 4  # the failure below is expected: ORT need not print it
    session = ort.InferenceSession(rocs.export_onnx(program, tmp_path / "m.onnx"), options)

    def feeds(kwargs, index):
        flat = fx_pytree.tree_flatten_spec(
            ((), {**kwargs, "candidate_to_request": index}), program.call_spec.in_spec
        )
        return {spec.name: t.numpy() for spec, t in zip(session.get_inputs(), flat)}

    with torch.no_grad():
        for i, length in enumerate((1, 7, zoo.cap)):
            kwargs, index, as_replicated = zoo.call(length, seed=40 + i)
            want = model(**as_replicated).numpy()
            got = session.run(None, feeds(kwargs, index))[0]
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"length {length}")
    kwargs, index, _ = zoo.call(zoo.cap + 1, seed=43)
    with pytest.raises(Exception, match=r"rocs input check failed: .*must be at most the cap"):
        session.run(None, feeds(kwargs, index))


@pytest.mark.slow  # an AOTInductor build takes a minute or more on two cores
def test_an_aoti_package_refuses_a_length_past_the_cap(tmp_path):
    zoo = CAPPED["target_attention"]
    model = zoo.model()
    package = rocs.aoti_package(rocs.export(zoo.compile(model), portable=True), tmp_path / "m.pt2")
    runner = torch._inductor.aoti_load_package(package)
    with torch.no_grad():
        for i, length in enumerate((1, zoo.cap)):
            kwargs, index, as_replicated = zoo.call(length, seed=50 + i)
            got = runner(**kwargs, candidate_to_request=index)
            torch.testing.assert_close(got, model(**as_replicated), rtol=1e-5, atol=1e-5)
        kwargs, index, _ = zoo.call(zoo.cap + 1, seed=52)
        with pytest.raises(RuntimeError, match=rf"too large at 1, expected to be <= {zoo.cap}"):
            runner(**kwargs, candidate_to_request=index)


def test_a_jagged_program_refuses_a_padded_width_past_the_cap_before_cutting_it(tmp_path):
    """Target attention's saved program cuts its calls (its truncation proof holds); a call padded
    past the positional table's rows whose every history fits under it would run, cut, in
    groups the program takes; the original refuses it, and so does the loaded program, before
    any group is cut."""
    zoo = CAPPED["target_attention"]
    model = zoo.model()
    rocs.save(rocs.export(zoo.compile(model)), tmp_path / "ta.pt2")
    loaded = rocs.load(tmp_path / "ta.pt2")
    kwargs, index, as_replicated = zoo.call(zoo.cap, seed=50)
    with torch.no_grad():
        torch.testing.assert_close(loaded(**kwargs, candidate_to_request=index), model(**as_replicated))
        short = {**kwargs, "hist_item_ids": kwargs["hist_item_ids"][:, :3]}
        pad = torch.zeros(short["hist_item_ids"].shape[0], zoo.cap + 5 - 3, dtype=torch.int64)
        wide = {**short, "hist_item_ids": torch.cat([short["hist_item_ids"], pad], 1)}
        with pytest.raises(rocs.InputError, match=rf"'hist_item_ids' has size {zoo.cap + 5}.*at most {zoo.cap}"):
            loaded(**wide, candidate_to_request=index)
        torch.testing.assert_close(
            loaded(**short, candidate_to_request=index),
            model(**{**as_replicated, "hist_item_ids": short["hist_item_ids"][index]}),
        )


@pytest.mark.parametrize("name", sorted(CAPPED))
def test_the_torch_compile_backend_takes_every_length_up_to_the_cap(name):
    """Through ``torch.compile``'s door too: drop-in and shared calls at every length up to the
    cap, exact, with no graph compiled past the second length (dynamo makes the length dynamic
    there, and the rewrite of its graph takes it dynamic)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    zoo = CAPPED[name]
    model = zoo.model()
    backend = rocs.backend(list(zoo.module.REQUEST_INPUTS), inductor=False)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    graphs, start = [], counters["stats"]["unique_graphs"]
    with torch.no_grad():
        for i, length in enumerate(zoo.lengths()):
            kwargs, index, as_replicated = zoo.call(length, seed=50 + i)
            want = model(**as_replicated)
            assert want.std() > 1e-1 or want.numel() < 2
            got = compiled(**as_replicated)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"length {length}")
            got = rocs.shared_call(compiled, **kwargs, candidate_to_request=index)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"shared {length}")
            graphs.append(counters["stats"]["unique_graphs"] - start)
    assert len(set(graphs[2:])) == 1, f"a new length compiled a graph: {graphs}"
