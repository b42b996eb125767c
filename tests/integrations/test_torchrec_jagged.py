"""A TorchRec sequence model whose history is a ``KeyedJaggedTensor`` key read at the batch's
longest row: one compile serves every length, and a call whose histories differ in length runs
as groups of requests, each cut to its longest (``runtime/call/jagged.py`` over the KJT's padded
keys), exact against eager in every layout, with eager's gradients from a training compile."""

from __future__ import annotations

import pytest
import torch

import rocs_compiler as rocs

pytest.importorskip(
    "torchrec", reason="TorchRec models need torchrec (see the README's test command)"
)
from models_zoo import torchrec_models as zoo

HISTORY = "sparse_features.history.lengths"


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = zoo.HistoryAttention()
    with torch.no_grad():  # TorchRec's tables start near zero: scores that vary past the tolerance
        for table in model.embeddings.embeddings.values():
            table.weight.normal_(0.0, 1.0)
    return model


def _compile(model, **kwargs):
    example = zoo.draw([2, 1, 3], seed=0, histories=[3, 1, 2])
    return rocs.compile(model, zoo.REQUEST, example_inputs=(example.dense, example.kjt), **kwargs)


def _layouts(cm, batch) -> dict:
    return {
        "drop-in": lambda: cm(batch.dense, batch.kjt),
        "shared": lambda: cm(batch.dense, batch.shared, candidate_to_request=batch.index),
        "shared, inverse indices": lambda: cm(batch.dense, batch.shared),
    }


def test_a_kjt_history_is_cut_to_each_requests_length_in_every_layout():
    model = _model().eval()
    cm = _compile(model, options=rocs.Options(autotune=False))  # no call timed against eager
    assert cm._jagged.source.input == HISTORY
    assert HISTORY in cm.report().jagged
    # (candidates per request, history lengths, whether the call pays for a cut: one long
    # history beside many short rows, a row without history run at the call's width)
    cases = [
        ([1] + [2] * 12, [600] + [1, 4, 9] * 4, True),
        ([3, 1, 2, 4], [300, 2, 0, 17], False),
        ([2, 2, 1], [40, 40, 3], False),
    ]
    for seed, (counts, histories, cut) in enumerate(cases, start=30):
        batch = zoo.draw(counts, seed=seed, histories=histories)
        with torch.no_grad():
            want = model(batch.dense, batch.kjt)
            assert float(want.std()) > 1e-2  # rows differ far past the tolerance
            for layout, run in _layouts(cm, batch).items():
                before = cm._jagged.split_calls
                torch.testing.assert_close(run(), want, rtol=1e-5, atol=1e-5, msg=layout)
                if cut:  # the long history's group apart from the short ones
                    assert cm._jagged.split_calls == before + 1, layout


def test_one_compile_serves_every_history_length():
    """Lengths 1 to 160, one long history beside short ones in each call: exact, with no
    compile past the first (a KJT key's width is a dynamic size of the one program)."""
    model = _model(1).eval()
    cm = _compile(model)
    program = cm.graph_module
    with torch.no_grad():
        for length in [1, 2, 3, 5, 8, 13, 31, 64, 100, 160]:
            batch = zoo.draw([2, 3, 1], seed=length, histories=[length, 1, max(length // 7, 1)])
            torch.testing.assert_close(
                cm(batch.dense, batch.shared, candidate_to_request=batch.index),
                model(batch.dense, batch.kjt),
                rtol=1e-5,
                atol=1e-5,
                msg=f"length {length}",
            )
    assert cm.graph_module is program


def test_a_training_compile_cut_to_lengths_gives_eagers_gradients():
    model = _model(2).train()
    cm = _compile(model, training=True)
    batch = zoo.draw([1] + [2] * 12, seed=40, histories=[600] + [1, 4, 9] * 4)
    target = torch.randn(batch.dense.shape[0], 1, generator=torch.Generator().manual_seed(1))

    def gradients(run) -> dict:
        model.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(run(), target).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return grads

    want = gradients(lambda: model(batch.dense, batch.kjt))
    assert float(next(iter(want.values())).abs().max()) > 1e-4
    for layout, run in _layouts(cm, batch).items():
        before = cm._jagged.split_calls
        got = gradients(run)
        assert cm._jagged.split_calls == before + 1, layout
        assert got.keys() == want.keys(), layout
        for name, grad in want.items():
            atol = 1e-5 * max(1.0, float(grad.abs().max()))
            torch.testing.assert_close(
                got[name], grad, rtol=1e-4, atol=atol, msg=f"{layout} {name}"
            )


def test_lengths_that_disagree_with_the_ids_are_refused_naming_the_key():
    """A KJT states each row's length beside its values: lengths that add up to more ids than it
    holds, or a negative length, are refused with the key (TorchRec fails deep in a split)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    cm = _compile(_model(3).eval())
    batch = zoo.draw([1, 2], seed=41, histories=[4, 2])
    kjt, history_row = batch.kjt, len(batch.index)  # the history's first row follows user_id's
    for change, message in [(3, r"lengths add up to \d+ ids but it holds"),
                            (-5, r"key 'history' has a negative length \(-1\) at row 0")]:
        lengths = kjt.lengths().clone()
        lengths[history_row] += change
        bad = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=lengths)
        with pytest.raises(rocs.InputError, match=message), torch.no_grad():
            cm(batch.dense, bad)


@pytest.mark.parametrize("portable", [False, True])
def test_the_exported_program_takes_the_history_key_at_every_width(portable):
    """The exported program takes every key as padded pieces (``formats/kjt.py``), the history
    key's width a dynamic size: one program, exact at every width."""
    model = _model(4).eval()
    cm = _compile(model)
    run = rocs.export(cm, portable=portable).module()
    with torch.no_grad():
        for histories, call, batch in _pieces_calls(cm):
            got = run(**call)
            want = model(batch.dense, batch.kjt)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=str(histories))


def _pieces_calls(cm):
    """Shared-layout calls of the pieces program at widths 1 to 300, with eager's outputs."""
    split = cm.input_format.splits[0]
    for seed, histories in enumerate([[1, 1], [7, 0, 2], [300, 5, 1]], start=60):
        batch = zoo.draw([2, 1, 3][: len(histories)], seed=seed, histories=histories)
        call = {
            "dense_features": batch.dense,
            "sparse_features": split.pieces(batch.shared),
            "candidate_to_request": batch.index,
        }
        yield histories, call, batch


def test_onnx_runtime_takes_the_history_key_at_every_width(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    import torch.fx._pytree as fx_pytree

    model = _model(5).eval()
    cm = _compile(model)
    program = rocs.export(cm, portable=True)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(rocs.export_onnx(program, tmp_path / "kjt.onnx"), options)
    with torch.no_grad():
        for histories, call, batch in _pieces_calls(cm):
            flat = fx_pytree.tree_flatten_spec(((), call), program.call_spec.in_spec)
            feeds = {spec.name: t.numpy() for spec, t in zip(session.get_inputs(), flat)}
            got = torch.from_numpy(session.run(None, feeds)[0])
            want = model(batch.dense, batch.kjt)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=str(histories))


@pytest.mark.slow  # an AOTInductor build takes minutes on two cores
def test_an_aoti_package_takes_the_history_key_at_every_width(tmp_path):
    model = _model(6).eval()
    cm = _compile(model)
    package = rocs.aoti_package(rocs.export(cm, portable=True), tmp_path / "kjt.pt2")
    runner = torch._inductor.aoti_load_package(package)
    with torch.no_grad():
        for histories, call, batch in _pieces_calls(cm):
            want = model(batch.dense, batch.kjt)
            got = runner(**call)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=str(histories))
